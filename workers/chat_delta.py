"""Token-exact conversations: render a new turn through the chat template as a token delta.

Sampled tokens are never decoded and re-encoded: a trajectory is the first prompt, each turn's sampled
tokens, and each observation's delta. A probe [user, assistant MARKER] rendered once gives the
template's assistant suffix (its first special token is the turn-end token); an observation's delta
is the part of that suffix the sampled tokens did not produce, then the rendering after the probe.
"""

from __future__ import annotations

from typing import Any

_MARKER = "\u2063TANDEM\u2063"  # invisible separators: cannot occur in a real message
_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARKER}]


class ChatDelta:
    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "multi-turn rollouts render turns through the chat template, and this model's tokenizer "
                "has none: use a chat model (e.g. model.builtin 'tiny-qwen2-chat') or add a chat_template"
            )
        self.tokenizer = tokenizer
        self._probe = self._render(_PROBE, generation_prompt=False)
        self.assistant_suffix = self._probe[self._probe.index(_MARKER) + len(_MARKER) :]
        suffix_ids = self.encode(self.assistant_suffix)
        special = set(tokenizer.all_special_ids)
        self.turn_end_id: int | None = suffix_ids[0] if suffix_ids and suffix_ids[0] in special else None
        end_text = tokenizer.decode([self.turn_end_id]) if self.turn_end_id is not None else ""
        self._suffix_after_end = self.assistant_suffix[len(end_text) :]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self._render(messages, generation_prompt=True))

    def observation_ids(self, messages: list[dict[str, str]], last_sampled: int | None) -> list[int]:
        """The delta that closes the assistant turn (ended by `last_sampled`) and adds `messages`."""
        full = self._render(_PROBE + messages, generation_prompt=True)
        if not full.startswith(self._probe):
            raise ValueError("the chat template renders a conversation's prefix differently once it grows")
        ended = self.turn_end_id is not None and last_sampled == self.turn_end_id
        suffix = self._suffix_after_end if ended else self.assistant_suffix
        return self.encode(suffix + full[len(self._probe) :])

    def assistant_text(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of a sampled turn, without the turn-end token that closed it."""
        if token_ids and token_ids[-1] == self.turn_end_id:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
