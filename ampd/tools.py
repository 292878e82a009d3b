"""Tools a decode worker's sidecar can run.

A tool is an async callable `(ToolInput) -> ToolOutput`. `replay` is built in: it waits the
trace's `tool_s` and returns a result of the trace's next input length. Users register their own
Python callables by name (`ampd up --tool NAME=module:function`, or `register()` in code).
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
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


async def replay(call: ToolInput) -> ToolOutput:
    await asyncio.sleep(max(0.0, call.latency_s))
    return ToolOutput(result_tokens=call.result_tokens, content="")


class ToolRegistry:
    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {"replay": replay}

    def register(self, name: str, fn: Callable) -> None:
        if not name:
            raise ValueError("tool name must not be empty")
        if not callable(fn):
            raise ValueError(f"tool {name!r} is not callable")
        if inspect.iscoroutinefunction(fn):
            self._tools[name] = fn
        else:  # a plain function runs in a thread, off the sidecar's event loop
            async def wrapped(call: ToolInput, _fn=fn) -> ToolOutput:
                return await asyncio.to_thread(_fn, call)

            self._tools[name] = wrapped

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
        return name

    def get(self, name: str) -> Tool:
        tool = self._tools.get(name)
        if tool is None:
            raise KeyError(f"unknown tool {name!r} (registered: {', '.join(sorted(self._tools))})")
        return tool

    def names(self) -> list[str]:
        return sorted(self._tools)
