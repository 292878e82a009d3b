"""The sidecar's tool processes: a few started up front, one call at a time each.

A call waits for an idle process, sends it the call and reads its answer within the call's budget
(ampd.tools.call_budget). A process that does not answer in time, or dies (SIGXCPU at its CPU
limit), is killed and reaped, and a new one takes its place in the background; the call's answer is
an error string, which the sidecar returns as the call's result. The sidecar's event loop never
runs a tool, so it keeps answering while a call spins.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import asdict, dataclass

import structlog

from ampd import deathsig
from ampd.config import to_argv
from ampd.tools import ToolInput, ToolLimits, ToolOutput, stopped_reason
from services.sidecar.toolproc import ARGV_SETTINGS

log = structlog.get_logger()

MAX_REPLY = 64 << 20  # bytes of one answer (the limit of a message between services)
START_TIMEOUT_S = 60.0
RESTART_DELAY_S = 1.0  # between tries when a replacement fails to start


class StartError(RuntimeError):
    """A tool process did not start (its tools failed to load, or its limits are too tight)."""


@dataclass(eq=False)  # a process is itself: sets hold it by identity
class _Proc:
    popen: subprocess.Popen
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


class ToolProcesses:
    def __init__(self, specs: list[str], limits: ToolLimits, count: int) -> None:
        self.specs = specs
        self.limits = limits
        self.count = count
        self.idle: asyncio.Queue[_Proc] = asyncio.Queue()
        self.procs: set[_Proc] = set()
        self.stopped = 0  # calls whose process was killed (deadline, CPU time, a crash)
        self._refills: set[asyncio.Task] = set()
        self._closed = False

    def _argv(self) -> list[str]:
        values = {"tool_cpu_s": self.limits.cpu_s, "tool_memory_mb": self.limits.memory_mb, "tool": self.specs}
        # deathsig: a tool process ends with its sidecar, however the sidecar ends
        return deathsig.wrap([sys.executable, "-m", "services.sidecar.toolproc", *to_argv(values, ARGV_SETTINGS)])

    async def _start_one(self) -> _Proc:
        # subprocess.Popen spawns with vfork, which runs no fork handlers: uvloop's own subprocesses
        # fork, and gRPC's fork handlers then run in a process that serves gRPC (ampd/deathsig.py).
        popen = subprocess.Popen(self._argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=MAX_REPLY)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), popen.stdout)
        transport, protocol = await loop.connect_write_pipe(lambda: asyncio.StreamReaderProtocol(
            asyncio.StreamReader()), popen.stdin)
        proc = _Proc(popen, reader, asyncio.StreamWriter(transport, protocol, None, loop))
        self.procs.add(proc)
        try:
            line = await asyncio.wait_for(reader.readline(), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            line = b""
        if not line.startswith(b'{"ready"'):
            await self._kill(proc)
            raise StartError(f"a tool process did not start (status {popen.returncode}; its log is the sidecar's)")
        return proc

    async def start(self) -> None:
        try:
            for proc in await asyncio.gather(*(self._start_one() for _ in range(self.count))):
                self.idle.put_nowait(proc)
        except BaseException:
            await self.close()
            raise

    async def _kill(self, proc: _Proc) -> None:
        self.procs.discard(proc)
        proc.popen.kill()  # a no-op once it was reaped
        proc.writer.close()
        await asyncio.to_thread(proc.popen.wait)  # reaped: no zombie left

    def _replace(self) -> None:
        async def refill() -> None:
            while not self._closed:
                try:
                    self.idle.put_nowait(await self._start_one())
                    return
                except (StartError, OSError) as exc:
                    log.error("tool process restart failed", error=str(exc))
                    await asyncio.sleep(RESTART_DELAY_S)

        task = asyncio.get_running_loop().create_task(refill())
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def call(self, name: str, call: ToolInput, budget_s: float) -> tuple[ToolOutput | None, str]:
        """(its output, "") or (None, why it failed); answers within ``budget_s`` (and a kill's time)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_s
        try:
            proc = await asyncio.wait_for(self.idle.get(), budget_s)
        except asyncio.TimeoutError:
            return None, f"no tool process was free within {budget_s:.3g} s"
        request = json.dumps({"name": name, **asdict(call)}).encode() + b"\n"
        line = b""
        try:
            proc.writer.write(request)
            await proc.writer.drain()
            line = await asyncio.wait_for(proc.reader.readline(), max(0.0, deadline - loop.time()))
            reply = json.loads(line)
        except asyncio.CancelledError:  # the caller went away: nobody wants what the call makes
            await self._stop(proc)
            raise
        except (asyncio.TimeoutError, ValueError, OSError) as exc:  # ValueError: an over-long or bad line
            await self._stop(proc)
            if isinstance(exc, ValueError) and line:
                return None, "the tool's result is too large or malformed"
            return None, stopped_reason(proc.popen.returncode, isinstance(exc, asyncio.TimeoutError), self.limits,
                                        budget_s)
        self.idle.put_nowait(proc)
        if "error" in reply:
            return None, str(reply["error"])
        tokens, content = reply.get("result_tokens"), reply.get("content")
        if type(tokens) is not int or not 0 <= tokens < 1 << 32 or not isinstance(content, str):
            return None, "the tool's result is not a ToolOutput(result_tokens: int, content: str)"
        return ToolOutput(tokens, content), ""

    async def _stop(self, proc: _Proc) -> None:
        self.stopped += 1
        await self._kill(proc)
        if not self._closed:
            self._replace()

    async def close(self) -> None:
        self._closed = True
        refills = list(self._refills)
        for task in refills:
            task.cancel()
        await asyncio.gather(*refills, return_exceptions=True)
        for proc in list(self.procs):
            await self._kill(proc)
