"""FSDPEngine: the TrainEngine of engines/training/base.py on PyTorch FSDP2 (`fully_shard`), one FSDP
unit per decoder layer (fsdp/build.py). `forward_backward_batch` cuts the rank's batch into packed
micro-batches and normalises the loss by global counts, so the ranks' gradients are summed (divide
factor 1), reduced once, on the last one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from engines.distributed import (
    all_reduce,
    data_parallel_mesh,
    init_distributed,
    resolve_device,
    set_collective_timeout,
)
from engines.kernels.attention import register as segment_attention_name
from engines.kernels.shared_prompt import pack_shared, prompt_groups
from engines.training.adamw import AdamWSettings, adamw_step, build_adamw
from engines.training.base import (
    MAX_SUFFIX,
    NEEDS_BACKWARD,
    EngineOutput,
    GlobalCounts,
    LossFn,
    TrainEngine,
    combine_metric,
    loss_rows,
)
from engines.training.fsdp import lora
from engines.training.fsdp.build import ModelBuildMixin, PlacementMixin
from engines.training.fsdp.state import CheckpointMixin
from engines.training.microbatch import MicroBatchPlanner, PromptGroups
from engines.training.multi_lora import adapters_off
from engines.training.packing import pack, response_columns, unpack
from schema.engine import EngineConfig, OptimizerConfig, SchedulerConfig

REQUIRED_KEYS = ("input_ids", "attention_mask", "response_mask")


class FSDPEngine(ModelBuildMixin, CheckpointMixin, PlacementMixin, TrainEngine):
    """A policy (causal LM) or value model sharded with FSDP2 over all ranks of the process group."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.skipped_steps = 0
        self._offloaded = {"model": False, "optimizer": False}

    # ---- build ---------------------------------------------------------------------------------

    def initialize(self) -> None:
        init_distributed(self.device)
        self.mesh = data_parallel_mesh(self.device)
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        self.is_collect_rank = True
        torch.manual_seed(self.config.seed)  # the value head's initialisation
        self.model = self._build_model()
        self._shard(self.model)
        mb = self.config.micro_batch
        self.planner = MicroBatchPlanner(
            mb.micro_batch_size,
            mb.max_tokens_per_micro_batch,
            self.hf_config.hidden_size,
            self.device.type,
            self._agree,
        )
        if self.config.trainable:
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = build_adamw(params, AdamWSettings.of(self.config.optim))
            schedule = warmup_then_decay(self.config.scheduler)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self._offload_as_configured()
        set_collective_timeout(self.config.collective_timeout_s)

    # ---- optimizer and schedule ----------------------------------------------------------------

    def optimizer_zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, params: OptimizerConfig | None = None) -> float:
        settings = AdamWSettings.of(params or self.config.optim)
        grad_norm = adamw_step(
            self.optimizer, list(self.model.parameters()), settings, override=params is not None
        )
        if not math.isfinite(grad_norm):
            self.skipped_steps += 1
        return grad_norm

    def lr_scheduler_step(self) -> float:
        self.scheduler.step()
        return float(self.scheduler.get_last_lr()[0])

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    def set_learning_rate(self, lr: float) -> None:
        """Change the base learning rate (a hyper-parameter edit); the schedule's factor still applies."""
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = group["lr"] / base * lr if base else lr
        self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]

    # ---- compute -----------------------------------------------------------------------------

    def forward_backward_batch(
        self,
        batch: TensorDict,
        loss_fn: LossFn | None,
        forward_only: bool = False,
        compute_entropy: bool = False,
        temperature: float = 1.0,
        counts: GlobalCounts | None = None,
    ) -> EngineOutput:
        missing = [k for k in REQUIRED_KEYS if k not in batch.keys()]
        if missing:
            raise KeyError(
                f"forward_backward_batch needs batch keys {missing} (see engines/training/base.py)"
            )
        if not forward_only and (loss_fn is None or self.optimizer is None):
            raise ValueError("a backward pass needs a loss_fn and a trainable engine; use forward_only=True")
        batch = batch.to(self.device)
        width = batch["response_mask"].shape[1]
        if counts is None:  # one call = one optimizer batch; else the caller's (engines/training/base.py)
            counts = self._global_counts(batch, width)
        lengths = batch["attention_mask"].sum(1).tolist()
        groups = self._prompt_groups(batch, width)
        needs_backward = None
        if not forward_only and NEEDS_BACKWARD in batch.keys():
            needs_backward = batch[NEEDS_BACKWARD].tolist()
        shared = None
        if groups is not None:
            prompt_lens = batch["attention_mask"][:, : batch["attention_mask"].shape[1] - width].sum(1)
            shared = PromptGroups(groups, prompt_lens.tolist())
        split = self.planner.split(lengths, needs_backward, shared)
        sharded: FSDPModule = self.model  # type: ignore[assignment]
        pieces: list[dict[str, torch.Tensor]] = []
        metrics: dict[str, float] = {}
        backward = not forward_only
        # ZeRO-2 (reshard_after_forward False): the gathered parameters also stay across the call's
        # micro-batches, so each layer is gathered (cast to bf16 and copied) once per call, not twice
        # per micro-batch; the last backward, or the end of the call, frees them.
        keep_gathered = self.sharded and not self.reshard_after_forward
        losses: list[torch.Tensor] = []  # summed once at the end: no device sync per micro-batch
        for i, index in enumerate(split.backward + split.forward):
            micro = batch[torch.tensor(index, device=self.device)]
            with_grad = backward and i < len(split.backward)
            if with_grad and self.sharded:
                last = i == len(split.backward) - 1
                sharded.set_requires_gradient_sync(last)
                if keep_gathered:
                    sharded.set_reshard_after_backward(last)
            with torch.set_grad_enabled(with_grad):
                outputs = self._forward_micro(micro, width, compute_entropy, temperature)
                if loss_fn is not None:
                    loss, loss_metrics = loss_fn(micro, outputs, counts)
                    if with_grad:
                        loss.backward()
                    losses.append(loss.detach())
                    for key, value in loss_metrics.items():
                        combine_metric(metrics, key, value)
            pieces.append({k: v.detach() for k, v in outputs.items()})
        for _ in range(split.idle_forwards):  # in step with ranks that have more forward-only rows
            with torch.no_grad():
                self._forward_micro(batch[:1], width, compute_entropy, temperature)
        if keep_gathered:
            self._reshard()
        if losses:
            metrics["loss"] = float(torch.stack(losses).sum())
        if backward and not split.backward:
            self._zero_gradients()
        plan = split.backward + split.forward
        return EngineOutput(self._in_original_order(pieces, plan), self._reduce_over_ranks(metrics))

    def _reshard(self) -> None:
        """Free every gathered parameter (a forward-only micro-batch leaves them gathered under ZeRO-2)."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _zero_gradients(self) -> None:
        """The gradient of a call where no row has one: exactly zero, as a backward would have left
        it. The optimizer step still runs on it (Adam's moments move the weights on a zero gradient)."""
        for param in self.model.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)

    def _global_counts(self, batch: TensorDict, width: int) -> GlobalCounts:
        tokens, sequences = all_reduce([float(batch["response_mask"].sum()), loss_rows(batch)], self.device)
        return GlobalCounts(int(tokens), int(sequences), self._agree(width))

    def _agree(self, count: int) -> int:
        return int(all_reduce([count], self.device, "max")[0])

    def _forward_micro(
        self, micro: TensorDict, width: int, compute_entropy: bool, temperature: float
    ) -> dict[str, torch.Tensor]:
        """Per-token outputs on the micro-batch's [mb, R] response grid; one copy of each repeated
        prompt when it can be shared (engines/kernels/shared_prompt.py)."""
        groups = self._prompt_groups(micro, width)
        mask = None
        if groups is not None:
            packed = pack_shared(micro["input_ids"], micro["attention_mask"], width, groups)
            layout = {"shared_prompt": packed}
        else:
            packed = pack(micro["input_ids"], micro["attention_mask"])
            layout = {"cu_seq_lens_q": packed.cu_seq_lens()}
            # Sequence boundaries: flash-attention reads them from the restarting positions, the
            # segment attention from cu_seq_lens_q; plain SDPA or eager need the block-diagonal mask.
            if self.attn_implementation not in ("flash_attention_2", segment_attention_name()):
                mask = packed.block_causal_mask()
        with self._autocast():
            flat = self.model(
                packed.input_ids,
                packed.position_ids,
                mask,
                packed.targets,
                temperature,
                compute_entropy,
                **layout,
            )
        mask_r = micro["response_mask"].to(torch.float32)
        if groups is None:
            return {k: response_columns(unpack(v, packed), width) * mask_r for k, v in flat.items()}
        rows = len(micro)
        return {
            k: v.new_zeros(rows * width).index_put((packed.grid_index,), v).view(rows, width) * mask_r
            for k, v in flat.items()
        }

    def _autocast(self) -> AbstractContextManager[None]:
        """The forward's autocast region: bf16 products on one CPU rank asked for bf16, else none."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _prompt_groups(self, micro: TensorDict, width: int) -> list[list[int]] | None:
        """The rows grouped by prompt, when some prompt repeats and can be shared."""
        if not self.config.share_prompts or self.attn_implementation != segment_attention_name():
            return None
        groups = prompt_groups(micro["input_ids"], micro["attention_mask"], width)
        return groups if groups is not None and len(groups) < len(micro) else None

    @staticmethod
    def _in_original_order(pieces: list[dict[str, torch.Tensor]], plan: list[list[int]]) -> dict:
        order = torch.tensor([i for index in plan for i in index])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return {
            k: torch.cat([p[k] for p in pieces])[inverse.to(pieces[0][k].device)].cpu() for k in pieces[0]
        }

    def _reduce_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        """Sum the metrics over ranks; those named *_max by max (engines/training/base.py)."""
        out: dict[str, float] = {}
        for op in ("sum", "max"):
            keys = sorted(k for k in metrics if k.endswith(MAX_SUFFIX) == (op == "max"))
            if keys:
                out.update(zip(keys, all_reduce([metrics[k] for k in keys], self.device, op), strict=True))
        return out

    # ---- weights out -------------------------------------------------------------------------

    def get_per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors one at a time, gathered lazily; every rank must iterate in step."""
        if self._offloaded["model"]:
            raise RuntimeError("parameters are offloaded: read them inside train_mode() or eval_mode()")
        to_hf = type(self.model).hf_name
        for name, tensor in self.model.state_dict().items():
            if self.adapted_modules and not lora.is_adapter(name):
                continue  # with LoRA the stream is the adapter (adapter_config() says so)
            if isinstance(tensor, DTensor):
                # One rank holds the whole tensor: skip the (self-)all-gather, which was 57% of a sync.
                tensor = tensor.to_local() if self.dp_size == 1 else tensor.full_tensor()
            yield (lora.peft_name(to_hf(name)) if self.adapted_modules else to_hf(name)), tensor.detach()

    def adapter_config(self) -> dict | None:
        """PEFT's adapter_config.json of the adapter `get_per_tensor_param` streams; None: full weights."""
        if not self.adapted_modules:
            return None
        return lora.adapter_config_dict(self.config.lora, self.config.model_path, self.adapted_modules)

    def adapters_off(self) -> AbstractContextManager[None]:
        return adapters_off(self.model) if self.adapted_modules else super().adapters_off()


def warmup_then_decay(s: SchedulerConfig) -> Callable[[int], float]:
    """The learning rate's factor at a step: a linear warmup, then constant or cosine to min_lr_ratio."""
    warmup, total = s.resolved_warmup_steps, s.total_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if s.kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
