"""A reward model: a one-label sequence classifier that scores each sequence at its last real token.

It pools itself: transformers' pooling looks for `pad_token_id` in the ids, which picks the wrong
token when the pad id is also a real token (pad = end-of-text). Positions and the last token come
from the attention mask, so a score does not depend on padding or micro-batching. It must share the
policy's tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification

from engines.distributed import resolve_device
from engines.rollout.hf import resolve_dtype


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


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] column of each row's last real token; a row with no real token raises."""
    mask = attention_mask.bool()
    empty = ~mask.any(dim=-1)
    if empty.any():
        rows = torch.nonzero(empty).flatten().tolist()
        raise ValueError(f"rows {rows} have no real token (attention_mask is all 0): nothing to score")
    columns = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask, columns, -1).amax(dim=-1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] position ids counting real tokens only: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


class RewardModel:
    def __init__(
        self,
        model_path: str | Path,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        micro_batch_size: int = 8,
    ) -> None:
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
        check_reward_model_folder(model_path)
        self.model_path = Path(model_path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device.type)
        self.micro_batch_size = micro_batch_size
        self.model = self._load_model()

    def _load_model(self) -> torch.nn.Module:
        model = AutoModelForSequenceClassification.from_pretrained(
            str(self.model_path), dtype=self.dtype, attn_implementation="sdpa"
        )
        head = getattr(model, "score", None)
        if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
            raise RewardModelError(
                f"reward model folder '{self.model_path}' loads as {type(model).__name__}, which has no "
                "one-output `score` head to read the reward from"
            )
        model.to(self.device)
        model.eval()
        model.requires_grad_(False)
        return model

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B] float32 scores on the CPU: the score head at each row's last real token."""
        if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                "must be the same [B, T] shape"
            )
        scores = [
            self._score_micro_batch(
                input_ids[start : start + self.micro_batch_size],
                attention_mask[start : start + self.micro_batch_size],
            )
            for start in range(0, input_ids.shape[0], self.micro_batch_size)
        ]
        return torch.cat(scores) if scores else torch.zeros(0)

    def _score_micro_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        last = last_token_index(attention_mask)
        # Only the columns between the first real token and the last one of this micro-batch matter.
        first = int(torch.nonzero(attention_mask.bool().any(dim=0))[0])
        end = int(last.max()) + 1
        ids = input_ids[:, first:end].to(self.device)
        mask = attention_mask[:, first:end].to(self.device)
        hidden = self.model.base_model(
            input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False
        ).last_hidden_state
        rows = torch.arange(ids.shape[0], device=self.device)
        pooled = hidden[rows, (last - first).to(self.device)]
        return self.model.score(pooled).squeeze(-1).float().cpu()
