"""ampd.tools: the registry and the limits of a tool call (pure: the budget, the CPU limit of a
tool process that serves many calls, why a stopped call failed)."""
from __future__ import annotations

import asyncio
import signal

import pytest

from ampd.tools import (
    MARGIN_S, ToolInput, ToolLimits, ToolOutput, ToolRegistry, call_budget, cpu_limit, isolated, stopped_reason,
)

LIMITS = ToolLimits(cpu_s=5, wall_s=10.0, memory_mb=512)
CALL = ToolInput("s", 0, {"expression": "6 * 7"}, 0.0, 0)


def test_a_call_answers_within_the_wall_limit_and_before_its_callers_deadline():
    assert call_budget(10.0, None) == 10.0
    assert call_budget(10.0, 30.0) == 10.0
    assert call_budget(10.0, 2.0) == pytest.approx(2.0 - MARGIN_S)
    assert call_budget(10.0, 0.1) == 0.0


def test_each_call_gets_its_cpu_seconds_on_top_of_what_the_process_used():
    assert cpu_limit(0.0, 5, -1) == 5
    assert cpu_limit(12.3, 5, -1) == 18
    assert cpu_limit(12.3, 5, 15) == 15  # never above the hard limit


def test_a_stopped_call_says_why():
    assert stopped_reason(-signal.SIGKILL, True, LIMITS, 9.75) == "the tool did not answer within 9.75 s and was stopped"
    assert stopped_reason(-signal.SIGXCPU, False, LIMITS, 10) == "the tool used more than 5 s of CPU time and was stopped"
    assert stopped_reason(-signal.SIGSEGV, False, LIMITS, 10) == "the tool's process was killed (SIGSEGV)"
    assert stopped_reason(-99, False, LIMITS, 10) == "the tool's process was killed (signal 99)"
    assert stopped_reason(1, False, LIMITS, 10) == "the tool's process exited (status 1)"


def test_registry_runs_plain_and_async_tools():
    reg = ToolRegistry()
    assert reg.load("calculator=ampd.chat.calculator:calculator") == "calculator"
    assert reg.specs == ["calculator=ampd.chat.calculator:calculator"]

    async def twice(call: ToolInput) -> ToolOutput:
        return ToolOutput(2, "async")

    reg.register("twice", twice)
    reg.register("bad", lambda call: "not an output")
    assert reg.names() == ["bad", "calculator", "replay", "twice"]
    assert asyncio.run(reg.get("calculator")(CALL)).content == "42"
    loop = asyncio.new_event_loop()
    try:
        assert reg.run("calculator", CALL, loop).content == "42"
        assert reg.run("twice", CALL, loop) == ToolOutput(2, "async")
        with pytest.raises(TypeError, match="returned str, not a ToolOutput"):
            reg.run("bad", CALL, loop)
    finally:
        loop.close()
    with pytest.raises(KeyError):
        reg.get("nope")
    with pytest.raises(ValueError, match="expected NAME=module:function"):
        reg.load("calculator")
    assert isolated("calculator") and not isolated("replay")
