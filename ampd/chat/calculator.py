"""`calculator`: a sidecar tool that evaluates an arithmetic expression (`ampd chat` registers it).

Register it on any deployment with `--tool calculator=ampd.chat.calculator:calculator`. The call's
arguments are `{"expression": "1234 * 5678"}`. The expression is parsed with `ast` and only numbers,
+ - * / // % ** and parentheses are evaluated, never `eval`: the arguments come from a model's output.
Every value, intermediate ones included, is bounded (about MAX_DIGITS digits) before it is computed.
A bad expression is a result the model reads ("error: ..."), not a failed call.
"""

from __future__ import annotations

import ast
import math
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
_MAX_LENGTH = 1000
# Every value, intermediate ones included, stays within about MAX_DIGITS digits: an operation whose
# result would be longer is refused before it runs. Bounding the exponent alone let
# ((9**999)**999)**999 hold a sidecar's CPU for minutes; within this bound an operation takes
# microseconds.
MAX_DIGITS = 1000
_MAX_BITS = math.ceil(MAX_DIGITS / math.log10(2))
_MAX_DEPTH = 100  # nested operations ("-" * 900 + "1" would exhaust _eval's recursion)


def _result_bits(op: ast.operator, left: int | float, right: int | float) -> float:
    """About how many bits an int operation's result has, from its operands alone (0: it cannot
    grow past them; floats are bounded by their type and overflow instead)."""
    if type(left) is not int or type(right) is not int:
        return 0.0
    if isinstance(op, ast.Pow) and right >= 0:
        return right * math.log2(abs(left)) if abs(left) > 1 else 1.0
    if isinstance(op, ast.Mult):
        return left.bit_length() + right.bit_length()
    return 0.0  # + - / // % grow by at most one bit past their operands


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ValueError("the result is not a real number")
    if type(value) is int and value.bit_length() > _MAX_BITS:
        raise ValueError(f"a number of over {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is out of a float's range")
    return value


def _eval(node: ast.AST, depth: int = 0) -> int | float:
    if depth > _MAX_DEPTH:
        raise ValueError(f"more than {_MAX_DEPTH} nested operations")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        bits = _result_bits(node.op, left, right)
        if bits > _MAX_BITS:
            raise ValueError(f"the result would have about {bits * math.log10(2):,.0f} digits, over the limit "
                             f"of {MAX_DIGITS}")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ValueError(f"unsupported element {ast.dump(node)[:40]!r} (numbers and + - * / // % ** only)")


def evaluate(expression: str) -> str:
    """The value of `expression` as text, or "error: ..." naming what is wrong."""
    if not isinstance(expression, str) or not expression.strip():
        return "error: expression must be a non-empty string"
    if len(expression) > _MAX_LENGTH:
        return f"error: expression longer than {_MAX_LENGTH} characters"
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, RecursionError, MemoryError):  # MemoryError: the parser's own nesting limit
        return f"error: {expression!r} is not an arithmetic expression"
    except OverflowError as exc:  # float ** float: (34, 'Numerical result out of range')
        return f"error: {exc.args[-1] if exc.args else 'overflow'}"
    except (ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def calculator(call: ToolInput) -> ToolOutput:
    """The sidecar tool: `{"expression": TEXT}` -> its value as the result's content."""
    return ToolOutput(result_tokens=0, content=evaluate(call.arguments.get("expression", "")))
