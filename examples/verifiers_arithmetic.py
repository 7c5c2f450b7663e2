"""A verifiers environment (verifiers 0.4.0, `import verifiers.v1 as vf`) that a Tandem job trains on.

Written in verifiers' own format, with nothing of Tandem in it: a `Taskset` that yields one `Task` per
addition problem, its arguments a `TasksetConfig` (what `load_environment` is given), and the task's
rubric as `@vf.reward` methods over the finished trace. Tandem runs each task against the job's own
OpenAI-compatible endpoint, scores it with these rewards and trains on the recorded tokens:

    tandem submit examples/verifiers_arithmetic.yaml

The rubric has two parts: `correct` (the answer's leading integer is the sum) and `digits` (the share of
digits in the answer, a shaped reward a tiny model learns from random weights in a few steps).
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf


class ArithmeticData(vf.TaskData):
    answer: str
    """The sum, as text."""


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        found = re.search(r"-?\d+", trace.last_reply)
        return float(found is not None and found.group(0) == self.data.answer)

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        reply = trace.last_reply
        return sum(ch.isdigit() for ch in reply) / max(len(reply), 1)


class ArithmeticConfig(vf.TasksetConfig):
    num_tasks: int = 64
    """Problems in the taskset."""
    max_operand: int = 99
    """Operands are drawn from 0..max_operand."""
    seed: int = 0


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for _ in range(self.config.num_tasks):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            yield ArithmeticTask(ArithmeticData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["ArithmeticTaskset"]
