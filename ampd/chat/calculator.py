"""`calculator`: a sidecar tool that evaluates an arithmetic expression (`ampd chat` registers it).

Register it on any deployment with `--tool calculator=ampd.chat.calculator:calculator`. The call's
arguments are `{"expression": "1234 * 5678"}`. The expression is parsed with `ast` and only numbers,
+ - * / // % ** and parentheses are evaluated, never `eval`: the arguments come from a model's output.
A bad expression is a result the model reads ("error: ..."), not a failed call.
"""

from __future__ import annotations

import ast
import operator

from ampd.tools import ToolInput, ToolOutput

__all__ = ["calculator", "evaluate", "SCHEMA"]

# The tool as a chat request's `tools` entry (OpenAI's function schema).
SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 1000  # 9 ** 9 ** 9 would hold the sidecar's thread for minutes
_MAX_LENGTH = 1000


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported element {ast.dump(node)[:40]!r} (numbers and + - * / // % ** only)")


def evaluate(expression: str) -> str:
    """The value of `expression` as text, or "error: ..." naming what is wrong."""
    if not isinstance(expression, str) or not expression.strip():
        return "error: expression must be a non-empty string"
    if len(expression) > _MAX_LENGTH:
        return f"error: expression longer than {_MAX_LENGTH} characters"
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError:
        return f"error: {expression!r} is not an arithmetic expression"
    except (ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def calculator(call: ToolInput) -> ToolOutput:
    """The sidecar tool: `{"expression": TEXT}` -> its value as the result's content."""
    return ToolOutput(result_tokens=0, content=evaluate(call.arguments.get("expression", "")))
