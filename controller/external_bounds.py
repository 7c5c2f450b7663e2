"""How much work one call of a job's OpenAI endpoint may ask for: checked after templating, before
anything is generated (controller/external.py).

A call's prompt and the tokens it asks for must fit the model's context (its
`max_position_embeddings`: the rollout engines serve no longer sequences), and its `n` choices
together stay within `CALL_TOKEN_BUDGET`, so that no one call holds a replica for long while the
job's other calls wait for it. A call that does not fit is a 400 naming the field to change, as
OpenAI's API answers: `messages` (or `prompt`) when the prompt alone leaves no room, else
`max_tokens` / `max_completion_tokens`; without either, a call asks for `DEFAULT_MAX_TOKENS` or
what room is left, whichever is less.
"""

from __future__ import annotations

from typing import Any

from controller.external_store import TrajectoryError

DEFAULT_MAX_TOKENS = 256
CALL_TOKEN_BUDGET = 1 << 19  # n x (prompt + new tokens): what one call may put on a replica
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(model_path: str) -> int | None:
    """The longest sequence the model takes, from its config (None: the config does not say)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", None) or config
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def new_tokens(prompt_len: int, body: dict[str, Any], context: int | None, prompt_field: str) -> int:
    """The number of tokens the call may generate, or a TrajectoryError (400) naming the field."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    asked = body.get(name)
    room = None if context is None else context - prompt_len
    if room is not None and room < 1:
        raise _refused(prompt_field, f"the prompt is {prompt_len} tokens; the model's context is {context} "
                       "tokens, which leaves no room for a reply: shorten it")  # fmt: skip
    if asked is None:
        asked = DEFAULT_MAX_TOKENS if room is None else min(DEFAULT_MAX_TOKENS, room)
    elif room is not None and asked > room:
        raise _refused(name, f"{asked} new tokens after a prompt of {prompt_len} exceed the model's context "
                       f"of {context} tokens: at most {room} fit")  # fmt: skip
    n = body.get("n") or 1
    if n * (prompt_len + asked) > CALL_TOKEN_BUDGET:
        raise _refused("n", f"{n} choices of {prompt_len} + {asked} tokens exceed the {CALL_TOKEN_BUDGET} "
                       "tokens one call may ask for: ask for fewer choices or tokens", "invalid_value")  # fmt: skip
    return asked


def _refused(field: str, message: str, code: str = "context_length_exceeded") -> TrajectoryError:
    return TrajectoryError(400, f"{field}: {message}", field, code)
