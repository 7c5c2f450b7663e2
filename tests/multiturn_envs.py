"""Scripted environments for the multi-turn tests (importable by Ray workers as tests.multiturn_envs)."""

from __future__ import annotations

import time
from typing import Any


class ScriptedEnv:
    """Answers every turn with a tool turn, then a user turn, ...; done after `extra["turns"]` steps."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        self.turns = int((row.get("extra") or {}).get("turns", 3))
        self.seen = 0
        return [{"role": "system", "content": "be brief"}, {"role": "user", "content": row["prompt"]}]

    def step(self, assistant_text: str):
        self.seen += 1
        if self.seen >= self.turns:
            return None, 1.0, True, {}
        if self.seen % 2:
            return {"role": "tool", "content": f"t{self.seen}"}, 0.0, False, {"tool_call": True}
        return f"again {self.seen}", 0.0, False, {}


class NeverDoneEnv:
    def reset(self, row: dict[str, Any]) -> str:
        return str(row["prompt"])

    def step(self, assistant_text: str):
        return "more", 0.25, False, {}


class FaultyEnv:
    """Raises on prompts containing 'raise', hangs on 'hang', rewards NaN on 'nan', else ends after one step."""

    def reset(self, row: dict[str, Any]) -> str:
        self.prompt = str(row["prompt"])
        return self.prompt

    def step(self, assistant_text: str):
        if "raise" in self.prompt:
            raise RuntimeError("tool crashed")
        if "hang" in self.prompt:
            time.sleep(3)
        return None, float("nan") if "nan" in self.prompt else 1.0, True, {}


class NeedsArgs:
    def __init__(self, level: int) -> None:
        self.level = level

    def reset(self, row):
        return ""

    def step(self, assistant_text):
        return None, 0.0, True, {}


class BadStep:
    def reset(self, row):
        return ""

    def step(self):
        return None, 0.0, True, {}


class HostileEnv:
    """Answers outside the interface, as its prompt says; 'ok' ends after one step rewarded 1."""

    def reset(self, row: dict[str, Any]) -> Any:
        self.prompt = str(row["prompt"])
        if self.prompt == "reset_raise":
            raise RuntimeError("no such task")
        return {"reset_empty": [], "reset_bad_role": {"role": "narrator", "content": "hi"}}.get(
            self.prompt, self.prompt
        )

    def step(self, assistant_text: str):
        observations = {"bad_role": [{"role": "narrator", "content": "x"}], "huge": "y " * 2_000_000}
        if self.prompt in observations:
            return observations[self.prompt], 0.0, False, {}
        return None, 1e39 if self.prompt == "past_float32" else 1.0, True, {}
