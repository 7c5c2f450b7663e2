"""The base of every JobSpec section, and the helpers the spec's cross-section rules use.

Torch-free, like the whole schema package: the API and the CLI read it.
"""

from __future__ import annotations

from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

MAX_SAMPLES = 1 << 20  # prompts, samples or rows per step: far beyond any machine's memory
M = TypeVar("M", bound=BaseModel)


class Section(BaseModel):
    """Unknown keys, NaN/infinity and `true` for a number are refused: a value the job cannot use
    fails here, at submission, naming its field (every number also has bounds)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            kinds = _kinds(cls.model_fields[info.field_name].annotation)
            if bool not in kinds and kinds & {int, float}:
                raise ValueError(f"expected a number, got {str(value).lower()}")
        return value


def _kinds(annotation: Any) -> set[Any]:
    args = get_args(annotation)
    return {annotation} if not args else set().union(*(_kinds(a) for a in args))


# The validation context a stored spec is read with: a setting refused since it was stored (one its job
# would ignore) stays readable, so the job can still be listed, resumed and forked with the field fixed.
STORED = {"stored": True}


def at_submission(info: ValidationInfo) -> bool:
    """Whether this validation checks a new spec (or edit), not one read back from the store."""
    return not (info.context or {}).get("stored")


def field_error(loc: tuple[str, ...], message: str, value: Any, named: bool = True) -> ValidationError:
    """A validation error located at `loc` (a cross-field rule still names its field in the 422).
    `named`: the message starts with the dotted `loc`; a section's own rule, whose `loc` is relative
    to the section, leaves that to whoever shows the error (`error_message`)."""
    text = message.replace("{", "(").replace("}", ")")
    error = PydanticCustomError("value_error", ".".join(loc) + ": " + text if named else text)
    return ValidationError.from_exception_data(
        "JobSpec", [InitErrorDetails(type=error, loc=loc, input=value)]
    )


def error_message(message: str, field: str | None) -> str:
    """A pydantic error's message as a person reads it: without pydantic's "Value error, " prefix,
    after the dotted field at fault (once: a cross-field rule's message may start with it)."""
    message = message.removeprefix("Value error, ")
    if not field or message.startswith((f"{field}:", f"{field} ")):
        return message
    return f"{field}: {message}"


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` applied key by key, recursing into nested dicts."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def fields_of(source: BaseModel, cls: type[M], **values: Any) -> M:
    """A `cls` from the fields `source` shares with it (it inherits them), plus `values`, validated."""
    shared = {n: getattr(source, n) for n in cls.model_fields if n in type(source).model_fields}
    return cls.model_validate({**shared, **values})


def with_values(model: M, changes: dict[str, Any]) -> M:
    """A copy of `model` with the nested `changes` set, not validated again: for values that replace
    checked ones with their resolved form (an upload id by its stored path)."""
    if not changes:
        return model
    update = {}
    for key, value in changes.items():
        current = getattr(model, key)
        nested = isinstance(current, BaseModel) and isinstance(value, dict)
        update[key] = with_values(current, value) if nested else value
    return model.model_copy(update=update)


def changed_values(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The nested values of `after` that differ from `before`'s (what `with_values` takes)."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            if inner := changed_values(old, value):
                out[key] = inner
        elif value != old:
            out[key] = value
    return out
