"""The hf engine's constrained decoding: one xgrammar matcher per row, a token mask per step.

Disallowed logits become -inf before sampling, so the recorded log-probability is that of the
masked, renormalised distribution. Special tokens other than the stop tokens are banned too: xgrammar
reads one as its text, which would re-tokenise as the special token.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from engines.rollout.constrained import Constraint


class GrammarCompilers:
    """xgrammar compilers for one model's tokenizer, one per set of stop tokens, built on first use."""

    def __init__(self, model_path: str | Path, vocab_size: int) -> None:
        self.model_path, self.vocab_size = str(model_path), vocab_size
        self._compilers: dict[tuple[int, ...], Any] = {}
        self._tokenizer: Any = None

    def banned_ids(self, stop_ids: list[int]) -> list[int]:
        """The special tokens a constrained completion never holds."""
        return sorted(set(self._load_tokenizer().all_special_ids) - set(stop_ids))

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    def compiled(self, constraint: Constraint, stop_ids: list[int]) -> Any:
        import xgrammar

        stops = tuple(sorted(stop_ids))
        if stops not in self._compilers:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=list(stops)
            )
            self._compilers[stops] = _compile_with(xgrammar.GrammarCompiler(info))
        return self._compilers[stops](constraint.grammar)


def _compile_with(compiler: Any) -> Any:
    @lru_cache(maxsize=64)
    def compile_grammar(grammar: str) -> Any:
        return compiler.compile_grammar(grammar)

    return compile_grammar


class GrammarMask:
    """The matchers of one generate call's rows (indexed by original row)."""

    def __init__(self, compiled: Any, rows: int, vocab_size: int, banned_ids: list[int]) -> None:
        import xgrammar

        self.banned = torch.tensor(banned_ids, dtype=torch.long)
        self._xgr = xgrammar
        self.matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(rows)]
        self.vocab_size = vocab_size
        self.bitmask = xgrammar.allocate_token_bitmask(rows, vocab_size)

    def apply(self, logits: torch.Tensor, live: torch.Tensor, done: torch.Tensor) -> None:
        """Set to -inf, in place, the logits [B, V] of tokens the rows' grammars do not allow next."""
        bitmask = self.bitmask[: len(live)]
        bitmask.fill_(-1)  # all allowed: finished rows are fed pad and their outputs ignored
        for i, (row, finished) in enumerate(zip(live.tolist(), done.tolist(), strict=True)):
            if not finished:
                self.matchers[row].fill_next_token_bitmask(bitmask, i)
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size)
        logits[:, self.banned.to(logits.device)] = float("-inf")

    def accept(self, tokens: torch.Tensor, live: torch.Tensor, done: torch.Tensor) -> None:
        """Advance each decoding row's matcher by its sampled token."""
        for row, token, finished in zip(live.tolist(), tokens.tolist(), done.tolist(), strict=True):
            if not finished and not self.matchers[row].accept_token(token):
                raise RuntimeError(f"row {row}'s grammar refused token {token}, which its mask allowed")
