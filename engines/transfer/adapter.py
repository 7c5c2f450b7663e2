"""Adapter-only transfer: the trainer's LoRA adapter into the rollout engine, then a probe.

An adapter that never reaches the rollout engine leaves it sampling the base model while the trainer
learns, silently. So every transfer ends with a probe: one short greedy sequence from the rollout
engine, its log-probs recomputed by the trainer; past `probe_tolerance` the transfer raises
`AdapterSyncError`. Every rank runs the probe (the trainer's forward is collective).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from engines.rollout.base import Completion, RolloutEngine, SamplingParams
from engines.training.base import TrainEngine
from engines.transfer.base import NamedTensor, TransferStats, WeightTransfer

PROBE_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # plain ids below any model's vocabulary size
PROBE_TOKENS = 8


class AdapterSyncError(RuntimeError):
    """The rollout engine does not serve the trainer's adapter after a sync."""


@dataclass(frozen=True)
class ProbedSyncStats(TransferStats):
    """TransferStats plus the probe's largest log-prob difference (rollout engine vs trainer)."""

    probe_max_abs_diff: float = 0.0
    parameters: int = 0  # the adapter's: the job's trainable parameters

    def metrics(self) -> dict[str, float]:
        return {
            **super().metrics(),
            "weight_sync/probe_max_abs_diff": self.probe_max_abs_diff,
            "lora/trainable_params": float(self.parameters),
        }


def default_tolerance(dtype: torch.dtype | None) -> float:
    """fp32 engines agree closely, bf16 ones far less; an engine that casts itself (None) counts as bf16."""
    return 1e-3 if dtype == torch.float32 else 0.1


class AdapterTransfer(WeightTransfer):
    """The in-process trainer -> rollout transfer of a LoRA adapter, probed after every transfer."""

    name = "adapter"

    def __init__(self, train: TrainEngine, rollout: RolloutEngine, probe_tolerance: float) -> None:
        super().__init__(dtype=torch.float32)  # adapters travel in fp32 (also over a bf16 base)
        self.train, self.rollout, self.probe_tolerance = train, rollout, probe_tolerance
        self._tensors: list[NamedTensor] = []

    def begin(self) -> None:
        if self.train.adapter_config() is None:
            raise ValueError(
                "AdapterTransfer needs a training engine with LoRA adapters (adapter_config() is None)"
            )
        self._tensors = []

    def send(self, bucket: list[NamedTensor]) -> None:
        self._tensors.extend((name, tensor.detach()) for name, tensor in bucket)

    def finish(self) -> int:
        tensors, self._tensors = self._tensors, []
        self.rollout.load_adapter(self.train.adapter_config(), tensors)
        return self.rollout.finish_update()

    def transfer(self, named_tensors: Iterable[NamedTensor]) -> ProbedSyncStats:
        moved = super().transfer(named_tensors)
        parameters = moved.bytes // 4  # fp32
        self.last = ProbedSyncStats(**vars(moved), probe_max_abs_diff=self.probe(), parameters=parameters)
        check_probe(self.last, self.probe_tolerance, f"the rollout engine ({type(self.rollout).__name__})")
        return self.last

    def sync(self) -> ProbedSyncStats:
        return self.transfer(self.train.get_per_tensor_param())

    def probe(self) -> float:
        return probe(self.train, self.rollout)


def check_probe(stats: ProbedSyncStats, tolerance: float, engine: str) -> None:
    """Raise AdapterSyncError when the probe's difference is past `tolerance`; `engine` names it."""
    if stats.probe_max_abs_diff > tolerance:
        raise AdapterSyncError(
            f"after adapter sync {stats.weight_version} {engine} does not serve the trainer's adapter: "
            f"its log-probs of a probe sequence differ from the trainer's by up to "
            f"{stats.probe_max_abs_diff:.3g} (tolerance {tolerance:g}); it would sample another policy "
            "than the one being trained"
        )


def probe(train: TrainEngine, rollout: RolloutEngine) -> float:
    """max |rollout log-prob - trainer log-prob| over one short greedy sequence of the rollout engine."""
    completion = probe_completion(rollout)
    return probe_difference(train, list(completion.token_ids), list(completion.log_probs))


def probe_completion(rollout: RolloutEngine) -> Completion:
    """The rollout engine's half of the probe: one short greedy sequence and its log-probs."""
    params = SamplingParams(max_new_tokens=PROBE_TOKENS, temperature=0, seed=0)
    return rollout.generate([PROBE_PROMPT], params)[0]


def probe_difference(train: TrainEngine, tokens: list[int], served: list[float]) -> float:
    """The trainer's half: max |served - trainer log-prob| over `tokens` after PROBE_PROMPT (collective:
    every training rank calls it with the same tokens)."""
    if not tokens:
        return 0.0
    ids = torch.tensor([PROBE_PROMPT + tokens])
    batch = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "response_mask": torch.ones(1, len(tokens), dtype=torch.long),
        },
        batch_size=[1],
    )
    with torch.no_grad():
        trainer = train.forward_backward_batch(batch, None, forward_only=True).outputs["log_probs"][0]
    served_t = torch.tensor(served[: len(tokens)], dtype=torch.float32)
    return float((trainer.float().cpu() - served_t).abs().max())
