"""The reward-model worker: scores rollouts with a one-label sequence classifier.

Each rank holds a whole `RewardModel` and scores its chunk (mesh "actor", every rank collected). It
adds "rm_scores" [B] and, with a response_mask, "rm_token_scores" [B, R]: the score on the last
valid response token, the form token-level advantage estimators read. The model pools itself:
transformers' pooling looks for `pad_token_id` in the ids, which picks the wrong token when the pad
id is also a real token (pad = end-of-text); positions and the last token come from the attention
mask, so a score depends on neither padding nor micro-batching. It must share the policy's tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from engines.distributed import resolve_device
from engines.rollout.hf import resolve_dtype
from workers.base import Dispatch, Worker, register
from workers.batch import Batch


class RewardModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(description="local HF folder of a one-label sequence classifier")
    device: str = Field("auto", description="auto: CUDA when visible, else CPU")
    dtype: str = Field("auto", description="auto: bf16 on CUDA, fp32 on CPU")
    micro_batch_size: int = Field(8, gt=0, description="sequences per forward pass")


class RewardModelError(ValueError):
    """The reward-model folder is missing or does not hold a one-label sequence classifier."""


def check_reward_model_folder(model_path: str | Path) -> None:
    """Raise a `RewardModelError` naming the folder unless it holds a one-label sequence classifier."""
    folder = Path(model_path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        what = "does not exist" if not folder.exists() else "has no config.json"
        raise RewardModelError(
            f"reward model folder '{folder}' {what}: give the path of a local Hugging Face folder "
            "holding a sequence-classification model with one label"
        )
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise RewardModelError(
            f"reward model folder '{folder}' holds {architectures or 'an unnamed architecture'}, not a "
            "*ForSequenceClassification model: a reward model needs a scalar (one-label) score head"
        )
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        raise RewardModelError(
            f"reward model folder '{folder}' is a classifier with {labels} labels; a reward model has 1"
        )


def last_index(mask: torch.Tensor) -> torch.Tensor:
    """[B] column of each row's last set entry of `mask`; -1 for a row with none."""
    columns = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask.bool(), columns, -1).amax(dim=-1)


class RewardModel:
    def __init__(
        self,
        model_path: str | Path,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        micro_batch_size: int = 8,
    ) -> None:
        from transformers import AutoModelForSequenceClassification

        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
        check_reward_model_folder(model_path)
        self.model_path, self.micro_batch_size = Path(model_path), micro_batch_size
        self.device = resolve_device(device)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(self.model_path), dtype=resolve_dtype(dtype, self.device.type), attn_implementation="sdpa"
        )
        head = getattr(self.model, "score", None)
        if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
            raise RewardModelError(
                f"reward model folder '{self.model_path}' loads as {type(self.model).__name__}, which has no "
                "one-output `score` head to read the reward from"
            )
        self.model.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B] float32 scores on the CPU: the score head at each row's last real token."""
        if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                "must be the same [B, T] shape"
            )
        empty = ~attention_mask.bool().any(dim=-1)
        if empty.any():
            rows = torch.nonzero(empty).flatten().tolist()
            raise ValueError(f"rows {rows} have no real token (attention_mask is all 0): nothing to score")
        size = self.micro_batch_size
        scores = [
            self._score_micro_batch(input_ids[start : start + size], attention_mask[start : start + size])
            for start in range(0, input_ids.shape[0], size)
        ]
        return torch.cat(scores) if scores else torch.zeros(0)

    def _score_micro_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        last = last_index(attention_mask)
        # Only the columns between the first real token and the last one of this micro-batch matter.
        first = int(torch.nonzero(attention_mask.bool().any(dim=0))[0])
        end = int(last.max()) + 1
        ids = input_ids[:, first:end].to(self.device)
        mask = attention_mask[:, first:end].to(self.device)
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        hidden = self.model.base_model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
        ).last_hidden_state
        rows = torch.arange(ids.shape[0], device=self.device)
        pooled = hidden[rows, (last - first).to(self.device)]
        return self.model.score(pooled).squeeze(-1).float().cpu()


class RewardModelWorker(Worker):
    def __init__(self, config: RewardModelConfig | dict) -> None:
        super().__init__()
        self.config = RewardModelConfig.model_validate(config)
        self.reward_model = RewardModel(**self.config.model_dump())
        self.register_mesh("actor", dp_rank=self.rank, is_collect=True)

    @register(Dispatch.MESH, mesh="actor")
    def compute_rm_score(self, batch: Batch) -> Batch:
        """rm_scores [B] (and rm_token_scores [B, R] when the batch has a response_mask)."""
        scores = self.reward_model.score(batch.tensors["input_ids"], batch.tensors["attention_mask"])
        added = {"rm_scores": scores}
        if "response_mask" in batch.tensors.keys():
            added["rm_token_scores"] = scores_on_last_token(scores, batch.tensors["response_mask"])
        return batch.with_tensors(added)


def scores_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R]: each row's score on its last valid response token; a row with no response gets zeros."""
    last = last_index(response_mask)
    out = torch.zeros(response_mask.shape, dtype=scores.dtype)
    has_response = last >= 0
    out[torch.nonzero(has_response).flatten(), last[has_response]] = scores[has_response]
    return out
