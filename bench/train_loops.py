"""The two training loops bench/train_engine.py compares, and what they train on.

The data (left-padded prompts, right-padded responses of random real lengths, random advantages),
the token-mean policy-gradient loss, the plain transformers loop (the baseline), FSDPEngine's step,
and the turn-taking that makes configurations in separate processes never compute at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

if TYPE_CHECKING:
    from engines.training.base import GlobalCounts
    from engines.training.fsdp.engine import FSDPEngine


@dataclass(frozen=True)
class Settings:
    """One benchmark run, resolved from the command line; handed to every worker process."""

    model: str
    model_dir: str
    device: str
    batch: int
    prompt_len: int
    response_len: int
    micro_batch_size: int
    max_tokens: int
    iters: int
    warmup: int
    threads: int
    cudnn_sdpa: bool = True  # CUDA only: whether SDPA may pick its cuDNN backend
    lr: float = 1e-5
    seed: int = 0


# ---- data and loss -------------------------------------------------------------------------------


def make_batch(settings: Settings, seed: int, vocab: int) -> TensorDict:
    """Prompts of 1/4 to all of prompt_len real tokens (left-padded), responses of 1/8 to all of
    response_len (right-padded), pad id 0, and random advantages."""
    g = torch.Generator().manual_seed(seed)
    b, p, r = settings.batch, settings.prompt_len, settings.response_len
    prompt_real = torch.randint(max(1, p // 4), p + 1, (b,), generator=g)
    response_real = torch.randint(max(1, r // 8), r + 1, (b,), generator=g)
    prompt_mask = torch.arange(p)[None] >= (p - prompt_real)[:, None]
    response_mask = torch.arange(r)[None] < response_real[:, None]
    mask = torch.cat([prompt_mask, response_mask], 1).long()
    ids = torch.randint(4, vocab, (b, p + r), generator=g) * mask
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "responses": ids[:, p:],
            "response_mask": mask[:, p:].clone(),
            "advantages": torch.randn(b, r, generator=g),
        },
        batch_size=[b],
    )


def make_batches(settings: Settings, vocab: int) -> list[TensorDict]:
    """Warm-up batches first, then one batch per timed step; every configuration gets the same."""
    return [make_batch(settings, settings.seed + i, vocab) for i in range(settings.warmup + settings.iters)]


def pg_token_mean(
    micro: TensorDict, outputs: dict[str, torch.Tensor], counts: GlobalCounts
) -> tuple[torch.Tensor, dict[str, float]]:
    """-advantage * log_prob, summed over response tokens and divided by the global token count."""
    loss = (-micro["advantages"] * outputs["log_probs"] * micro["response_mask"]).sum() / counts.tokens
    return loss, {}


# ---- the two training loops ---------------------------------------------------------------------


def baseline_step_fn(settings: Settings, device: torch.device) -> Callable[[TensorDict], None]:
    """A plain unsharded training step: padded forward per micro-batch, backward, clip, AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        settings.model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    # fp32 master weights with bf16 compute on CUDA, as the engine's mixed-precision policy does.
    use_bf16 = device.type == "cuda"
    width = settings.response_len

    def step(batch: TensorDict) -> None:
        batch = batch.to(device)
        total = batch["response_mask"].sum()
        for start in range(0, len(batch), settings.micro_batch_size):
            micro = batch[start : start + settings.micro_batch_size]
            ids, mask = micro["input_ids"], micro["attention_mask"]
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            log_probs = torch.log_softmax(logits[:, -width - 1 : -1].float(), -1)
            picked = log_probs.gather(-1, ids[:, -width:, None]).squeeze(-1)
            loss = (-micro["advantages"] * picked * micro["response_mask"]).sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def engine_step_fn(settings: Settings, micro_batch: dict) -> tuple[Callable[[TensorDict], None], FSDPEngine]:
    """FSDPEngine's training step (forward_backward_batch + optimizer_step); returns it and the engine."""
    from engines.training.fsdp.engine import FSDPEngine
    from schema.engine import EngineConfig

    config = EngineConfig(
        model_path=settings.model_dir,
        device=settings.device,
        micro_batch={k: v for k, v in micro_batch.items() if k != "auto"},  # "auto": the defaults
        optim={"lr": settings.lr, "grad_clip": 1.0},
    )
    engine = FSDPEngine(config)
    engine.initialize()

    def step(batch: TensorDict) -> None:
        engine.forward_backward_batch(batch, pg_token_mean)
        engine.optimizer_step()

    return step, engine


class Turns:
    """Steps of all configurations in rotation: round k runs every configuration's step k, one at a
    time, starting one further along each round. A neighbour's load on shared cores then falls on all
    configurations alike, and no two configurations ever compute at once."""

    def __init__(self, ctx: BaseContext, slots: int, timeout_s: float = 1800.0) -> None:
        self.slots, self.timeout_s = slots, timeout_s
        self._turn = ctx.Value("i", 0, lock=False)  # guarded by the condition's lock
        self._cond = ctx.Condition()

    def wait(self, step: int, slot: int) -> None:
        target = step * self.slots + (slot - step) % self.slots
        with self._cond:
            if not self._cond.wait_for(lambda: self._turn.value >= target, timeout=self.timeout_s):
                raise TimeoutError(f"configuration {slot} waited {self.timeout_s}s for its step {step}")

    def done(self) -> None:
        with self._cond:
            self._turn.value += 1
            self._cond.notify_all()


def timed_steps(
    step: Callable[[TensorDict], None],
    batches: list[TensorDict],
    sync: Callable[[], None],
    turn: Callable[[int], AbstractContextManager[None]],
) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of every step; `sync` lines up the ranks and the device.

    CPU seconds count every thread of the process: well under wall * threads means the process was
    kept waiting (by a neighbour on shared cores, or by another rank)."""
    wall, cpu = [], []
    for i, batch in enumerate(batches):
        with turn(i):
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            step(batch)
            sync()
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return wall, cpu
