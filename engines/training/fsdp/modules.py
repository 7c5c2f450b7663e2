"""The modules an FSDP engine shards: a causal LM that returns response log-probs, and a value model.
Each is the root FSDP unit, so one root forward gathers the embeddings, final norm and output
projection before the chunked log-probs read its weight; `hf_name` gives back Hugging Face names.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engines.kernels.logprobs import token_log_probs
from engines.kernels.shared_prompt import SharedPromptPack


class ModelLoadError(ValueError):
    """The model folder is missing, unreadable, or holds the wrong kind of model."""


def load_hf_model(path: str, attn_implementation: str, value_head: bool) -> nn.Module:
    """A causal LM (or, for a value model, its decoder body) in fp32 from a local HF folder."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder '{path}' does not exist")
    if not (folder / "config.json").exists():
        raise ModelLoadError(
            f"model folder '{path}' has no config.json: it is not a Hugging Face model folder"
        )
    config = AutoConfig.from_pretrained(folder)
    loader = AutoModel if value_head else AutoModelForCausalLM
    try:
        return loader.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn_implementation)
    except ValueError as err:
        raise ModelLoadError(
            f"model folder '{path}' ({config.model_type}) cannot be loaded as a causal LM: {err}"
        ) from err


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks, each of which becomes its own FSDP unit."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ModelLoadError(f"{type(model).__name__} has no decoder layer list (expected .model.layers)")
    return layers


class PackedModel(nn.Module):
    """A decoder (`body`) over one packed row, its last hidden states read by the `head`."""

    hf_prefix = ""  # what the state dict's names carry before the Hugging Face names

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = False,
        cu_seq_lens_q: torch.Tensor | None = None,
        shared_prompt: SharedPromptPack | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per packed token; with `shared_prompt`, per response token (its `select`, `targets`). The
        row's layout goes down to the attention function through transformers' kwargs."""
        layout = (
            {"shared_prompt": shared_prompt}
            if shared_prompt is not None
            else {"cu_seq_lens_q": cu_seq_lens_q}
        )
        hidden = self.body(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            **layout,
        ).last_hidden_state[0]
        if shared_prompt is not None:
            hidden, targets = hidden.index_select(0, shared_prompt.select), shared_prompt.targets
        return self.head(hidden, targets, temperature, with_entropy)

    @classmethod
    def hf_name(cls, name: str) -> str:
        return name.removeprefix(cls.hf_prefix)


class PolicyModel(PackedModel):
    """Causal LM whose forward returns per-token next-token log-probs (and entropy) of a packed row."""

    hf_prefix = "lm."

    def __init__(self, lm: nn.Module, chunk_tokens: int, keep_bytes: int = 0) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens, self.keep_bytes = chunk_tokens, keep_bytes

    @property
    def body(self) -> nn.Module:
        return self.lm.model

    def head(
        self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
    ) -> dict[str, torch.Tensor]:
        out_proj = self.lm.get_output_embeddings()
        if getattr(out_proj, "bias", None) is not None:
            raise ModelLoadError("output projections with a bias are not supported")
        log_probs, entropy = token_log_probs(
            hidden, out_proj.weight, targets, temperature, with_entropy, self.chunk_tokens, self.keep_bytes
        )
        return {"log_probs": log_probs} if entropy is None else {"log_probs": log_probs, "entropy": entropy}


class ValueModel(PackedModel):
    """A decoder body with a scalar head on the last hidden state: one value per token."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.model = body  # named `model` so decoder_layers() and HF-style names work unchanged
        self.value_head = nn.Linear(body.config.hidden_size, 1)
        nn.init.normal_(self.value_head.weight, std=0.02)
        nn.init.zeros_(self.value_head.bias)

    @property
    def body(self) -> nn.Module:
        return self.model

    def head(self, hidden: torch.Tensor, *_: object) -> dict[str, torch.Tensor]:
        if hidden.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # bf16 on a CPU (engines/training/fsdp/engine.py): the head in fp32; bf16 would keep 3 digits a value.
            with torch.autocast("cpu", enabled=False):
                values = self.value_head(hidden.float())
        else:
            values = self.value_head(hidden)
        # clone: FSDP hooks its output, and a view of it would lose the pre-backward hook.
        return {"values": values.squeeze(-1).float().clone()}


def sparse_tied_embedding(model: torch.nn.Module, device: torch.device) -> bool:
    """A tied input embedding on one CPU rank returns its few rows as a sparse gradient, which autograd
    adds into the head's dense one (no zero-filled [vocabulary, hidden] tensor per micro-batch). A
    loss that reads no head leaves it sparse: the optimizer step (engines/training/adamw.py) makes it dense."""
    inner = model.lm if isinstance(model, PolicyModel) else None
    if inner is None or device.type != "cpu":
        return False
    embedding, head = inner.get_input_embeddings(), inner.get_output_embeddings()
    tied = head is not None and embedding.weight is head.weight
    if not (tied and embedding.weight.requires_grad and isinstance(embedding, torch.nn.Embedding)):
        return False
    embedding.sparse = True
    return True
