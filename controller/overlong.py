"""Over-long responses: the soft length penalty and the filter, both from DAPO (Yu et al. 2025).

A response that stopped at its token budget L_max never finished its answer, so its reward says
little about the answer itself. L_max is rollout.max_new_tokens for one response (finish reason
"length"); for a multi-turn trajectory it is rollout.max_response_tokens, the budget of all its
tokens after the first prompt (its turns and the observations between them), and its length |y| is
counted the same way (truncated: finish reason "budget" or "max_turns"). `RolloutSpec.response_budget`
says which.

    soft over-long punishment   with a buffer of L_c tokens, a response of |y| tokens gets
                                R_len(y) = -f * max(0, |y| - (L_max - L_c)) / L_c
                                added to its score: 0 up to L_max - L_c, then falling linearly to
                                -f at the budget (DAPO, "Soft Overlong Punishment"; f = 1 there).
    over-long filtering         the truncated responses are taken out of the loss: their rows of
                                the response mask become 0, so they weigh nothing and are not
                                counted in the loss's normaliser (DAPO, "Overlong Filtering").
                                Their scores still enter their group's baseline.

Scores first, then the filter: the penalty shapes what the advantages see, the filter what the
update trains on.
"""

from __future__ import annotations

import torch

from controller.step_math import response_lengths, with_tensors
from schema.training import OverlongSpec
from workers.batch import Batch


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """R_len of the module doc for each length [B], with L_max = max_new_tokens; zeros when the
    buffer is 0."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    excess = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
    return -factor * excess / buffer


def apply_overlong(
    batch: Batch, scores: torch.Tensor, cfg: OverlongSpec, max_new_tokens: int
) -> tuple[Batch, torch.Tensor, dict[str, float]]:
    """The penalised scores and the filtered batch, with overlong/truncated_frac (share of samples
    that hit the budget, when the rollout flags them), overlong/masked_frac and
    overlong/penalty_mean (when each is on). `max_new_tokens` is the samples' budget L_max:
    `RolloutSpec.response_budget`, a trajectory's max_response_tokens when multi-turn."""
    t = batch.tensors
    metrics: dict[str, float] = {}
    if "truncated" in t.keys():
        metrics["overlong/truncated_frac"] = float(t["truncated"].float().mean())
    if cfg.penalty_buffer:
        penalty = overlong_penalty(
            response_lengths(batch), max_new_tokens, cfg.penalty_buffer, cfg.penalty_factor
        )
        scores = scores + penalty.to(scores.dtype)
        metrics["overlong/penalty_mean"] = float(penalty.mean())
    if cfg.filter:
        if "truncated" not in t.keys():
            raise KeyError("algorithm.overlong.filter needs the rollout's 'truncated' flags in the batch")
        keep = (t["truncated"] == 0).unsqueeze(1).to(t["response_mask"].dtype)
        batch = with_tensors(batch, response_mask=t["response_mask"] * keep)
        metrics["overlong/masked_frac"] = float(t["truncated"].float().mean())
    return batch, scores, metrics
