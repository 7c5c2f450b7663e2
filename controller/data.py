"""Prompt data: files of rows become tokenized datasets, and datasets become resumable batches.

A prompt (a string or chat messages) is rendered through the tokenizer's chat template when it has
one; prompts over `max_prompt_length` tokens are dropped and counted. Epoch e visits the rows in a
permutation drawn from (seed, e) alone, so a resumed loader sees exactly the batches an uninterrupted
one would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from controller.data_files import DataError, read_records
from controller.reasoning_gym_task import write_reasoning_gym_files
from controller.rewards import GROUND_TRUTH_REWARDS
from controller.tasks import write_splits
from schema.job import DataSpec, JobSpec
from workers.batch import Batch
from workers.chat_serving import ChatDelta
from workers.environments import GROUND_TRUTH_ENVIRONMENTS

MAX_CHARS_PER_TOKEN = 64  # no tokenizer's text averages near this many characters a token
TOKENIZE_CHUNK = 4096


@dataclass(frozen=True)
class PromptRow:
    """One kept row, tokenized. `index` is its position among the kept rows (and its uid)."""

    index: int
    text: str  # what the model sees: the rendered chat template, or the raw prompt
    ids: list[int]
    ground_truth: Any
    extra: dict | None
    response_text: str | None = None  # SFT only
    response_ids: list[int] | None = None  # SFT only, ends with the turn's end token (SFTDataset)
    raw_prompt: Any = None  # the row's prompt as given (string or messages): environments reset from it


class PromptDataset:
    """Tokenized prompt rows for RL: left-padded `input_ids`, and the non-tensors "prompt",
    "prompt_ids", "ground_truth", "extra" and "uid" (the row index: GRPO's group id)."""

    def __init__(
        self,
        records: Sequence[tuple[str, dict[str, Any]]],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        ground_truth_key: str = "ground_truth",
        extra_key: str | None = "extra",
        max_prompt_length: int | None = None,
        chat_template: bool | None = None,
        source: str = "<rows>",
        require_ground_truth: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_key, self.ground_truth_key, self.extra_key = prompt_key, ground_truth_key, extra_key
        self.max_prompt_length = max_prompt_length
        self.source = source
        self.use_chat_template = _decide_chat_template(tokenizer, chat_template, source)
        self.pad_id = _pad_id(tokenizer, source)
        self.filtered: dict[str, int] = {}
        if not records:
            raise DataError(f"{source}: the data set has no rows")
        if require_ground_truth:
            self._check_ground_truth(records)
        texts = [self._render(record, where) for where, record in records]
        fits = [_may_fit(text, max_prompt_length) for text in texts]
        ids = self._tokenize([text if fit else "" for text, fit in zip(texts, fits, strict=True)])
        self.rows: list[PromptRow] = []
        for (where, record), text, fit, prompt_ids in zip(records, texts, fits, ids, strict=True):
            if not fit or (max_prompt_length is not None and len(prompt_ids) > max_prompt_length):
                self._count("prompt_too_long")
                continue
            row = self._make_row(len(self.rows), where, record, text, list(prompt_ids))
            if row is not None:
                self.rows.append(row)
        self.num_records = len(records)
        if not self.rows:
            raise DataError(f"{source}: all {len(records)} rows were filtered out ({self.filtered})")

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        """Batched calls (the Rust tokenizer encodes a list far faster), a chunk at a time so that its
        encodings are not all held at once; a chat template renders its own special tokens."""
        special = not self.use_chat_template
        chunks = (texts[i : i + TOKENIZE_CHUNK] for i in range(0, len(texts), TOKENIZE_CHUNK))
        return [
            ids for chunk in chunks for ids in self.tokenizer(chunk, add_special_tokens=special)["input_ids"]
        ]

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: Any, **options: Any) -> PromptDataset:
        return cls(read_records(path), tokenizer, source=str(path), **options)

    @property
    def num_filtered(self) -> int:
        return sum(self.filtered.values())

    @property
    def stats(self) -> dict[str, int]:
        return {
            "rows": self.num_records,
            "kept": len(self.rows),
            **{f"filtered_{k}": v for k, v in self.filtered.items()},
        }

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        return self.rows[index]

    def head(self, n: int) -> Batch:
        """The first `n` rows in file order (validation's, unshuffled)."""
        return self.make_batch(range(min(n, len(self))))

    def make_batch(self, indices: Sequence[int]) -> Batch:
        rows = [self.rows[i] for i in indices]
        input_ids, attention_mask = _pad([r.ids for r in rows], self.pad_id, left=True)
        return Batch.from_dict(
            {"input_ids": input_ids, "attention_mask": attention_mask},
            self._non_tensors(rows),
        )

    def _render(self, record: dict[str, Any], where: str) -> str:
        if self.prompt_key not in record:
            raise DataError(
                f"{self.source} {where}: missing the prompt key '{self.prompt_key}' (keys: {sorted(record)})"
            )
        prompt = record[self.prompt_key]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt and all(map(_is_message, prompt)):
            messages = prompt
        else:
            got = (
                next((repr(m)[:100] for m in prompt if not _is_message(m)), "[]")
                if isinstance(prompt, list)
                else type(prompt).__name__
            )
            raise DataError(
                f"{self.source} {where}: '{self.prompt_key}' must be a string or a list of chat messages "
                f"({{'role': str, 'content': str}}), got {got}"
            )
        if self.use_chat_template:
            try:
                return self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
            except Exception as err:  # the template's own checks (roles that must alternate, ...)
                raise DataError(
                    f"{self.source} {where}: the chat template refused the messages: {err}"
                ) from None
        if not isinstance(prompt, str):
            raise DataError(
                f"{self.source} {where}: the prompt is a list of chat messages but the tokenizer has no "
                "chat template: give plain-string prompts or a tokenizer with a chat template"
            )
        return prompt

    def _check_ground_truth(self, records: Sequence[tuple[str, dict[str, Any]]]) -> None:
        lacking = [where for where, record in records if record.get(self.ground_truth_key) is None]
        if lacking:
            raise DataError(
                f"{self.source} {lacking[0]}: no ground truth '{self.ground_truth_key}' ({len(lacking)} of "
                f"{len(records)} rows lack it); the job's reward compares every response with it: give each "
                "row one, or name the column that holds it in data.ground_truth_key"
            )

    def _make_row(
        self, index: int, where: str, record: dict[str, Any], text: str, ids: list[int]
    ) -> PromptRow | None:
        extra = record.get(self.extra_key) if self.extra_key else None
        if extra is not None and not isinstance(extra, dict):
            raise DataError(
                f"{self.source} {where}: '{self.extra_key}' must be an object, got {type(extra).__name__}"
            )
        return PromptRow(
            index, text, ids, record.get(self.ground_truth_key), extra, raw_prompt=record[self.prompt_key]
        )

    def _count(self, cause: str) -> None:
        self.filtered[cause] = self.filtered.get(cause, 0) + 1

    def _non_tensors(self, rows: list[PromptRow]) -> dict[str, list[Any]]:
        return {
            "prompt": [r.text for r in rows],
            "raw_prompt": [r.raw_prompt for r in rows],
            "prompt_ids": [list(r.ids) for r in rows],  # copies: consumers may not alias the dataset
            "ground_truth": [r.ground_truth for r in rows],
            "extra": [r.extra for r in rows],
            "uid": [str(r.index) for r in rows],
        }


class SFTDataset(PromptDataset):
    """Prompt/response pairs in the training engine's layout. The response ends with the token the
    chat template closes an assistant turn with (else EOS), so the model learns to stop as multi-turn
    rollouts expect; pairs over `max_response_length` are dropped ("response_too_long")."""

    def __init__(
        self,
        records: Sequence[tuple[str, dict[str, Any]]],
        tokenizer: Any,
        *,
        response_key: str = "response",
        max_response_length: int | None = None,
        **options: Any,
    ) -> None:
        self.response_key = response_key
        self.max_response_length = max_response_length
        source = options.get("source", "<rows>")
        chat = _decide_chat_template(tokenizer, options.get("chat_template"), source)
        self.end_id = _turn_end_id(tokenizer) if chat else tokenizer.eos_token_id
        if self.end_id is None:
            raise DataError(f"{source}: SFT needs a tokenizer with an EOS token")
        super().__init__(records, tokenizer, **options)

    def _make_row(
        self, index: int, where: str, record: dict[str, Any], text: str, ids: list[int]
    ) -> PromptRow | None:
        response = record.get(self.response_key)
        if not isinstance(response, str):
            problem = "missing" if response is None else f"a {type(response).__name__}, not a string"
            raise DataError(f"{self.source} {where}: the response key '{self.response_key}' is {problem}")
        if not _may_fit(response, self.max_response_length):
            self._count("response_too_long")
            return None
        response_ids = list(self.tokenizer(response, add_special_tokens=False)["input_ids"])
        if not response_ids or response_ids[-1] != self.end_id:
            response_ids.append(self.end_id)
        if self.max_response_length is not None and len(response_ids) > self.max_response_length:
            self._count("response_too_long")
            return None
        row = super()._make_row(index, where, record, text, ids)
        assert row is not None
        return PromptRow(row.index, text, ids, row.ground_truth, row.extra, response, response_ids)

    def make_batch(self, indices: Sequence[int]) -> Batch:
        rows = [self.rows[i] for i in indices]
        prompt_ids, prompt_mask = _pad([r.ids for r in rows], self.pad_id, left=True)
        responses, response_mask = _pad([r.response_ids or [] for r in rows], self.pad_id, left=False)
        non_tensors = self._non_tensors(rows)
        non_tensors["response"] = [r.response_text for r in rows]
        tensors = {
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "responses": responses,
            "response_mask": response_mask,
        }
        return Batch.from_dict(tensors, non_tensors)


def _may_fit(text: str, max_tokens: int | None) -> bool:
    """False for a text too long to fit `max_tokens` at any tokenizer's rate: it is dropped untokenized,
    since tokenizing a line of hundreds of megabytes takes tens of gigabytes."""
    return max_tokens is None or len(text) <= max_tokens * MAX_CHARS_PER_TOKEN


def _is_message(message: Any) -> bool:
    return isinstance(message, dict) and all(isinstance(message.get(k), str) for k in ("role", "content"))


def _decide_chat_template(tokenizer: Any, requested: bool | None, source: str) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if requested and not has_template:
        raise DataError(f"{source}: chat_template=True but the tokenizer has no chat template")
    return has_template if requested is None else requested


def _turn_end_id(tokenizer: Any) -> int | None:
    end = ChatDelta(tokenizer).turn_end_id
    return end if end is not None else tokenizer.eos_token_id


def _pad_id(tokenizer: Any, source: str) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise DataError(f"{source}: the tokenizer has neither a pad nor an EOS token to pad with")
    return int(pad)


def _pad(sequences: Sequence[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] ids and mask, L = the longest sequence, padded on the left or the right."""
    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if not seq:
            continue
        cols = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[i, cols] = torch.tensor(seq, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


class PromptLoader:
    """Endless, resumable batches of `batch_size` rows. With drop_last (RL steps want full batches)
    an epoch's rows that do not fill a batch are skipped in that epoch."""

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and batch_size > len(dataset):
            raise DataError(
                f"a batch of {batch_size} rows needs a data set at least as large; it has {len(dataset)}"
            )
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def __iter__(self) -> PromptLoader:
        return self

    def __next__(self) -> Batch:
        remaining = len(self.dataset) - self.position
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch, self.position = self.epoch + 1, 0
        if self._order_epoch != self.epoch:
            self._order_epoch, self._order = self.epoch, self.order(self.epoch)
        indices = self._order[self.position : self.position + self.batch_size]
        self.position += len(indices)
        return self.dataset.make_batch(indices.tolist())

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_rows": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != len(self.dataset):
            raise DataError(
                f"cannot resume the data loader: the saved state is for {state['num_rows']} rows, "
                f"the data set now has {len(self.dataset)}; resume with the same data and filters"
            )
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        self._order_epoch = -1


def resolve_data_files(spec: DataSpec, workdir: str | Path, seed: int = 0) -> tuple[Path, Path | None]:
    if spec.reasoning_gym is not None:
        return write_reasoning_gym_files(spec.reasoning_gym, Path(workdir) / "data" / "reasoning_gym")
    if spec.train_path is not None:
        return Path(spec.train_path), Path(spec.val_path) if spec.val_path else None
    assert spec.builtin_task is not None  # DataSpec guarantees one of the two
    return write_splits(spec.builtin_task, Path(workdir) / "data" / spec.builtin_task, seed=seed)


def build_dataset(
    path: str | Path,
    tokenizer: Any,
    spec: DataSpec,
    sft: bool = False,
    max_response_length: int | None = None,
    ground_truth: bool = False,
) -> PromptDataset:
    """`ground_truth`: every row must have one (`needs_ground_truth`)."""
    keys = ("prompt_key", "ground_truth_key", "extra_key", "max_prompt_length")
    options: dict[str, Any] = {key: getattr(spec, key) for key in keys}
    options["require_ground_truth"] = ground_truth
    if sft:
        options.update(response_key=spec.response_key, max_response_length=max_response_length)
    return (SFTDataset if sft else PromptDataset).from_file(path, tokenizer, **options)


def needs_ground_truth(spec: JobSpec) -> bool:
    """Whether the job scores its rows with a built-in that compares responses with their ground truth."""
    if spec.method == "sft" or spec.rollout.source != "prompts":
        return False
    if spec.rollout.environment is not None:
        return spec.rollout.environment in GROUND_TRUTH_ENVIRONMENTS
    return spec.reward.function in GROUND_TRUTH_REWARDS
