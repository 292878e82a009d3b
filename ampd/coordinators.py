"""A client's coordinators: one address, or several sharing one Redis ("HOST:PORT,HOST:PORT").

``Coordinators`` answers the two calls of the generated gRPC client ``CoordinatorStub`` (``Session``,
``Metrics``) for the bench client and the front. With two or more addresses, new sessions go to them in turn, and a session whose coordinator
is lost (its stream fails UNAVAILABLE, as when that process is killed) goes on through the next one:
the client sends ``ReattachSession`` (coordinator.proto) with the last event number it got, and the
new coordinator takes the session over on the decode worker that holds its KV; the events the
client missed come again, none twice. What the lost coordinator may never have passed on is sent
again: the last turn (the new coordinator forwards it only if the worker never got it), and any
StopRound, Cancel or Close since the last TurnEnd (each harmless when it did arrive).

Where the session cannot continue (NOT_FOUND: it never reached a decode worker, or that worker is
gone too, or it missed more events than the worker keeps), a session of one turn is opened again
from its start and its events already delivered are left out (greedy outputs repeat exactly); a
session of several turns ends with that status.
"""
from __future__ import annotations

import asyncio
import time

import grpc

from ampd import grpcserver
from ampd.tasks import BackgroundTasks
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

__all__ = ["Coordinators", "parse_addresses", "session_events", "stream_code"]

# A stream that failed with these may go on through another coordinator
FAILOVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
# gRPC core's own detail when a stream breaks in a way it cannot classify: seen (1 of ~13 kills of a
# coordinator on a box at load 12-17) where a killed process's stream usually fails UNAVAILABLE. No
# AMPD server sends it (theirs name what failed), so it is the transport's failure, not an answer.
CORE_TRANSPORT_INTERNAL = "Internal error from Core"
RETRY_PAUSE_S = 0.1  # between tries: a stream to a just-killed process fails at once
DOWN_S = 2.0  # a coordinator whose stream failed UNAVAILABLE gets no new session for this long


def stream_code(exc: grpc.aio.AioRpcError) -> grpc.StatusCode:
    """How a session stream's failure is taken: the status, except that gRPC core's unclassified
    transport failure (``CORE_TRANSPORT_INTERNAL``) counts as the coordinator lost (UNAVAILABLE)."""
    code = exc.code()
    if code == grpc.StatusCode.INTERNAL and exc.details() == CORE_TRANSPORT_INTERNAL:
        return grpc.StatusCode.UNAVAILABLE
    return code


def parse_addresses(text: str, what: str = "--target") -> list[str]:
    """``HOST:PORT[,HOST:PORT...]`` as a list; ValueError naming the bad one."""
    out = [a.strip() for a in text.split(",")]
    for a in out:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or a.startswith(("http://", "https://")):
            raise ValueError(f"{what} {a!r}: expected a coordinator's HOST:PORT (several: comma-separated)")
    if len(set(out)) != len(out):
        raise ValueError(f"{what} {text!r}: an address is given twice")
    return out


async def session_events(call):
    """The SessionEvent of a Session stream (a generated client's call or a FailoverSession) one by
    one: the stream sends those ready together as one SessionEvents."""
    async for batch in call:
        for ev in batch.events:
            yield ev


