"""FSDPEngine: the TrainEngine of engines/base.py (docs/ARCHITECTURE.md §3.4) on PyTorch FSDP2 (`fully_shard`).

Build order (`initialize`): process group → model in fp32 on the CPU → one FSDP unit per decoder
layer, then the root → optimizer → LR schedule → offload if configured. Master weights stay fp32;
on CUDA the compute runs in bf16 with fp32 gradient reduction (MixedPrecisionPolicy).

bf16 (`dtype: bfloat16`) on one CPU rank is not wrapped either: the weights stay fp32 and the
forward runs under `torch.autocast`, so the linear layers multiply in bf16 (on a CPU with AMX,
3.2-4.3x fp32's rate at SmolLM2's shapes) while the residual stream, the norms, attention
(engines/attention.py) and the log-prob head (engines/logprobs.py) stay fp32. FSDP2's mixed
precision there cast every parameter on every micro-batch and ran attention in bf16, whose CPU
kernel is slow: a SmolLM2-135M update in a job took 13.2 s that way, 8.7 s this way (bench/RESULTS.md).

One rank computing in fp32 holds the whole model and has nothing to shard, gather or reduce, so its
model is not wrapped (as torchtitan leaves a one-device run unwrapped): FSDP2 would only make every
parameter a DTensor, whose dispatch (sharding propagation on fake tensors) cost ~10% of a qwen2-1m
update in the optimizer step, gradient clipping and zeroing, plus the per-layer hooks. Checkpoints
go through the same distributed state-dict API either way, so they load across world sizes.

A call of `forward_backward_batch` cuts the rank's batch into micro-batches, packs each without
padding, and hands the loss function per-token outputs on the [mb, R] response grid together with
the global counts. The loss is normalised by those global counts, so the ranks' gradients are summed
(divide factor 1), and gradient reduction runs once, on the last micro-batch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from engines import rms_norm, rotary, swiglu
from engines.attention import register as segment_attention_name
from engines.base import (
    MAX_SUFFIX,
    NEEDS_BACKWARD,
    EngineOutput,
    GlobalCounts,
    LossFn,
    TrainEngine,
    combine_metric,
)
from engines.distributed import (
    all_reduce_max,
    all_reduce_max_floats,
    all_reduce_sum,
    data_parallel_mesh,
    init_distributed,
    resolve_device,
)
from engines.fsdp import lora
from engines.fsdp.modules import (
    PolicyModel,
    ValueModel,
    decoder_layers,
    load_hf_model,
    sparse_tied_embedding,
)
from engines.fsdp.optim import OptimizerMixin
from engines.fsdp.state import CheckpointMixin
from engines.microbatch import MicroBatchPlanner, PromptGroups
from engines.multi_lora import adapters_off
from engines.packing import pack, response_columns, unpack
from engines.shared_prompt import pack_shared, prompt_groups
from schema.engine import EngineConfig

REQUIRED_KEYS = ("input_ids", "attention_mask", "response_mask")


class FSDPEngine(CheckpointMixin, OptimizerMixin, TrainEngine):
    """A policy (causal LM) or value model sharded with FSDP2 over all ranks of the process group."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.compute_dtype = self._compute_dtype()
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
            self.optimizer = self._build_optimizer()
            self.scheduler = self._build_scheduler(self.optimizer)
        self._offload_as_configured()

    def _compute_dtype(self) -> torch.dtype:
        if self.config.dtype == "auto":
            return torch.bfloat16 if self.device.type == "cuda" else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.config.dtype]

    def _attn_implementation(self) -> str:
        """flash-attention's varlen kernel on CUDA when installed; else per-sequence SDPA on the packed row."""
        choice = self.config.attn_implementation
        if choice == "auto" and self.device.type == "cuda":
            try:
                import flash_attn  # noqa: F401

                return "flash_attention_2"
            except ImportError:
                pass
        if choice in ("auto", "sdpa"):
            return segment_attention_name()
        return choice

    def _build_model(self) -> torch.nn.Module:
        self.attn_implementation = self._attn_implementation()
        is_value = self.config.role == "value"
        hf_model = load_hf_model(self.config.model_path, self.attn_implementation, value_head=is_value)
        # One autograd Function each on a CPU (engines/rotary.py, engines/rms_norm.py, engines/swiglu.py).
        rotary.install(sys.modules[type(hf_model).__module__])
        rms_norm.install(hf_model)
        swiglu.install(hf_model)
        self.adapted_modules: list[str] = []
        if self.config.lora is not None:
            self._attach_adapters(hf_model)
        if self.config.gradient_checkpointing:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        keep = self.config.logprob_keep_mib << 20
        model = (
            ValueModel(hf_model)
            if is_value
            else PolicyModel(hf_model, self.config.logprob_chunk_tokens, keep)
        )
        if not self.config.trainable:
            model.requires_grad_(False)
        self.hf_config = hf_model.config
        return model

    def _attach_adapters(self, hf_model: torch.nn.Module) -> None:
        """LoRA (engines/fsdp/lora.py, the layer of engines/multi_lora.py): adapters fp32, the frozen base in the compute dtype (bf16 on
        GPU: it has no gradient or optimizer state, so fp32 master copies would buy nothing)."""
        cfg = self.config.lora
        self.adapted_modules = lora.attach(hf_model, cfg)
        if cfg.init_from is not None:
            lora.load_adapter_weights(hf_model, cfg.init_from)
        if self.compute_dtype != torch.float32:
            for param in hf_model.parameters():
                if not param.requires_grad:
                    param.data = param.data.to(self.compute_dtype)

    def _shard(self, model: torch.nn.Module) -> None:
        one_rank = self.dp_size == 1 and (self.compute_dtype == torch.float32 or self.device.type == "cpu")
        self.sharded = not one_rank
        self.reshard_after_forward = True
        # bf16 on one CPU rank: fp32 weights, products in bf16 under autocast (see the module docstring).
        self.autocast_dtype = self.compute_dtype if one_rank and self.compute_dtype != torch.float32 else None
        if not self.sharded:  # see the module docstring
            model.to(self.device)  # fully_shard would have moved it; unwrapped, it is loaded on the CPU
            sparse_tied_embedding(model, self.device)
            return
        mp_policy = None
        if self.compute_dtype != torch.float32:
            # bf16 compute, fp32 gradient reduction: summing many ranks' bf16 gradients loses bits.
            mp_policy = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        reshard = self.config.fsdp.reshard_after_forward
        self.reshard_after_forward = self.dp_size > 1 if reshard is None else reshard
        kwargs = {"mesh": self.mesh, "reshard_after_forward": self.reshard_after_forward}
        if mp_policy is not None:
            kwargs["mp_policy"] = mp_policy
        inner = model.lm if isinstance(model, PolicyModel) else model
        for layer in decoder_layers(inner):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        # Losses are normalised by global counts, so rank gradients must be summed, not averaged.
        # Plain SUM collectives: gloo has no PREMUL_SUM, and a divide factor of 1 needs none.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    # ---- modes and placement -----------------------------------------------------------------

    @contextmanager
    def train_mode(self) -> Iterator[None]:
        self._onload(optimizer=self.optimizer is not None)
        self.model.train()
        try:
            yield
        finally:
            self._offload_as_configured()

    @contextmanager
    def eval_mode(self) -> Iterator[None]:
        self._onload(optimizer=False)
        self.model.eval()
        try:
            yield
        finally:
            self._offload_as_configured()

    def _onload(self, optimizer: bool) -> None:
        onload_optimizer = optimizer and self._offloaded["optimizer"]
        if self._offloaded["model"] or onload_optimizer:
            self.to(str(self.device), model=self._offloaded["model"], optimizer=onload_optimizer)

    def _offload_as_configured(self) -> None:
        f = self.config.fsdp
        optimizer = f.optimizer_offload and self.optimizer is not None
        if f.param_offload or optimizer:
            self.to("cpu", model=f.param_offload, optimizer=optimizer)
            # On a CPU engine the move is a no-op, but the state is tracked the same way.
            self._offloaded["model"] |= f.param_offload
            self._offloaded["optimizer"] |= optimizer

    def to(self, device: str, model: bool = True, optimizer: bool = True) -> None:
        target = torch.device(device)
        offloading = target.type == "cpu" and self.device.type != "cpu"
        if model:
            self.model.to(target)
            self._offloaded["model"] = offloading
        if optimizer and self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = value.to(target, non_blocking=True)
            self._offloaded["optimizer"] = offloading
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if offloading:
                torch.cuda.empty_cache()

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
            raise KeyError(f"forward_backward_batch needs batch keys {missing} (see engines/base.py)")
        if not forward_only and (loss_fn is None or self.optimizer is None):
            raise ValueError("a backward pass needs a loss_fn and a trainable engine; use forward_only=True")
        batch = batch.to(self.device)
        width = batch["response_mask"].shape[1]
        if counts is None:  # one call = one optimizer batch; else the caller's (engines/base.py)
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
        tokens, sequences = all_reduce_sum(
            [float(batch["response_mask"].sum()), float(batch.batch_size[0])], self.device
        )
        return GlobalCounts(int(tokens), int(sequences), all_reduce_max(width, self.device))

    def _agree(self, count: int) -> int:
        return all_reduce_max(count, self.device)

    def _forward_micro(
        self, micro: TensorDict, width: int, compute_entropy: bool, temperature: float
    ) -> dict[str, torch.Tensor]:
        groups = self._prompt_groups(micro, width)
        if groups is not None:
            return self._forward_shared(micro, width, groups, compute_entropy, temperature)
        packed = pack(micro["input_ids"], micro["attention_mask"])
        # Sequence boundaries: flash-attention reads them from the restarting positions, the
        # segment attention from cu_seq_lens_q; plain SDPA or eager need the block-diagonal mask.
        varlen = self.attn_implementation in ("flash_attention_2", segment_attention_name())
        mask = None if varlen else packed.block_causal_mask()
        with self._autocast():
            flat = self.model(
                packed.input_ids,
                packed.position_ids,
                mask,
                packed.targets,
                temperature,
                compute_entropy,
                cu_seq_lens_q=packed.cu_seq_lens(),
            )
        mask_r = micro["response_mask"].to(torch.float32)
        return {k: response_columns(unpack(v, packed), width) * mask_r for k, v in flat.items()}

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

    def _forward_shared(
        self,
        micro: TensorDict,
        width: int,
        groups: list[list[int]],
        compute_entropy: bool,
        temperature: float,
    ) -> dict[str, torch.Tensor]:
        """One copy of each prompt (engines/shared_prompt.py); outputs land on the [mb, R] grid."""
        packed = pack_shared(micro["input_ids"], micro["attention_mask"], width, groups)
        with self._autocast():
            flat = self.model(
                packed.input_ids,
                packed.position_ids,
                None,
                packed.targets,
                temperature,
                compute_entropy,
                shared_prompt=packed,
            )
        mask_r = micro["response_mask"].to(torch.float32)
        rows = len(micro)
        return {
            k: v.new_zeros(rows * width).index_put((packed.grid_index,), v).view(rows, width) * mask_r
            for k, v in flat.items()
        }

    @staticmethod
    def _in_original_order(pieces: list[dict[str, torch.Tensor]], plan: list[list[int]]) -> dict:
        order = torch.tensor([i for index in plan for i in index])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return {
            k: torch.cat([p[k] for p in pieces])[inverse.to(pieces[0][k].device)].cpu() for k in pieces[0]
        }

    def _reduce_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        """Sum the metrics over ranks; those named *_max by max (engines/base.py)."""
        sums = sorted(k for k in metrics if not k.endswith(MAX_SUFFIX))
        maxima = sorted(k for k in metrics if k.endswith(MAX_SUFFIX))
        out: dict[str, float] = {}
        if sums:
            out.update(zip(sums, all_reduce_sum([metrics[k] for k in sums], self.device), strict=True))
        if maxima:
            out.update(
                zip(maxima, all_reduce_max_floats([metrics[k] for k in maxima], self.device), strict=True)
            )
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

    @contextmanager
    def adapters_off(self) -> Iterator[None]:
        """Compute as the base model (the reference policy of a LoRA engine)."""
        if not self.adapted_modules:
            raise RuntimeError("adapters_off: this engine has no LoRA adapters")
        with adapters_off(self.model):
            yield
