"""The sessions one front holds: a Coordinator.Session stream each, kept open between HTTP requests.

A session belongs to one tenant (`ampd.front.tenants`), idles between turns (indexed in Redis by its
history, `ampd.front.index`, in its tenant's scope), runs one turn at a time, and closes when it
idles past the TTL, when its stream ends, or when it is evicted: the front needs room (`--max-sessions`,
the tenant's caps, or the deployment refused a new session for lack of KV; `ampd.front.evict`). A
turn runs to its end even when the HTTP client goes away, so the history the front records is always
the one the decode worker holds.

An evicted session leaves its answers behind (`Evicted`) until its TTL: the ids of the answers the
client resends render its conversation to the same ids, so the continuation opens a new session
with the same history (a prefill of all of it) and the model sees the same tokens.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from ampd import tracing
from ampd.front.index import LocalIndex, SessionIndex
from ampd.front.tenants import OPEN, Tenant
from ampd.tasks import BackgroundTasks
from ampd.v1 import common_pb2, coordinator_pb2

log = structlog.get_logger()

END = object()  # the stream ended (after the session's last event)


@dataclass
class LiveSession:
    session_id: str  # its id on the coordinator (unique across tenants)
    history: list[int] = field(default_factory=list)  # every token the decode worker holds for it
    name: str = ""  # its name for its client (x-session-id; default: session_id), unique in its tenant
    tenant: Tenant = OPEN
    worker: str = ""  # its decode worker (from its first event)
    promised: int = 0  # KV tokens the deployment promised it (its turns' inputs and max_tokens)
    open_msg: common_pb2.OpenSession | None = None  # what opened it (a refused open is retried)
    opened_with: dict[str, list[int]] = field(default_factory=dict)  # the answers its first history held
    busy: bool = False
    entry: tuple[str, int] | None = None  # its index entry while it idles
    stale_entry: tuple[str, int] | None = None  # while a turn runs: its entry, still in Redis
    last_used: float = field(default_factory=time.monotonic)
    pending_calls: set[str] = field(default_factory=set)  # the decode worker's open client-side calls
    answers: list[str] = field(default_factory=list)  # digests of the answers in its history (it holds them)
    unpublished: list[tuple[str, list[int]]] = field(default_factory=list)  # answers not in Redis yet
    closed: bool = False
    error: grpc.aio.AioRpcError | None = None
    events: asyncio.Queue | None = None  # the running turn's events
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    call: Any = None
    reader: asyncio.Task | None = None
    caller: Any = None  # the context (W3C traceparent) of the request that opened it: its span links to it

    async def _requests(self):
        while (m := await self.outbox.get()) is not None:
            yield m

    def start(self, coordinator) -> None:
        """Opens the session (``open_msg``) on the coordinator's Session stream."""
        self.outbox.put_nowait(coordinator_pb2.ClientMessage(open=self.open_msg))
        self.call = coordinator.Session(self._requests(), metadata=tracing.metadata(self.caller))
        self.reader = asyncio.create_task(self._read(), name=f"session-{self.session_id}")

    async def _read(self) -> None:
        try:
            async for batch in self.call:
                for ev in batch.events:
                    if ev.decode_worker:
                        self.worker = ev.decode_worker
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

    def __post_init__(self) -> None:
        self.name = self.name or self.session_id

    def reopen(self, coordinator, session_id: str) -> None:
        """Opens again what a refused open asked for, under a new id (the same name)."""
        self.session_id, self.closed, self.error, self.worker = session_id, False, None, ""
        self.outbox, self.call, self.reader, self.events = asyncio.Queue(), None, None, None
        self.open_msg.session_id = session_id
        self.start(coordinator)


@dataclass
class Evicted:
    """An evicted session's answers, held until its TTL (see the module doc)."""
    tenant: Tenant
    answers: list[str]
    last_used: float
    session_id: str = ""


EVICTION_REASONS = ("kv-full", "max-sessions", "tenant-sessions", "tenant-kv")


