"""Tool-using traces for a supervised warm start on the calculator task.

The RL task "calculator" is 3-digit products ("347*218="), a tool call away. Its traces tasks hold
the same problems (and the same train/val split) as SFT rows of the two assistant turns of a perfect
trajectory: first the tool call, then, after the tool's answer, the answer itself. The SFT data set
ends each response with the chat template's turn-end token (controller/data.py).

Two formats, one per way a tool is called:

- "calculator-traces" for the built-in environment (`builtin:calculator`,
  workers/environments/calculator.py): the call is `<calc>347*218</calc>`.
- "calculator-tool-traces" for an agent on a job's OpenAI-compatible endpoint with the `calculator`
  function tool (examples/agent_openai.py): the prompt shows the tool schemas the way the endpoint
  does (workers/chat_serving.py), and the call is the endpoint's
  `<tool_call>{"name": "calculator", "arguments": {"expression": "347*218"}}</tool_call>`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from controller.tasks.arithmetic import ArithmeticTask
from workers.chat_serving import tool_call_text, with_tools_header

# The schema is kept short: the endpoint writes it into every prompt, and the built-in chat models
# read one character per token in a context of 512.
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
    reward_function: str = "builtin:arithmetic"
    call: Callable[[str], str] = calc_call  # the text of the tool call for an expression
    tools: tuple[dict[str, Any], ...] = ()  # shown in a system message, as the endpoint shows them

    def make_split(self, split: str, size: int, seed: int = 0) -> list[dict[str, Any]]:
        """`size` problems of the split, two SFT rows each (the call, then the answer)."""
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
