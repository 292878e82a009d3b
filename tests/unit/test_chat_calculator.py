"""The calculator tool `ampd chat` registers: arithmetic only, errors as results."""
from __future__ import annotations

import asyncio

from ampd.chat.calculator import calculator, evaluate
from ampd.tools import ToolInput, ToolRegistry


def test_evaluates_arithmetic():
    assert evaluate("1234 * 5678") == "7006652"
    assert evaluate(" (2 + 3) * -4 ") == "-20"
    assert evaluate("7 / 2") == "3.5"
    assert evaluate("8 / 2") == "4"
    assert evaluate("2 ** 10 // 3 % 5") == str(2 ** 10 // 3 % 5)


def test_anything_else_is_an_error_result_not_an_exception():
    assert evaluate("__import__('os').system('true')").startswith("error: unsupported element")
    assert evaluate("1 / 0") == "error: division by zero"
    assert evaluate("9 ** 9 ** 9") == "error: exponent 387420489 is too large"
    assert evaluate("2 +") == "error: '2 +' is not an arithmetic expression"
    assert evaluate("") == "error: expression must be a non-empty string"
    assert evaluate(["1"]) == "error: expression must be a non-empty string"
    assert evaluate("1+" * 600 + "1").startswith("error: expression longer than")


def test_runs_as_a_sidecar_tool_by_its_spec():
    reg = ToolRegistry()
    assert reg.load("calculator=ampd.chat.calculator:calculator") == "calculator"
    out = asyncio.run(reg.get("calculator")(ToolInput("s", 0, {"expression": "6 * 7"}, 0.0, 0)))
    assert out.content == "42"
    assert calculator(ToolInput("s", 0, {}, 0.0, 0)).content.startswith("error:")
