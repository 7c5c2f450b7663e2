"""How an FSDPEngine (engines/training/fsdp/engine.py) builds its model and shards it, and where its
parameters and optimizer state live (offloaded to the CPU between uses when configured), as mixins.

Master weights stay fp32; on CUDA compute runs in bf16 with fp32 gradient reduction. One rank with
nothing to shard is not wrapped (FSDP2 would make every parameter a DTensor, slow in each optimizer
step); bf16 there runs the linear layers under `torch.autocast` over fp32 weights.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from engines.distributed import resolve_dtype
from engines.kernels import fused_layers
from engines.kernels.attention import register as segment_attention_name
from engines.training.fsdp import lora
from engines.training.fsdp.modules import (
    PolicyModel,
    ValueModel,
    decoder_layers,
    load_hf_model,
    sparse_tied_embedding,
)


class ModelBuildMixin:
    """The model half of `FSDPEngine.initialize`, over the engine's `config`, `device`, `dp_size` and
    `mesh`; it sets `hf_config`, `adapted_modules`, `attn_implementation` and `compute_dtype`."""

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
        self.compute_dtype = resolve_dtype(self.config.dtype, self.device.type)
        is_value = self.config.role == "value"
        hf_model = load_hf_model(self.config.model_path, self.attn_implementation, value_head=is_value)
        # One autograd Function each on a CPU (engines/kernels/fused_layers.py).
        fused_layers.install_rotary(sys.modules[type(hf_model).__module__])
        fused_layers.install_rms_norm(hf_model)
        fused_layers.install_swiglu(hf_model)
        self.adapted_modules: list[str] = []
        if self.config.lora is not None:
            self._attach_adapters(hf_model)
        if self.config.gradient_checkpointing:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if is_value:
            model = ValueModel(hf_model)
        else:
            model = PolicyModel(
                hf_model, self.config.logprob_chunk_tokens, self.config.logprob_keep_mib << 20
            )
        if not self.config.trainable:
            model.requires_grad_(False)
        self.hf_config = hf_model.config
        return model

    def _attach_adapters(self, hf_model: torch.nn.Module) -> None:
        """LoRA (engines/training/fsdp/lora.py): adapters in fp32, the frozen base in the compute dtype (it has no
        gradient or optimizer state, so fp32 master copies would buy nothing)."""
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
        if not self.sharded:
            model.to(self.device)  # fully_shard would have moved it; unwrapped, it is loaded on the CPU
            sparse_tied_embedding(model, self.device)
            return
        reshard = self.config.fsdp.reshard_after_forward
        self.reshard_after_forward = self.dp_size > 1 if reshard is None else reshard
        kwargs = {"mesh": self.mesh, "reshard_after_forward": self.reshard_after_forward}
        if self.compute_dtype != torch.float32:
            # bf16 compute, fp32 gradient reduction: summing many ranks' bf16 gradients loses bits.
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=self.compute_dtype, reduce_dtype=torch.float32
            )
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


class PlacementMixin:
    """The modes and `to` of the TrainEngine contract (engines/training/base.py), over the engine's `model`,
    `optimizer`, `config`, `device` and `_offloaded`."""

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
