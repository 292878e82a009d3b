"""A tool process: ``python -m services.sidecar.toolproc --tool-cpu-s N --tool-memory-mb M --tool SPEC ...``.

The sidecar starts a few (services/sidecar/pool.py) and sends each one call at a time: one JSON
line on stdin ``{"name", "session_id", "round", "arguments", "latency_s", "result_tokens"}``, one
JSON line back, ``{"result_tokens", "content"}`` or ``{"error"}``. The process caps its own address
space (RLIMIT_AS) once and its CPU time (RLIMIT_CPU) before each call, so a runaway call ends in
SIGXCPU or a MemoryError whatever it runs; the sidecar kills it at the call's wall deadline.
Nothing here logs a call's arguments or result.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time

from ampd.config import add_flags
from ampd.tools import ToolInput, ToolRegistry, cpu_limit

MAX_ERROR = 1000  # characters of an exception's message the model gets back
# The sidecar's settings a tool process takes on its command line (services/sidecar/pool.py).
ARGV_SETTINGS = ("tool_cpu_s", "tool_memory_mb", "tool")


def _limit_memory(memory_mb: int) -> None:
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU dumps core by default


def _limit_cpu(cpu_s: int) -> None:
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    used = time.process_time()
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit(used, cpu_s, hard), hard))


def answer(registry: ToolRegistry, request: dict, loop: asyncio.AbstractEventLoop, memory_mb: int) -> dict:
    call = ToolInput(request["session_id"], request["round"], request["arguments"], request["latency_s"],
                     request["result_tokens"])
    try:
        out = registry.run(request["name"], call, loop)
    except MemoryError:
        return {"error": f"the tool ran out of memory (limit {memory_mb} MiB)"}
    except Exception as exc:  # a tool's bug is its call's error result
        return {"error": f"the tool raised {type(exc).__name__}: {str(exc)[:MAX_ERROR]}"}
    return {"result_tokens": out.result_tokens, "content": out.content}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampd-toolproc")
    add_flags(parser, ARGV_SETTINGS, required=("tool_cpu_s", "tool_memory_mb"))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # The protocol keeps stdout's pipe; a tool's own prints go to stderr (the sidecar's log).
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    _limit_memory(args.tool_memory_mb)
    registry = ToolRegistry()
    for spec in args.tool:
        registry.load(spec)
    loop = asyncio.new_event_loop()
    replies.write('{"ready": true}\n')
    replies.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        _limit_cpu(args.tool_cpu_s)
        try:
            reply = json.dumps(answer(registry, request, loop, args.tool_memory_mb))
        except (TypeError, ValueError):  # content that is not text
            reply = json.dumps({"error": "the tool's result is not text"})
        replies.write(reply + "\n")
        replies.flush()


if __name__ == "__main__":
    try:
        main()
    except (BrokenPipeError, KeyboardInterrupt):  # the sidecar went away
        sys.exit(0)
