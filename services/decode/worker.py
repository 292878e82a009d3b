"""Decode worker core: the sessions it owns, its continuous batch, its local prefill queue.

One asyncio loop step is either one local prefill (the batch waits: prefill has priority) or one
decode step for the whole batch; see docs/architecture.md "Timing semantics".
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import structlog

from ampd.engine.base import DecodeSeq, Engine
from ampd.kv import KVPoolExhausted, Segment, SessionKV, verify_pattern
from ampd.policy import QueuedTask
from ampd.v1 import common_pb2, decode_pb2, prefill_pb2, sidecar_pb2
from ampd.runtime import WorkerRuntime

log = structlog.get_logger()


class SessionError(Exception):
    """Ends one session with an error event; the worker keeps serving the others."""


def seg_pb(segments: list[Segment]) -> list[common_pb2.Segment]:
    return [common_pb2.Segment(block=s.block, offset=s.offset, tokens=s.tokens) for s in segments]


@dataclass(eq=False)
class Session:
    session_id: str
    plan: list[common_pb2.RoundPlan]
    max_rounds: int
    max_output: int
    kv: SessionKV
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    round: int = 0
    l_hist: int = 0
    l_incr: int = 0
    input_ready: float = 0.0
    dest: list[Segment] = field(default_factory=list)
    remaining: int = 0  # tokens still to produce this round
    last_token: int = 0
    position: int = 0  # position of last_token (its KV not written yet)
    last_emit: float = 0.0
    timing: common_pb2.RoundTiming | None = None
    rounds_done: list[common_pb2.RoundTiming] = field(default_factory=list)
    pending_call: str = ""
    closed: bool = False

    def output_tokens(self) -> int:
        n = self.plan[self.round].output_tokens
        return min(n, self.max_output) if self.max_output else n

    def last_round(self) -> bool:
        return self.round + 1 >= len(self.plan) or (self.max_rounds and self.round + 1 >= self.max_rounds)


class DecodeCore:
    def __init__(self, rt: WorkerRuntime, engine: Engine, sidecar_stub=None, chunk_tokens: int = 0,
                 cost=None) -> None:
        self.rt = rt
        self.cost = cost  # the profile: predicts the local prefill in service (queue_predicted_s)
        # > 0: local prefills longer than this run in chunks interleaved with decode steps.
        self.chunk_tokens = chunk_tokens
        self.chunking: list | None = None  # [session, tokens done] of the chunked prefill running
        self.engine = engine
        self.sidecar = sidecar_stub
        self.sessions: dict[str, Session] = {}
        self.batch: list[Session] = []
        self.joining: list[Session] = []  # first token emitted, joins the batch at the next step
        self.awaiting_remote: dict[tuple[str, int], Session] = {}
        self.wake = asyncio.Event()
        self.metrics: dict[str, float] = {
            "sessions_opened": 0, "sessions_completed": 0, "sessions_failed": 0,
            "prefills_local": 0, "prefills_remote": 0, "decode_steps": 0, "tokens": 0,
            "kv_bytes_verified": 0, "kv_bytes_mismatched": 0, "tool_calls": 0, "prefill_chunks": 0,
        }
        self._tasks: list[asyncio.Task] = []

    # ---------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._loop(), name="decode-loop"))
        self._notifs = self.rt.transport.listen(lambda _peer, msg: self._on_prefill_done(msg),
                                                pending=lambda: bool(self.awaiting_remote))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._notifs.stop()
        for s in list(self.sessions.values()):
            self.fail(s, "worker shutting down")

    # ----------------------------------------------------------------------------- session events
    def emit(self, s: Session, event: decode_pb2.DecodeEvent) -> None:
        if not s.closed:
            s.events.put_nowait(event)

    def open(self, req: decode_pb2.AttachRequest) -> Session:
        o = req.open
        if o.session_id in self.sessions:
            raise SessionError(f"session {o.session_id!r} is already open on this worker")
        s = Session(
            session_id=o.session_id,
            plan=list(o.rounds),
            max_rounds=o.limits.max_rounds,
            max_output=o.limits.max_output_tokens,
            kv=SessionKV(self.rt.pool.block_tokens),
        )
        self.sessions[s.session_id] = s
        self.rt.active_sessions = len(self.sessions)
        self.metrics["sessions_opened"] += 1
        self.begin_round(s, 0, s.plan[0].input_tokens, req.arrival or time.time())
        return s

    def begin_round(self, s: Session, rnd: int, l_incr: int, input_ready: float) -> None:
        """The round's input is ready: reserve its KV and ask the coordinator to route it."""
        s.round, s.l_hist, s.l_incr, s.input_ready = rnd, s.kv.tokens, l_incr, input_ready
        try:
            s.dest = s.kv.reserve(self.rt.pool, l_incr)
        except KVPoolExhausted as exc:
            self.fail(s, f"KV exhausted on {self.rt.cfg.worker_id}: {exc}")
            return
        self.rt.changed()
        s.timing = common_pb2.RoundTiming(round=rnd, input_ready=input_ready, l_hist=s.l_hist, l_incr=l_incr)
        self.emit(s, decode_pb2.DecodeEvent(prefill_needed=decode_pb2.PrefillNeeded(
            round=rnd, l_hist=s.l_hist, l_incr=l_incr, input_ready=input_ready,
            history=seg_pb(s.kv.segments(0, s.l_hist)), dest=seg_pb(s.dest),
        )))
        self.awaiting_remote[(s.session_id, rnd)] = s
        self._notifs.arm()

    def local_prefill(self, session_id: str, rnd: int) -> None:
        s = self._session(session_id)
        if s.round != rnd or (session_id, rnd) not in self.awaiting_remote:
            raise SessionError(f"session {session_id!r} round {rnd} is not waiting for a prefill")
        del self.awaiting_remote[(session_id, rnd)]
        self.rt.queue.push(QueuedTask(session_id, rnd, s.l_hist, s.l_incr, s.input_ready))
        self.rt.changed()
        self.wake.set()

    def tool_result(self, session_id: str, call_id: str, input_tokens: int) -> None:
        s = self._session(session_id)
        if not s.pending_call or s.pending_call != call_id:
            raise SessionError(f"session {session_id!r} has no pending tool call {call_id!r}")
        s.pending_call = ""
        self.begin_round(s, s.round + 1, input_tokens, time.time())

    def cancel(self, session_id: str, reason: str) -> None:
        s = self.sessions.get(session_id)
        if s is not None:
            self.fail(s, f"cancelled: {reason}" if reason else "cancelled")

    def _session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise SessionError(f"session {session_id!r} is not open on this worker")
        return s

    def close(self, s: Session) -> None:
        """Frees everything the session holds on this worker."""
        if s.closed:
            return
        s.closed = True
        self.sessions.pop(s.session_id, None)
        self.awaiting_remote.pop((s.session_id, s.round), None)
        for lst in (self.batch, self.joining):
            if s in lst:
                lst.remove(s)
        s.kv.release(self.rt.pool)
        self.rt.active_sessions = len(self.sessions)
        self.rt.changed()

    def fail(self, s: Session, error: str) -> None:
        log.warning("session failed", session=s.session_id, error=error)
        self.metrics["sessions_failed"] += 1
        self.emit(s, SessionFailed(error))
        self.close(s)

    # --------------------------------------------------------------------------- round progress
    def first_token(self, s: Session, token: int, now: float, local: bool, worker: str) -> None:
        s.kv.commit(s.l_incr)
        s.dest = []
        s.position = s.kv.tokens
        s.last_token = token
        s.remaining = s.output_tokens() - 1
        t = s.timing
        t.first_token = t.last_token = now
        t.tokens = 1
        t.local = local
        t.prefill_worker = worker
        s.last_emit = now
        self.emit(s, decode_pb2.DecodeEvent(tokens=common_pb2.Tokens(
            round=s.round, position=s.position, token_ids=[token], times=[now])))
        self.metrics["tokens"] += 1
        if s.remaining <= 0:
            self.end_round(s, now)
        else:
            self.joining.append(s)
            self.wake.set()

    def end_round(self, s: Session, now: float) -> None:
        # The round's last token is consumed as if by the next forward pass, so the session's
        # history holds every input and output token (l_hist of the next round).
        try:
            segs = s.kv.reserve(self.rt.pool, 1)
        except KVPoolExhausted as exc:
            self.fail(s, f"KV exhausted on {self.rt.cfg.worker_id}: {exc}")
            return
        from ampd.kv import kv_pattern

        self.rt.pool.write(segs, kv_pattern(s.session_id, s.position, 1, self.rt.pool.layout.bytes_per_token))
        s.kv.commit(1)
        s.rounds_done.append(s.timing)
        self.emit(s, decode_pb2.DecodeEvent(round_end=common_pb2.RoundEnd(timing=s.timing)))
        if s.last_round():
            self.emit(s, decode_pb2.DecodeEvent(done=common_pb2.SessionDone(rounds=s.rounds_done)))
            self.metrics["sessions_completed"] += 1
            self.close(s)
            return
        tool = s.plan[s.round].tool
        call_id = f"{s.session_id}/{s.round}"
        self.emit(s, decode_pb2.DecodeEvent(tool_call=common_pb2.ToolCall(
            round=s.round, call_id=call_id, name=tool.name or "replay",
            arguments=tool.arguments, client_side=tool.client_side)))
        self.metrics["tool_calls"] += 1
        if tool.client_side:
            s.pending_call = call_id
        else:
            asyncio.create_task(self._run_tool(s, tool, s.plan[s.round + 1].input_tokens))

    async def _run_tool(self, s: Session, tool: common_pb2.ToolSpec, result_tokens: int) -> None:
        """Off the decode loop: the sidecar runs the tool; its result is the next round's input."""
        try:
            res = await self.sidecar.Call(sidecar_pb2.ToolCallRequest(
                session_id=s.session_id, round=s.round, name=tool.name or "replay",
                arguments=tool.arguments, latency_s=tool.latency_s, result_tokens=result_tokens))
        except Exception as exc:  # grpc.aio.AioRpcError and connection failures
            if not s.closed:
                self.fail(s, f"tool {tool.name or 'replay'!r} failed: {getattr(exc, 'details', lambda: exc)()}")
            return
        if not s.closed:
            self.begin_round(s, s.round + 1, res.result_tokens or result_tokens, time.time())

    # ------------------------------------------------------------------------------- the loop
    async def _loop(self) -> None:
        while True:
            if self.chunking is not None:
                # Chunked local prefill: one chunk, then one decode step for the waiting batch.
                await self._run_chunk()
                if self.batch or self.joining:
                    await self._step()
            elif len(self.rt.queue):
                await self._run_local_prefill()
            elif self.batch or self.joining:
                await self._step()
            else:
                self.wake.clear()
                await self.wake.wait()

    async def _run_local_prefill(self) -> None:
        task = self.rt.queue.pop(time.time())
        self.rt.changed()
        s = self.sessions.get(task.session_id)
        if s is None or s.round != task.round:
            return  # the session ended while queued
        if self.chunk_tokens and s.l_incr > self.chunk_tokens:
            self.chunking = [s, 0]
            return
        if self.cost is not None:
            self.rt.busy_until = time.time() + self.cost.t_pre(self.rt.cfg.tp, s.l_hist, s.l_incr)
            self.rt.changed()
        try:
            token = await self.engine.prefill(s.session_id, s.l_hist, s.l_incr, self.rt.pool, s.dest)
        finally:
            self.rt.busy_until = 0.0
        if s.closed:
            return
        self.metrics["prefills_local"] += 1
        self.first_token(s, token, time.time(), True, self.rt.cfg.worker_id)

    async def _run_chunk(self) -> None:
        s, done = self.chunking
        if s.closed:
            self.chunking = None
            return
        n = min(self.chunk_tokens, s.l_incr - done)
        start = s.l_hist + done
        token = await self.engine.prefill(s.session_id, start, n, self.rt.pool, s.kv.segments(start, n))
        done += n
        self.metrics["prefill_chunks"] += 1
        if done < s.l_incr:
            self.chunking[1] = done
            return
        self.chunking = None
        if not s.closed:
            self.metrics["prefills_local"] += 1
            self.first_token(s, token, time.time(), True, self.rt.cfg.worker_id)

    async def _step(self) -> None:
        if self.joining:
            self.batch.extend(self.joining)
            self.joining.clear()
        batch = list(self.batch)
        seqs = []
        for s in batch:
            try:
                segs = s.kv.reserve(self.rt.pool, 1)
            except KVPoolExhausted as exc:
                self.fail(s, f"KV exhausted on {self.rt.cfg.worker_id}: {exc}")
                continue
            seqs.append((s, DecodeSeq(s.session_id, s.position, s.last_token, segs, s.position + 1)))
        if not seqs:
            return
        tokens = await self.engine.decode_step(self.rt.pool, [d for _, d in seqs])
        now = time.time()
        gaps = 0.0
        live = 0
        for (s, _), tok in zip(seqs, tokens):
            if s.closed:
                continue
            s.kv.commit(1)
            s.position += 1
            s.last_token = tok
            gaps += now - s.last_emit
            live += 1
            s.last_emit = now
            s.remaining -= 1
            t = s.timing
            t.last_token = now
            t.tokens += 1
            self.emit(s, decode_pb2.DecodeEvent(tokens=common_pb2.Tokens(
                round=s.round, position=s.position, token_ids=[tok], times=[now])))
            if s.remaining <= 0:
                self.batch.remove(s)
                self.end_round(s, now)
        if live:
            self.rt.window.add(now, gaps / live, live)
        self.metrics["decode_steps"] += 1
        self.metrics["tokens"] += live
        self.rt.changed()

    # ------------------------------------------------------------------------- remote prefills
    def _on_prefill_done(self, msg: bytes) -> None:
        done = prefill_pb2.PrefillDone()
        try:
            done.ParseFromString(msg)
        except Exception:
            log.warning("unparseable NIXL notification", size=len(msg))
            return
        s = self.awaiting_remote.pop((done.session_id, done.round), None)
        if s is None:
            log.warning("prefill done for an unknown session", session=done.session_id, round=done.round)
            return
        if done.error:
            self.fail(s, f"remote prefill on {done.prefill_worker} failed: {done.error}")
            return
        data = self.rt.pool.read(s.dest)
        bad = verify_pattern(s.session_id, s.l_hist, data, self.rt.pool.layout.bytes_per_token)
        self.metrics["kv_bytes_verified"] += data.size
        self.metrics["kv_bytes_mismatched"] += bad
        if bad:
            self.fail(s, f"KV written by {done.prefill_worker} has {bad} wrong bytes")
            return
        self.metrics["prefills_remote"] += 1
        self.first_token(s, done.first_token, time.time(), False, done.prefill_worker)


class SessionFailed:
    """Queue sentinel: the Attach stream ends with this error."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error