class SessionTable:
    """This front's live sessions, the TTL reaper, evictions, and their Redis index entries."""

    def __init__(self, index: SessionIndex, me: str, ttl_s: float, max_sessions: int) -> None:
        self.index = index
        self.me = me  # this front's URL, recorded with each session it holds
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.live: dict[str, LiveSession] = {}  # by session id
        self.named: dict[tuple[str, str], LiveSession] = {}  # (tenant scope, name) -> session
        self.evicted: dict[str, Evicted] = {}  # by session id, until their TTL
        self.local = LocalIndex()
        self.closed_by_ttl = 0
        self.evictions: dict[str, int] = dict.fromkeys(EVICTION_REASONS, 0)
        self._closing = BackgroundTasks()  # evicted sessions' streams being closed, their records released
        self._reaper = BackgroundTasks()

    def new_id(self) -> str:
        return f"fe-{uuid.uuid4().hex[:20]}"

    def start(self) -> None:
        self._reaper.spawn(self._reap_loop(), name="session-reaper")

    async def stop(self) -> None:
        await self._reaper.close()
        await self._closing.close(cancel=False)  # (they end by themselves: bounded Redis and gRPC calls)
        for s in list(self.live.values()):
            await self.drop(s)
        await self._forget_evicted([self._release_evicted(sid) for sid in list(self.evicted)])

    def add(self, s: LiveSession) -> None:
        self.live[s.session_id] = s
        self.named[(s.tenant.scope, s.name)] = s

    def get(self, tenant: Tenant, name: str) -> LiveSession | None:
        """The tenant's live session of this name (another tenant's never)."""
        s = self.named.get((tenant.scope, name))
        return s if s is not None and not s.closed else None

    def of_tenant(self, tenant: Tenant) -> list[LiveSession]:
        return [s for s in self.live.values() if s.tenant.scope == tenant.scope]

    def hold(self, s: LiveSession, answers: dict[str, list[int]]) -> None:
        """A new session's history holds these answers (digest -> ids): they stay while it lives."""
        for d, ids in answers.items():
            s.answers.append(d)
            s.unpublished.append((d, ids))
            self.local.hold_answer(s.tenant.scope, d, ids)

    def room(self) -> bool:
        """Whether a new session fits, evicting the least recently used idle one if need be."""
        if len(self.live) < self.max_sessions:
            return True
        idle = [s for s in self.live.values() if not s.busy]
        if not idle:
            return False
        self.evict(min(idle, key=lambda s: s.last_used), "max-sessions")
        return True

    def evict(self, s: LiveSession, reason: str) -> asyncio.Task | None:
        """Closes an idle session to make room, keeping its answers until its TTL. It is out of the
        table at once; the task closes its stream."""
        if s.busy or self.live.get(s.session_id) is not s:
            return None
        self.evictions[reason] += 1
        log.info("idle session evicted", session=s.session_id, reason=reason, tokens=len(s.history))
        self.evicted[s.session_id] = Evicted(s.tenant, s.answers, s.last_used, s.session_id)
        s.answers = []  # held by the Evicted record now
        if len(self.evicted) > self.max_sessions:  # bounded: the oldest record goes before its TTL
            self._later(self._forget_evicted([self._release_evicted(next(iter(self.evicted)))]))
        return self._later(self._close(s, *self._detach(s)))

    def _later(self, coro) -> asyncio.Task:
        return self._closing.spawn(coro)

    async def drop(self, s: LiveSession) -> None:
        """Closes the session and forgets it (its index entry, record and answers too)."""
        await self._close(s, *self._detach(s))

    def _detach(self, s: LiveSession) -> tuple[tuple[str, int] | None, list[str]]:
        """Takes the session out of the table and the local index; returns what Redis holds of it."""
        if self.live.get(s.session_id) is s:
            del self.live[s.session_id]
        if self.named.get((s.tenant.scope, s.name)) is s:
            del self.named[(s.tenant.scope, s.name)]
        scope = s.tenant.scope
        entry, s.entry = s.entry, None
        if entry is not None:
            self.local.remove(scope, entry)
        entry, s.stale_entry = entry or s.stale_entry, None
        answers, s.answers = s.answers, []
        for d in answers:
            self.local.release_answer(scope, d)
        return entry, answers

    async def _close(self, s: LiveSession, entry: tuple[str, int] | None, answers: list[str]) -> None:
        s.close()
        try:
            await self.index.withdraw(s.tenant.scope, entry, s.session_id, answers)
        except Exception as exc:  # Redis away: the keys expire on their own
            log.warning("index withdraw failed", session=s.session_id, error=str(exc))
        if s.reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(s.reader), 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                s.abort()

    def _release_evicted(self, sid: str) -> Evicted | None:
        """Forgets an evicted session's answers here; returns them for Redis."""
        e = self.evicted.pop(sid, None)
        if e is not None:
            for d in e.answers:
                self.local.release_answer(e.tenant.scope, d)
        return e

    async def _forget_evicted(self, records: list[Evicted | None]) -> None:
        for e in records:
            if e is None:
                continue
            sid = e.session_id
            try:
                await self.index.withdraw(e.tenant.scope, None, sid, e.answers)
            except Exception as exc:  # Redis away: the keys expire on their own
                log.warning("index withdraw failed", session=sid, error=str(exc))

    def take(self, s: LiveSession) -> None:
        """A turn starts on the idle session: out of the local index. Its shared entry is replaced
        when the turn ends (`SessionIndex.publish`): a Redis call here would compete with the turn
        for the event loop."""
        s.busy = True
        entry, s.entry = s.entry, None
        if entry is not None:
            self.local.remove(s.tenant.scope, entry)
            s.stale_entry = entry

    async def reap(self, now: float) -> int:
        """Closes the idle sessions not used for longer than the TTL; returns how many. The answers
        of evicted sessions go at their TTL too."""
        old = [s for s in self.live.values() if not s.busy and (s.closed or now - s.last_used > self.ttl_s)]
        for s in old:
            if not s.closed:
                self.closed_by_ttl += 1
                log.info("session idle past its TTL: closed", session=s.session_id, ttl_s=self.ttl_s)
            await self.drop(s)
        await self._forget_evicted([self._release_evicted(sid) for sid, e in list(self.evicted.items())
                                    if now - e.last_used > self.ttl_s])
        return len(old)

    async def _reap_loop(self) -> None:
        period = min(5.0, max(0.05, self.ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                await self.reap(time.monotonic())
            except Exception as exc:  # keep reaping
                log.warning("reaper failed", error=str(exc))
