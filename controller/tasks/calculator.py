"""Tool-using traces for a supervised warm start on the calculator task (3-digit products, a tool call
away): the same problems as SFT rows of a perfect trajectory's two turns, the call then the answer.
"calculator-traces" calls `builtin:calculator` as `<calc>347*218</calc>`; "calculator-tool-traces"
calls the `calculator` function tool of a job's OpenAI endpoint, its schema shown as the endpoint does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from controller.tasks.arithmetic import ArithmeticTask
from workers.chat_serving import tool_call_text, with_tools_header

# Short: the endpoint writes it into every prompt, and the built-in chat models have 512 tokens.
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def calc_call(expression: str) -> str:
    return f"<calc>{expression}</calc>"


def endpoint_call(expression: str) -> str:
    arguments = json.dumps({"expression": expression})
    return tool_call_text({"function": {"name": CALCULATOR_TOOL["function"]["name"], "arguments": arguments}})


@dataclass(frozen=True)
class CalculatorTracesTask:
    problems: ArithmeticTask = field(
        default_factory=lambda: ArithmeticTask(digits=3, operations=("*",), name="calculator")
    )
    default_train_size: int = 2000
    default_val_size: int = 64
    name: str = "calculator-traces"
    call: Callable[[str], str] = calc_call  # the text of the tool call for an expression
    tools: tuple[dict[str, Any], ...] = ()  # shown in a system message, as the endpoint shows them

    def make_split(self, split: str, size: int, seed: int = 0) -> list[dict[str, Any]]:
        rows = []
        for problem in self.problems.make_split(split, size, seed):
            question, answer = problem["prompt"], problem["ground_truth"]
            call = self.call(question.rstrip("="))
            asked = [{"role": "user", "content": question}]
            if self.tools:
                asked = with_tools_header(asked, list(self.tools))
            first = asked if self.tools else question  # a plain question renders as that user turn
            rows.append({"prompt": first, "response": call, "ground_truth": answer})
            conversation = [
                *asked,
                {"role": "assistant", "content": call},
                {"role": "tool", "content": answer},
            ]
            rows.append({"prompt": conversation, "response": answer, "ground_truth": answer})
        return rows
