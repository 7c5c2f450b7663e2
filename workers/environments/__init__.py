"""Environments for multi-turn rollouts: the interface (base.py), references (loader.py), built-ins."""

from workers.environments.base import Environment, EnvironmentContractError, StepResult, as_messages
from workers.environments.calculator import CalculatorEnv
from workers.environments.guess_number import GuessNumberEnv

BUILTIN_ENVIRONMENTS: dict[str, type] = {"calculator": CalculatorEnv, "guess_number": GuessNumberEnv}

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "CalculatorEnv",
    "Environment",
    "EnvironmentContractError",
    "GuessNumberEnv",
    "StepResult",
    "as_messages",
]