class Coordinators:
    def __init__(self, addresses: list[str], token: str | None = None,
                 max_message: int = grpcserver.CLIENT_MAX_MESSAGE) -> None:
        self.addresses = list(addresses)
        self.channels = [grpcserver.channel(a, token=token, max_message=max_message) for a in self.addresses]
        self.stubs = [coordinator_pb2_grpc.CoordinatorStub(ch) for ch in self.channels]
        self._next = 0
        self._down: dict[int, float] = {}  # coordinator index -> until when it gets no new session
        self.failovers = 0  # sessions that went on through another coordinator
        self.restarts = 0  # sessions opened again from their start after events had come
        self.tasks = BackgroundTasks()  # its sessions' request readers and header watches

    async def check(self, timeout_s: float = 10.0) -> common_pb2.MetricsReply:
        """Every coordinator answers (its Metrics), or ConnectionError naming the first that does not."""
        replies = await asyncio.gather(*(s.Metrics(common_pb2.MetricsRequest(), timeout=timeout_s)
                                         for s in self.stubs), return_exceptions=True)
        for address, r in zip(self.addresses, replies):
            if isinstance(r, grpc.aio.AioRpcError):
                raise ConnectionError(f"cannot reach the coordinator at {address}: {r.code().name} {r.details()}")
            if isinstance(r, BaseException):
                raise r
        return replies[0]

    async def Metrics(self, request, timeout: float | None = None):  # noqa: N802 (the gRPC method name)
        """The first coordinator that answers."""
        err: grpc.aio.AioRpcError | None = None
        for stub in self._order(self._next):
            try:
                return await stub.Metrics(request, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                err = exc
        raise err

    def Session(self, requests, timeout: float | None = None,  # noqa: N802 (the gRPC method name)
                metadata=None) -> "FailoverSession":
        n, now = len(self.stubs), time.monotonic()
        start = self._next % n
        for i in range(n):  # the next one in turn that was not found down just now
            if self._down.get((self._next + i) % n, 0.0) <= now:
                start = (self._next + i) % n
                break
        self._next = start + 1
        return FailoverSession(self, requests, start, timeout, metadata)

    def down(self, index: int) -> None:
        self._down[index % len(self.stubs)] = time.monotonic() + DOWN_S

    def _order(self, start: int) -> list:
        n = len(self.stubs)
        return [self.stubs[(start + i) % n] for i in range(n)]

    async def close(self) -> None:
        await self.tasks.close()
        for ch in self.channels:
            await ch.close()


class FailoverSession:
    """One session's stream, as a generated gRPC client's call looks (iterate its SessionEvents;
    ``cancel()``), going on through the next coordinator when its own is lost (the module doc)."""

    def __init__(self, coords: Coordinators, requests, start: int, timeout: float | None,
                 metadata=None) -> None:
        self.coords = coords
        self._metadata = metadata  # sent on every stream it opens (a trace's W3C traceparent)
        self._requests = requests
        self._index = start
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._call = None
        self._header: asyncio.Future | None = None
        self._queue: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None
        self._cancelled = False
        self.open: common_pb2.OpenSession | None = None
        self.sid = ""
        self.seq = 0  # the last event number received
        self.token = ""  # the reattach token (SessionEvent.reattach_token)
        self.turns = 0  # turns sent, the open's counted
        self.last_turn: common_pb2.Turn | None = None
        self.since_turn_end: list = []  # StopRound, Cancel and Close sent since the last TurnEnd
        self.half_closed = False
        # what was delivered, for a session opened again: round -> end position of its tokens, and
        # the (kind, round) of its other events
        self._token_end: dict[int, int] = {}
        self._delivered: set[tuple[str, int]] = set()
        self.failovers = 0
        self.restarts = 0

    # ------------------------------------------------------------------------ requests
    async def _read_requests(self) -> None:
        """The caller's messages, noted and passed to the current stream; its end half-closes it."""
        async for msg in self._requests:
            kind = msg.WhichOneof("msg")
            if kind == "open":
                self.open, self.sid, self.turns = msg.open, msg.open.session_id, 1
            elif kind == "turn":
                self.turns += 1
                self.last_turn = msg.turn
                self.since_turn_end.clear()
            else:
                self.since_turn_end.append(msg)
            self._queue.put_nowait(msg)
        self.half_closed = True
        self._queue.put_nowait(None)

    @staticmethod
    async def _messages(queue: asyncio.Queue):
        while (m := await queue.get()) is not None:
            yield m

    def _start(self, first: list) -> None:
        """A stream on the current coordinator, its first messages ``first``, then the caller's."""
        queue: asyncio.Queue = asyncio.Queue()
        for m in first:
            queue.put_nowait(m)
        if self.half_closed:
            queue.put_nowait(None)
        self._queue = queue
        self._open_call(queue)

    def _open_call(self, queue: asyncio.Queue) -> None:
        timeout = None if self._deadline is None else max(0.1, self._deadline - time.monotonic())
        self._call = self.coords.stubs[self._index % len(self.coords.stubs)].Session(
            self._messages(queue), timeout=timeout, metadata=self._metadata)
        self._header = self.coords.tasks.spawn(self._note_token(self._call))

    async def _note_token(self, call) -> None:
        """The reattach token from the session's headers (sent once it is bound, before any event)."""
        try:
            for key, value in await call.initial_metadata() or ():
                if key == grpcserver.REATTACH_HEADER and call is self._call:
                    self.token = value
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass

    # -------------------------------------------------------------------------- events
    def __aiter__(self):
        return self._events()

    async def _events(self):
        self._queue = asyncio.Queue()
        self._reader = self.coords.tasks.spawn(self._read_requests())
        self._open_call(self._queue)
        tries = 0
        try:
            while True:
                try:
                    async for batch in self._call:
                        events = [ev for ev in batch.events if self._filter(ev) is not None]
                        if events:
                            yield coordinator_pb2.SessionEvents(events=events)
                            if events[-1].HasField("done"):
                                return
                    return
                except grpc.aio.AioRpcError as exc:
                    code = stream_code(exc)
                    tries += 1
                    if self._header is not None and not self._header.done():
                        self._header.cancel()
                    if code == grpc.StatusCode.UNAVAILABLE:
                        self.coords.down(self._index)
                    again = len(self.coords.stubs) > 1 and not self._cancelled and self.open is not None \
                        and tries <= 2 * len(self.coords.stubs) + 2 \
                        and (self._deadline is None or time.monotonic() < self._deadline)
                    if again and code in FAILOVER and self.token:
                        self._failover()
                    elif again and (code in FAILOVER or (code == grpc.StatusCode.NOT_FOUND and self.token)) \
                            and self.turns == 1:
                        self._reopen()
                    else:
                        raise
                    await asyncio.sleep(RETRY_PAUSE_S)
        finally:
            if self._reader is not None:
                self._reader.cancel()
            if self._header is not None:
                self._header.cancel()

    def _filter(self, ev: coordinator_pb2.SessionEvent) -> coordinator_pb2.SessionEvent | None:
        """Notes the event; None for one the caller already has (sent again after a reattach or a
        new open)."""
        if ev.reattach_token:
            self.token = ev.reattach_token
        if ev.seq:
            if ev.seq <= self.seq:
                return None
            self.seq = ev.seq
        kind = ev.WhichOneof("event")
        if kind == "tokens":
            t = ev.tokens
            end = self._token_end.get(t.round, 0)
            if t.position + len(t.token_ids) <= end:
                return None
            if t.position < end:  # partly delivered (a session opened again): the rest only
                skip = end - t.position
                del t.token_ids[:skip]
                del t.times[:skip]
                t.position = end
            self._token_end[t.round] = t.position + len(t.token_ids)
            return ev
        if kind in ("round_end", "tool_call", "turn_end"):
            rnd = ev.round_end.timing.round if kind == "round_end" else getattr(ev, kind).round
            if (kind, rnd) in self._delivered and kind != "tool_call":
                return None
            self._delivered.add((kind, rnd))
            if kind == "turn_end":
                self.since_turn_end.clear()
        return ev

    def _failover(self) -> None:
        """The next coordinator takes the session over (ReattachSession)."""
        self._index += 1
        self.failovers += 1
        self.coords.failovers += 1
        r = coordinator_pb2.ReattachSession(session_id=self.sid, reattach_token=self.token, after_seq=self.seq,
                                            turns=self.turns)
        if self.last_turn is not None:
            r.turn.CopyFrom(self.last_turn)
        self._start([coordinator_pb2.ClientMessage(reattach=r), *self.since_turn_end])

    def _reopen(self) -> None:
        """The session cannot go on: it opens again from its start, on the next coordinator."""
        self._index += 1
        if self._token_end or self._delivered:  # (before anything came it is a plain retry)
            self.restarts += 1
            self.coords.restarts += 1
        self.seq, self.token = 0, ""  # its events are numbered anew: those delivered are told by position
        self._start([coordinator_pb2.ClientMessage(open=self.open), *self.since_turn_end])

    def cancel(self) -> bool:
        self._cancelled = True
        if self._reader is not None:
            self._reader.cancel()
        return self._call.cancel() if self._call is not None else False
