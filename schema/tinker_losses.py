"""What each Tinker built-in loss accepts: inputs, dtypes, config keys, bounds. Torch-free.

The API process imports this module to reject a bad `forward`/`forward_backward` request with a
field-named 4xx before anything is stored; `workers/losses/tinker.py` computes the losses (torch).
The names are the official SDK's (`tinker/types/loss_fn_type.py`, tinker 0.38.0, less `custom`,
whose client-side path reaches the service as `cross_entropy`). Input names and wire dtypes follow
`tinker/types/datum.py` (`_KEY_TO_TYPE`) and the Tinker docs' loss pages
(https://tinker-docs.thinkingmachines.ai/tinker/losses/...). The wire has two dtypes only,
`int64` and `float32` (`tinker/types/tensor_dtype.py`).

Every input of a datum has shape `(N,)`, N = the datum's number of tokens (the docs: "position i of
model_input predicts token i + 1", so targets are as long as the input). `cross_entropy` also takes
`(N, K)` (the docs' top-K distillation): K candidate targets per position.

Inputs that a loss does not use are rejected (naming the field), with one exception: `weights` on
the RL losses, because the Tinker docs' own RL example sends `weights` with `importance_sampling`;
they are accepted and ignored there (the documented RL formulas do not use them). The cookbook
strips its private `mask` input before sending (`tinker_cookbook/rl/train.py::_remove_mask`), which
shows the service rejects unknown inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LOSS_NAMES: tuple[str, ...] = (
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
)


class LossInputError(ValueError):
    """Bad loss input; `.field` names it as the API reports it (e.g. `data[3].loss_fn_inputs.weights`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ConfigKey:
    """One `loss_fn_config` key: default and inclusive bounds (None = unbounded)."""

    default: float
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # True: the value must be strictly above `low`


@dataclass(frozen=True)
class LossSpec:
    required: dict[str, str]  # input name -> wire dtype
    optional: dict[str, str] = field(default_factory=dict)  # accepted, may be absent
    config: dict[str, ConfigKey] = field(default_factory=dict)
    top_k: bool = False  # inputs may be (N, K)


_RL_INPUTS = {"target_tokens": "int64", "logprobs": "float32", "advantages": "float32"}
# Tinker's clip thresholds are ratio bounds (1 - eps_low, 1 + eps_high), eps = 0.2 by default
# ("currently fixed to 0.2 in Tinker", the PPO page); the SDK also types them as per-token inputs
# (`datum.py` _KEY_TO_TYPE), which override the config position by position.
_CLIP_CONFIG = {
    "clip_low_threshold": ConfigKey(0.8, low=0.0, high=1.0),
    "clip_high_threshold": ConfigKey(1.2, low=1.0, high=None),
}
_CLIP_INPUTS = {"clip_low_threshold": "float32", "clip_high_threshold": "float32"}
_IGNORED_RL = {"weights": "float32"}

SPECS: dict[str, LossSpec] = {
    "cross_entropy": LossSpec({"target_tokens": "int64", "weights": "float32"}, top_k=True),
    "importance_sampling": LossSpec(dict(_RL_INPUTS), dict(_IGNORED_RL)),
    "ppo": LossSpec(dict(_RL_INPUTS), {**_IGNORED_RL, **_CLIP_INPUTS}, dict(_CLIP_CONFIG)),
    "cispo": LossSpec(dict(_RL_INPUTS), {**_IGNORED_RL, **_CLIP_INPUTS}, dict(_CLIP_CONFIG)),
    # beta: the docs show {"beta": 0.05} as a "custom beta" without naming the default; 0.05 is
    # used as the default here (documented choice, see engines/tinker_losses.py).
    "dro": LossSpec(dict(_RL_INPUTS), dict(_IGNORED_RL), {"beta": ConfigKey(0.05, low=0.0)}),
    "gspo": LossSpec({**_RL_INPUTS, "sequence_ratio_mask": "float32"}, dict(_IGNORED_RL), dict(_CLIP_CONFIG)),
    "stable_reinforce": LossSpec(
        dict(_RL_INPUTS),
        dict(_IGNORED_RL),
        {"kl_coeff": ConfigKey(0.0, low=0.0), "clip_high_threshold": ConfigKey(2.0, low=1.0)},
    ),
}

MAX_TOP_K = 1024  # bounds the (N, K) cross-entropy gather; far above any real distillation K


def _spec(loss_fn: str) -> LossSpec:
    if loss_fn not in SPECS:
        raise LossInputError("loss_fn", f"unknown loss {loss_fn!r}; built-in losses: {', '.join(LOSS_NAMES)}")
    return SPECS[loss_fn]


def config_defaults(loss_fn: str) -> dict[str, float]:
    """`loss_fn_config` keys of `loss_fn` with their defaults."""
    return {k: v.default for k, v in _spec(loss_fn).config.items()}


def resolve_config(loss_fn: str, config: dict[str, Any] | None) -> dict[str, float]:
    """Defaults overlaid with `config`, validated (LossInputError names the key)."""
    spec = _spec(loss_fn)
    out = config_defaults(loss_fn)
    for key, value in (config or {}).items():
        name = f"loss_fn_config.{key}"
        if key not in spec.config:
            known = ", ".join(sorted(spec.config)) or "none"
            raise LossInputError(name, f"unknown key for loss {loss_fn!r} (accepted: {known})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LossInputError(name, f"must be a number, got {type(value).__name__}")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise LossInputError(name, "must be finite")
        bound = spec.config[key]
        too_low = bound.low is not None and (value <= bound.low if bound.low_open else value < bound.low)
        if too_low or (bound.high is not None and value > bound.high):
            lo = "-inf" if bound.low is None else bound.low
            hi = "inf" if bound.high is None else bound.high
            raise LossInputError(name, f"{value} is outside [{lo}, {hi}]")
        out[key] = value
    if "clip_low_threshold" in out and "clip_high_threshold" in out:
        if out["clip_low_threshold"] > out["clip_high_threshold"]:
            raise LossInputError("loss_fn_config.clip_low_threshold", "must not exceed clip_high_threshold")
    return out


def check_request(
    loss_fn: str,
    data: list[tuple[int, dict[str, tuple[str, list[int]]]]],
    config: dict[str, Any] | None,
) -> None:
    """Raise LossInputError on the first bad part of a request.

    `data[i] = (number_of_tokens, {input_name: (dtype, shape)})`.
    """
    spec = _spec(loss_fn)
    if not data:
        raise LossInputError("data", "must hold at least one datum")
    for i, (num_tokens, inputs) in enumerate(data):
        prefix = f"data[{i}].loss_fn_inputs"
        for name in spec.required:
            if name not in inputs:
                raise LossInputError(f"{prefix}.{name}", f"required by loss {loss_fn!r}")
        width: int | None = None
        for name, (dtype, shape) in inputs.items():
            where = f"{prefix}.{name}"
            expected = spec.required.get(name) or spec.optional.get(name)
            if expected is None:
                accepted = ", ".join(sorted({**spec.required, **spec.optional}))
                raise LossInputError(where, f"not an input of loss {loss_fn!r} (accepted: {accepted})")
            if dtype != expected:
                raise LossInputError(where, f"dtype must be {expected}, got {dtype}")
            shape = list(shape)
            if not shape or shape[0] != num_tokens:
                raise LossInputError(
                    where, f"length {shape[0] if shape else 'scalar'} != {num_tokens} tokens"
                )
            if len(shape) == 2 and spec.top_k:
                if not 1 <= shape[1] <= MAX_TOP_K:
                    raise LossInputError(where, f"K = {shape[1]} is outside [1, {MAX_TOP_K}]")
                if width is not None and shape[1] != width:
                    raise LossInputError(where, f"K = {shape[1]} differs from the other inputs' {width}")
                width = shape[1]
            elif len(shape) != 1:
                allowed = "(N,) or (N, K)" if spec.top_k else "(N,)"
                raise LossInputError(where, f"shape {shape} must be {allowed}")
        if width is not None and any(len(s) == 1 for _, s in inputs.values()):
            raise LossInputError(prefix, "all inputs must be (N,) or all (N, K)")
    resolve_config(loss_fn, config)
