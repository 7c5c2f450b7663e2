"""Environments for multi-turn rollouts: the interface and references (base.py), built-ins, sandboxes."""

from workers.environments.calculator import CalculatorEnv
from workers.environments.guess_number import GuessNumberEnv

BUILTIN_ENVIRONMENTS: dict[str, type] = {"calculator": CalculatorEnv, "guess_number": GuessNumberEnv}
# Built-ins that score against the row's ground truth (the data loader refuses a row without one).
GROUND_TRUTH_ENVIRONMENTS = frozenset({"builtin:calculator", "builtin:guess_number"})
