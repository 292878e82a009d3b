"""Tools a decode worker's sidecar can run.

A tool is a callable `(ToolInput) -> ToolOutput`, plain or async. `replay` is built in: it waits the
trace's `tool_s` and returns a result of the trace's next input length. Users register their own
Python callables by name (`ampd up --tool NAME=module:function`, or `register()` in code).

The sidecar runs `replay` itself (it only waits) and every registered tool in a tool process, under
CPU, memory and wall-clock limits (services/sidecar/toolproc.py, docs/security.md "Tools"); what
decides those limits and names a stopped call is here, pure.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolInput:
    session_id: str
    round: int
    arguments: dict
    latency_s: float
    result_tokens: int


@dataclass(frozen=True)
class ToolOutput:
    result_tokens: int
    content: str = ""


Tool = Callable[[ToolInput], Awaitable[ToolOutput]]
BUILTIN = "replay"


async def replay(call: ToolInput) -> ToolOutput:
    await asyncio.sleep(max(0.0, call.latency_s))
    return ToolOutput(result_tokens=call.result_tokens, content="")


class ToolRegistry:
    def __init__(self) -> None:
        self._fns: dict[str, Callable] = {BUILTIN: replay}
        self.specs: list[str] = []  # what load() was given: how a tool process loads the same tools

    def register(self, name: str, fn: Callable) -> None:
        if not name:
            raise ValueError("tool name must not be empty")
        if not callable(fn):
            raise ValueError(f"tool {name!r} is not callable")
        self._fns[name] = fn

    def load(self, spec: str) -> str:
        """Registers `NAME=module:function`; returns NAME."""
        name, sep, target = spec.partition("=")
        mod_name, sep2, attr = target.partition(":")
        if not sep or not sep2 or not name or not mod_name or not attr:
            raise ValueError(f"tool spec {spec!r}: expected NAME=module:function")
        try:
            fn = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"tool spec {spec!r}: {exc}") from exc
        self.register(name, fn)
        self.specs.append(spec)
        return name

    def get(self, name: str) -> Tool:
        """The tool as an async callable: a plain function runs in a thread, off the event loop."""
        fn = self._fns.get(name)
        if fn is None:
            raise KeyError(f"unknown tool {name!r} (registered: {', '.join(sorted(self._fns))})")
        if inspect.iscoroutinefunction(fn):
            return fn

        async def in_thread(call: ToolInput) -> ToolOutput:
            return await asyncio.to_thread(fn, call)

        return in_thread

    def run(self, name: str, call: ToolInput, loop: asyncio.AbstractEventLoop) -> ToolOutput:
        """Runs a tool in this thread, an async one on ``loop`` (a tool process: one call at a time)."""
        out = self._fns[name](call)
        if inspect.isawaitable(out):
            out = loop.run_until_complete(out)
        if not isinstance(out, ToolOutput):
            raise TypeError(f"returned {type(out).__name__}, not a ToolOutput")
        return out

    def names(self) -> list[str]:
        return sorted(self._fns)


def isolated(name: str) -> bool:
    """Whether a tool runs in a tool process: all but the built-in replay, which only waits."""
    return name != BUILTIN


# ------------------------------------------------------------------------------ limits (pure)
@dataclass(frozen=True)
class ToolLimits:
    """What one call of a registered tool may use (the sidecar's tool_* settings)."""

    cpu_s: int
    wall_s: float
    memory_mb: int


MARGIN_S = 0.25  # a call stopped at its caller's deadline answers this much before it


def call_budget(wall_s: float, caller_remaining_s: float | None) -> float:
    """Seconds a call may take from its arrival, waiting for a tool process included: the wall
    limit, and its answer must reach the caller before the caller's own deadline."""
    if caller_remaining_s is None:
        return wall_s
    return max(0.0, min(wall_s, caller_remaining_s - MARGIN_S))


def cpu_limit(used_s: float, cpu_s: int, hard: int) -> int:
    """The soft RLIMIT_CPU that gives the next call ``cpu_s`` seconds in a process that has used
    ``used_s`` (the limit counts the process's whole life; a tool process serves many calls).
    ``hard``: the hard limit (resource.RLIM_INFINITY, -1, when none)."""
    soft = math.ceil(used_s) + cpu_s
    return soft if hard < 0 else min(soft, hard)


def stopped_reason(returncode: int | None, out_of_time: bool, limits: ToolLimits, budget_s: float) -> str:
    """Why a call's tool process ended without answering (its result's error)."""
    if out_of_time:
        return f"the tool did not answer within {budget_s:.3g} s and was stopped"
    if returncode == -signal.SIGXCPU:
        return f"the tool used more than {limits.cpu_s} s of CPU time and was stopped"
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"the tool's process was killed ({name})"
    return f"the tool's process exited (status {returncode})"
