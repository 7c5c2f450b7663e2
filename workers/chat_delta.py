"""Token-exact conversations: render a new turn through the chat template as a token delta.

Sampled tokens are never decoded and re-encoded. A trajectory's tokens are the rendered first
prompt, then for every turn the model's sampled tokens as they came, then the observation's
*delta*: only the tokens the chat template adds for the new turn(s). How the delta is computed:

1. Once, render a probe conversation [user "u", assistant MARKER] without a generation prompt.
   The text after MARKER is the template's assistant suffix (Qwen style: "<|im_end|>\\n"); if it
   starts with a special token, that token is the turn-end token, added to the stop tokens.
2. For an observation, render [user "u", assistant MARKER, *observation] with the generation
   prompt; it must start with the probe's text, and the rest is the observation's rendering
   (e.g. "<|im_start|>tool\\n42<|im_end|>\\n<|im_start|>assistant\\n").
3. The delta is the assistant suffix that the sampled tokens did not already produce (without the
   turn-end token when the turn ended on it, the whole suffix when it was cut off), followed by
   that rendering, tokenized as one string without added special tokens.

So the tokens of a trajectory equal the tokenizer's rendering of the whole conversation whenever
the sampled tokens are what the tokenizer would produce for the decoded text (tested for the
built-in chat tokenizer in tests/test_multiturn.py). Template tokens carry loss mask 0.
"""

from __future__ import annotations

from typing import Any

_MARKER = "\u2063TANDEM\u2063"  # invisible separators: cannot occur in a real message
_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARKER}]


class ChatDelta:
    """Renders first prompts and observation deltas for one tokenizer; see the module docstring."""

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
        """The first prompt: the conversation so far with the generation prompt."""
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
