"""Adapter-only transfer: the trainer's LoRA adapter into the rollout engine(s), then a probe.

An adapter that never reaches the rollout engine leaves it sampling the base model while the trainer
learns, silently. So every transfer ends with a probe: each receiving engine generates one short
greedy sequence (`serve_adapter`), the trainer recomputes its log-probs; past `probe_tolerance` the
transfer raises `AdapterSyncError`. The trainer's forward is collective, so every rank runs it.
`AdapterTransfer` serves an engine of this process; workers/transfer_choice.py one elsewhere.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from engines.rollout.base import RolloutEngine, SamplingParams
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


class ProbedAdapterTransfer(WeightTransfer):
    """The adapter gathered whole (fp32, also over a bf16 base), delivered in one piece to receivers
    that each answer `serve_adapter`'s reply; `served` holds their probe sequences."""

    def __init__(self, adapter_config: dict, probe_tolerance: float) -> None:
        super().__init__(dtype=torch.float32)
        self.adapter_config, self.probe_tolerance = adapter_config, probe_tolerance
        self._tensors: list[NamedTensor] = []
        self.served: list[tuple[list[int], list[float]]] = []

    def begin(self) -> None:
        self._tensors, self.served = [], []

    def send(self, bucket: list[NamedTensor]) -> None:
        self._tensors.extend((name, tensor.detach()) for name, tensor in bucket)

    def finish(self) -> int:
        tensors, self._tensors = self._tensors, []
        replies = self.deliver(tensors)
        self.served = [(list(r["tokens"]), list(r["log_probs"])) for r in replies]
        return int(replies[0]["version"])

    @abstractmethod
    def deliver(self, tensors: list[NamedTensor]) -> list[dict]:
        """Load the adapter into every receiver; their `serve_adapter` replies in order."""

    @abstractmethod
    def receiver(self, index: int) -> str:
        """How an error names receiver `index`."""

    def checked(self, moved: TransferStats, differences: list[float]) -> ProbedSyncStats:
        """The stats with the probe's result (one difference per receiver); AdapterSyncError past the
        tolerance names the worst receiver."""
        worst = max(range(len(differences)), key=differences.__getitem__, default=0)
        stats = ProbedSyncStats(
            **vars(moved),
            probe_max_abs_diff=differences[worst] if differences else 0.0,
            parameters=moved.bytes // 4,  # fp32
        )
        self.last = stats
        if stats.probe_max_abs_diff > self.probe_tolerance:
            raise AdapterSyncError(
                f"after adapter sync {stats.weight_version} {self.receiver(worst)} does not serve the "
                f"trainer's adapter: its log-probs of a probe sequence differ from the trainer's by up to "
                f"{stats.probe_max_abs_diff:.3g} (tolerance {self.probe_tolerance:g}); it would sample "
                "another policy than the one being trained"
            )
        return stats


class AdapterTransfer(ProbedAdapterTransfer):
    """Into a rollout engine of this process, probed at the end of every transfer."""

    def __init__(self, train: TrainEngine, rollout: RolloutEngine, probe_tolerance: float) -> None:
        if train.adapter_config() is None:
            raise ValueError(
                "AdapterTransfer needs a training engine with LoRA adapters (adapter_config() is None)"
            )
        super().__init__(train.adapter_config(), probe_tolerance)
        self.train, self.rollout = train, rollout

    def deliver(self, tensors: list[NamedTensor]) -> list[dict]:
        return [serve_adapter(self.rollout, self.adapter_config, tensors)]

    def receiver(self, index: int) -> str:
        return f"the rollout engine ({type(self.rollout).__name__})"

    def transfer(self, named_tensors: Iterable[NamedTensor]) -> ProbedSyncStats:
        moved = super().transfer(named_tensors)
        return self.checked(moved, [probe_difference(self.train, *served) for served in self.served])


def serve_adapter(rollout: RolloutEngine, config: dict, tensors: list[NamedTensor]) -> dict:
    """The receiving side: load the adapter, close the update, generate the probe's greedy sequence;
    {"version", "tokens", "log_probs"}."""
    rollout.load_adapter(config, tensors)
    version = rollout.finish_update()
    tokens, log_probs = probe_sequence(rollout)
    return {"version": version, "tokens": tokens, "log_probs": log_probs}


def probe_sequence(rollout: RolloutEngine) -> tuple[list[int], list[float]]:
    """The rollout engine's half of the probe: one short greedy sequence and its log-probs."""
    params = SamplingParams(max_new_tokens=PROBE_TOKENS, temperature=0, seed=0)
    completion = rollout.generate([PROBE_PROMPT], params)[0]
    return list(completion.token_ids), list(completion.log_probs)


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
