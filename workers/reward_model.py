"""The reward-model worker: scores rollouts with a one-label sequence classifier.

Each rank holds a whole `RewardModel` and scores its chunk (mesh "actor", every rank collected). It
adds "rm_scores" [B] and, with a response_mask, "rm_token_scores" [B, R]: the score on the last
valid response token, the form token-level advantage estimators read.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from engines.training.reward_model import RewardModel
from workers.base import Dispatch, Worker, register
from workers.batch import Batch


class RewardModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(description="local HF folder of a one-label sequence classifier")
    device: str = Field("auto", description="auto: CUDA when visible, else CPU")
    dtype: str = Field("auto", description="auto: bf16 on CUDA, fp32 on CPU")
    micro_batch_size: int = Field(8, gt=0, description="sequences per forward pass")


class RewardModelWorker(Worker):
    def __init__(self, config: RewardModelConfig | dict) -> None:
        super().__init__()
        self.config = RewardModelConfig.model_validate(config)
        self.reward_model = RewardModel(
            self.config.model_path,
            device=self.config.device,
            dtype=self.config.dtype,
            micro_batch_size=self.config.micro_batch_size,
        )
        self.register_mesh("actor", dp_rank=self.rank, is_collect=True)

    @register(Dispatch.MESH, mesh="actor")
    def compute_rm_score(self, batch: Batch) -> Batch:
        """rm_scores [B] (and rm_token_scores [B, R] when the batch has a response_mask)."""
        scores = self.reward_model.score(batch.tensors["input_ids"], batch.tensors["attention_mask"])
        tensors = batch.tensors.clone(recurse=False)
        tensors["rm_scores"] = scores
        if "response_mask" in tensors.keys():
            tensors["rm_token_scores"] = scores_on_last_token(scores, tensors["response_mask"])
        return Batch(tensors, batch.non_tensors, batch.meta)


def scores_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R]: each row's score on its last valid response token; a row with no response gets zeros."""
    mask = response_mask.bool()
    columns = torch.arange(mask.shape[-1])
    last = torch.where(mask, columns, -1).amax(dim=-1)
    out = torch.zeros(mask.shape, dtype=scores.dtype)
    has_response = last >= 0
    rows = torch.nonzero(has_response).flatten()
    out[rows, last[has_response]] = scores[has_response]
    return out
