"""The built-in calculator tool environment ("builtin:calculator").

The model may write `<calc>EXPRESSION</calc>` and gets a "tool" turn with its value; a turn without a
call is the final answer (reward 1 when its leading integer is the ground truth). Expressions are
evaluated by walking their `ast`: numbers, + - * / // % and parentheses only, bounded.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from workers.environments.base import prompt_text

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_ANSWER = re.compile(r"-?\d+")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Div: operator.truediv,
}
_MAX_ABS = 10**12
_MAX_LENGTH = 200


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression, without `eval`; raises CalculatorError otherwise."""
    if len(expression) > _MAX_LENGTH:
        raise CalculatorError(f"expression longer than {_MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        value = -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        try:
            value = _OPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
    else:
        raise CalculatorError(f"unsupported element {type(node).__name__}: only numbers and + - * / // %")
    if abs(value) > _MAX_ABS:
        raise CalculatorError("value out of range")
    return value


def format_value(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


class CalculatorEnv:
    def reset(self, row: dict[str, Any]) -> str:
        self.answer = str(row["ground_truth"]).strip()
        return prompt_text(row["prompt"])

    def step(self, assistant_text: str) -> tuple[dict | None, float, bool, dict[str, Any]]:
        call = _CALL.search(assistant_text)
        if call is not None:
            try:
                result = format_value(evaluate(call.group(1)))
            except CalculatorError as err:
                result = f"error: {err}"
            return {"role": "tool", "content": result}, 0.0, False, {"tool_call": True}
        match = _ANSWER.match(assistant_text.strip())
        correct = match is not None and match.group() == self.answer
        return None, float(correct), True, {}
