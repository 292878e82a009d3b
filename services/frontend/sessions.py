"""The sessions one front holds: a Coordinator.Session stream each, kept open between HTTP requests.

A session idles between turns (indexed in Redis by its history, `ampd.front.index`), runs one turn
at a time, and closes when it idles past the TTL, when the front needs room, or when its stream
ends. A turn runs to its end even when the HTTP client goes away, so the history the front records
is always the one the decode worker holds.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from ampd.front.index import LocalIndex, SessionIndex
from ampd.v1 import common_pb2, coordinator_pb2

log = structlog.get_logger()

END = object()  # the stream ended (after the session's last event)


@dataclass
class LiveSession:
    session_id: str
    history: list[int] = field(default_factory=list)  # every token the decode worker holds for it
    busy: bool = False
    entry: tuple[str, int] | None = None  # its index entry while it idles
    stale_entry: tuple[str, int] | None = None  # while a turn runs: its entry, still in Redis
    last_used: float = field(default_factory=time.monotonic)
    pending_calls: set[str] = field(default_factory=set)  # the decode worker's open client-side calls
    answers: list[str] = field(default_factory=list)  # digests of its answers (in the local index)
    closed: bool = False
    error: grpc.aio.AioRpcError | None = None
    events: asyncio.Queue | None = None  # the running turn's events
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    call: Any = None
    reader: asyncio.Task | None = None

    async def _requests(self):
        while (m := await self.outbox.get()) is not None:
            yield m

    def start(self, stub, open_msg: common_pb2.OpenSession) -> None:
        self.outbox.put_nowait(coordinator_pb2.ClientMessage(open=open_msg))
        self.call = stub.Session(self._requests())
        self.reader = asyncio.create_task(self._read(), name=f"session-{self.session_id}")

    async def _read(self) -> None:
        try:
            async for ev in self.call:
                if self.events is not None:
                    self.events.put_nowait(ev)
        except grpc.aio.AioRpcError as exc:
            self.error = exc
        except asyncio.CancelledError:
            pass
        finally:
            self.closed = True
            if self.events is not None:
                self.events.put_nowait(self.error or END)

    def send_turn(self, turn: common_pb2.Turn) -> None:
        self.outbox.put_nowait(coordinator_pb2.ClientMessage(turn=turn))

    def stop_round(self) -> None:
        """StopRound: the running turn's decoding ends at its next token; the session stays."""
        self.outbox.put_nowait(coordinator_pb2.ClientMessage(stop=coordinator_pb2.StopRound()))

    def close(self) -> None:
        """Ends the session: Close, then half-close (the decode worker frees its KV)."""
        if not self.closed:
            self.outbox.put_nowait(coordinator_pb2.ClientMessage(close=coordinator_pb2.Close()))
            self.outbox.put_nowait(None)

    def abort(self) -> None:
        if self.call is not None:
            self.call.cancel()


class SessionTable:
    """This front's live sessions, the TTL reaper, and their Redis index entries."""

    def __init__(self, index: SessionIndex, me: str, ttl_s: float, max_sessions: int) -> None:
        self.index = index
        self.me = me  # this front's URL, recorded with each session it holds
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.live: dict[str, LiveSession] = {}
        self.local = LocalIndex()
        self.closed_by_ttl = 0
        self._reaper: asyncio.Task | None = None

    def new_id(self) -> str:
        return f"fe-{uuid.uuid4().hex[:20]}"

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_loop(), name="session-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for s in list(self.live.values()):
            await self.drop(s)

    def room(self) -> bool:
        """Whether a new session fits, closing the least recently used idle one if need be."""
        if len(self.live) < self.max_sessions:
            return True
        idle = [s for s in self.live.values() if not s.busy]
        if not idle:
            return False
        asyncio.create_task(self.drop(min(idle, key=lambda s: s.last_used)))
        return True

    async def drop(self, s: LiveSession) -> None:
        """Closes the session and forgets it (its index entry and record too)."""
        if self.live.get(s.session_id) is s:
            del self.live[s.session_id]
        entry, s.entry = s.entry, None
        if entry is not None:
            self.local.remove(entry)
        entry, s.stale_entry = entry or s.stale_entry, None
        for d in s.answers:
            self.local.answers.pop(d, None)
        s.close()
        try:
            await self.index.withdraw(entry, s.session_id)
        except Exception as exc:  # Redis away: the keys expire on their own
            log.warning("index withdraw failed", session=s.session_id, error=str(exc))
        if s.reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(s.reader), 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                s.abort()

    def take(self, s: LiveSession) -> None:
        """A turn starts on the idle session: out of the local index. Its shared entry is replaced
        when the turn ends (`SessionIndex.publish`): a Redis call here would compete with the turn
        for the event loop."""
        s.busy = True
        entry, s.entry = s.entry, None
        if entry is not None:
            self.local.remove(entry)
            s.stale_entry = entry

    async def reap(self, now: float) -> int:
        """Closes the idle sessions not used for longer than the TTL; returns how many."""
        old = [s for s in self.live.values() if not s.busy and (s.closed or now - s.last_used > self.ttl_s)]
        for s in old:
            if not s.closed:
                self.closed_by_ttl += 1
                log.info("session idle past its TTL: closed", session=s.session_id, ttl_s=self.ttl_s)
            await self.drop(s)
        return len(old)

    async def _reap_loop(self) -> None:
        period = min(5.0, max(0.05, self.ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                await self.reap(time.monotonic())
            except Exception as exc:  # keep reaping
                log.warning("reaper failed", error=str(exc))
