"""Sampling from many adapters (and the base) in one decode batch on the multi-LoRA model: each request
owns a contiguous block of rows and its own seeded generator, so what it draws does not depend on the
batch. A log-prob is taken before top-k / top-p filtering; a stop token or string ends a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate, pairwise

import torch

from engines.rollout.base import SamplingParams
from engines.rollout.hf import left_pad
from engines.rollout.sampling import sample_next
from engines.training.multi_lora import MultiLoraLinear, rows


@dataclass
class SampleRequest:
    adapter: str | None
    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Sequence:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = "length"
    done: bool = False


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    layers: dict[str, MultiLoraLinear],
    requests: list[SampleRequest],
    pad_id: int,
    tokenizer=None,
) -> list[list[Sequence]]:
    """Every request's `num_samples` sequences, decoded in one batch."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    prompts = [r.prompt for r in requests for _ in range(r.num_samples)]
    segments = [(r.adapter, r.num_samples) for r in requests]
    blocks = list(pairwise(accumulate([0] + [r.num_samples for r in requests])))  # each request's rows
    generators = [torch.Generator(device=device) for _ in requests]
    for gen, r in zip(generators, requests, strict=True):
        gen.manual_seed(r.seed) if r.seed is not None else gen.seed()
    seqs = [[Sequence() for _ in range(r.num_samples)] for r in requests]

    ids, mask = left_pad(prompts, pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    steps = max(r.max_tokens for r in requests)
    with rows(layers, segments):
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
        ).logits[:, -1]
        for step in range(steps):
            next_tokens = torch.full((len(prompts),), pad_id, dtype=torch.long, device=device)
            for r, (lo, hi), gen, block in zip(requests, blocks, generators, seqs, strict=True):
                if step >= r.max_tokens or all(s.done for s in block):
                    continue
                picked, lps = _pick(logits[lo:hi].float(), r, gen)
                next_tokens[lo:hi] = picked
                for s, tok, lp in zip(block, picked.tolist(), lps.tolist(), strict=True):
                    if not s.done:
                        _append(s, tok, lp, r, tokenizer)
            if all(s.done for block in seqs for s in block):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            logits = model(
                input_ids=next_tokens[:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
    return seqs


def _pick(logits: torch.Tensor, r: SampleRequest, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout engine's draw (engines/rollout/sampling.py); the log-prob is read before top-k /
    top-p filtering, where the rollout engine reads it after."""
    params = SamplingParams.model_construct(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    tokens, log_probs = sample_next(logits, params, gen)
    if 0 < r.top_k < logits.shape[-1] or r.top_p < 1:
        scaled = logits / (r.temperature if r.temperature > 0 else 1.0)
        log_probs = scaled.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, log_probs


def _append(s: Sequence, token: int, logprob: float, r: SampleRequest, tokenizer) -> None:
    s.tokens.append(token)
    s.logprobs.append(logprob)
    if token in r.stop_ids:
        s.done, s.stop_reason = True, "stop"
    elif r.stop_strings and tokenizer is not None:
        text = tokenizer.decode(s.tokens)
        if any(stop in text for stop in r.stop_strings):
            s.done, s.stop_reason = True, "stop"
    if not s.done and len(s.tokens) >= r.max_tokens:
        s.done = True
