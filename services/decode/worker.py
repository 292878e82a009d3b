"""Decode worker service: drives the pure decode core (``ampd.worker.DecodeCore``) with the engine,
the KV pool, NIXL notifications, the session streams (gRPC) and the tool sidecar.

The core decides: KV admission (``kv_admission``), what runs next (a local prefill or one chunk of
it, or decode steps; prefill has priority), the local queue (Algorithm 2), the windowed ITL and the
published view. This module does the I/O and runs what the core says. A decode run is executed one
step at a time (each reported with ``DecodeCore.step_done`` at its measured end), so work that
arrives during a step is seen at the next ``schedule``: the run is cut there. See
docs/architecture.md "Timing semantics".

KV: the pool holds what the core charges, in blocks, and reserves each decode token's slot one
step late (when the step that writes its KV runs). Before each admission decision and each view the
core's capacity is set to what it has charged plus the pool's free tokens, so the core admits by the
pool's real free space. What the core lets through over capacity (its no-deadlock rule) and a
decode token the pool cannot hold fail the session ("KV exhausted"): a real pool does not overcommit.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import structlog

from ampd.engine.base import DecodeSeq, Engine
from ampd.kv import KVPoolExhausted, Segment, SessionKV, kv_pattern, verify_pattern
from ampd.policy import PrefillTask, WorkerView
from ampd.runtime import WorkerRuntime
from ampd.v1 import common_pb2, decode_pb2, prefill_pb2, sidecar_pb2
from ampd.worker import ADMITTED, FAILED, PREFILLING, DecodeCore, DecodeSession, LocalPrefill

log = structlog.get_logger()


class SessionError(Exception):
    """Ends one session with an error event; the worker keeps serving the others."""


def seg_pb(segments: list[Segment]) -> list[common_pb2.Segment]:
    return [common_pb2.Segment(block=s.block, offset=s.offset, tokens=s.tokens) for s in segments]


@dataclass(eq=False)
class Session:
    """The I/O side of one session: its plan, KV blocks, event stream and round timing. The core's
    ``DecodeSession`` (``core``) holds its scheduling state."""

    session_id: str
    plan: list[common_pb2.RoundPlan]
    max_rounds: int
    max_output: int
    kv: SessionKV
    core: DecodeSession
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    l_hist: int = 0
    input_ready: float = 0.0
    dest: list[Segment] = field(default_factory=list)
    prefilled: int = 0  # input tokens of the round prefilled here so far (chunks)
    last_token: int = 0
    position: int = 0  # position of last_token (its KV not written yet)
    timing: common_pb2.RoundTiming | None = None
    rounds_done: list[common_pb2.RoundTiming] = field(default_factory=list)
    pending_call: str = ""
    closed: bool = False

    @property
    def round(self) -> int:
        return self.core.round

    def output_tokens(self, rnd: int) -> int:
        n = self.plan[rnd].output_tokens
        return min(n, self.max_output) if self.max_output else n

    def last_round(self) -> bool:
        return self.round + 1 >= len(self.plan) or (self.max_rounds and self.round + 1 >= self.max_rounds)


class DecodeWorker:
    def __init__(self, rt: WorkerRuntime, engine: Engine, core: DecodeCore, sidecar_stub=None) -> None:
        self.rt = rt
        self.engine = engine
        self.core = core
        self.sidecar = sidecar_stub
        self.sessions: dict[str, Session] = {}
        self.awaiting_remote: dict[tuple[str, int], Session] = {}
        self.wake = asyncio.Event()
        self._stepping = False  # a decode step is in flight: the core forgets sessions after it
        self._after_step: list[tuple[Session, str]] = []  # (session, error) to end after the step
        self.metrics: dict[str, float] = {
            "sessions_opened": 0, "sessions_completed": 0, "sessions_failed": 0,
            "prefills_local": 0, "prefills_remote": 0, "decode_steps": 0, "tokens": 0,
            "kv_bytes_verified": 0, "kv_bytes_mismatched": 0, "tool_calls": 0, "prefill_chunks": 0,
            "kv_waits": 0,
        }
        self._tasks: list[asyncio.Task] = []
        rt.published = self.published

    # ---------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._loop(), name="decode-loop"))
        self._notifs = self.rt.transport.listen(lambda _peer, msg: self._on_prefill_done(msg),
                                                pending=lambda: bool(self.awaiting_remote))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._stepping = False
        await self._notifs.stop()
        for s in list(self.sessions.values()):
            self.fail(s, "worker shutting down")

    # ------------------------------------------------------------------------------------ KV / view
    def _sync_kv(self, room: int = 0) -> None:
        """The core admits by the pool's free space (``room``: what the deciding session's partial
        last block still holds)."""
        self.core.kv_cap = self.core.kv_used + self.rt.pool.free_tokens + room

    def published(self, now: float) -> tuple[WorkerView, float]:
        self._sync_kv()
        core = self.core
        return core.view(now), (core.busy_until if core.state == PREFILLING else 0.0)

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
            core=DecodeSession(o.session_id),
        )
        self.sessions[s.session_id] = s
        self.rt.active_sessions = len(self.sessions)
        self.metrics["sessions_opened"] += 1
        self.begin_round(s, 0, s.plan[0].input_tokens, req.arrival or time.time())
        return s

    def begin_round(self, s: Session, rnd: int, l_incr: int, input_ready: float) -> None:
        """The round's input is ready: the core admits its KV now, later (it waits) or never."""
        c = s.core
        c.round, c.l_incr, c.out = rnd, l_incr, s.output_tokens(rnd)
        s.input_ready = input_ready
        bt = self.rt.pool.block_tokens
        self._sync_kv(room=len(s.kv.blocks) * bt - s.kv.tokens)
        r = self.core.round_ready(c, time.time())
        if r == FAILED:
            self.fail(s, c.error)
        elif r == ADMITTED:
            self._start_round(s)
        else:
            self.metrics["kv_waits"] += 1
            self.rt.changed()

    def _start_round(self, s: Session) -> None:
        """The round's KV is admitted: reserve it and ask the coordinator to route the prefill."""
        rnd, l_incr = s.round, s.core.l_incr
        s.l_hist = s.kv.tokens
        s.prefilled = 0
        try:
            s.dest = s.kv.reserve(self.rt.pool, l_incr)
        except KVPoolExhausted as exc:
            self.fail(s, f"KV exhausted on {self.rt.cfg.worker_id}: {exc}")
            return
        self.rt.changed()
        s.timing = common_pb2.RoundTiming(round=rnd, input_ready=s.input_ready, l_hist=s.l_hist, l_incr=l_incr)
        self.emit(s, decode_pb2.DecodeEvent(prefill_task=common_pb2.PrefillTask(
            session_id=s.session_id, round=rnd, l_hist=s.l_hist, l_incr=l_incr, input_ready=s.input_ready,
            decode_worker=self.rt.cfg.worker_id, decode_tp=self.rt.cfg.tp,
            history=seg_pb(s.kv.segments(0, s.l_hist)), dest=seg_pb(s.dest),
        )))
        self.awaiting_remote[(s.session_id, rnd)] = s
        self._notifs.arm()

    def _admit_waiting(self) -> None:
        """KV freed: start the waiting rounds that fit now, in the core's order."""
        while True:
            self._sync_kv()
            c = self.core.admit_next(time.time())
            if c is None:
                return
            self._start_round(self.sessions[c.session_id])

    def local_prefill(self, session_id: str, rnd: int) -> None:
        s = self._session(session_id)
        if s.round != rnd or (session_id, rnd) not in self.awaiting_remote:
            raise SessionError(f"session {session_id!r} round {rnd} is not waiting for a prefill")
        del self.awaiting_remote[(session_id, rnd)]
        c = s.core
        self.core.submit_local(PrefillTask(session_id, rnd, c.l_hist, c.l_incr, s.input_ready,
                                           self.rt.cfg.worker_id, self.rt.cfg.tp))
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
        """Frees everything the session holds on this worker (in the core once no step holds it)."""
        if s.closed:
            return
        s.closed = True
        self.sessions.pop(s.session_id, None)
        self.awaiting_remote.pop((s.session_id, s.round), None)
        if self._stepping:
            self._after_step.append((s, ""))
        else:
            self.core.drop(s.core)
        s.kv.release(self.rt.pool)
        self.rt.active_sessions = len(self.sessions)
        self.rt.changed()
        if not self._stepping:
            self._admit_waiting()

    def fail(self, s: Session, error: str) -> None:
        if s.closed:
            return
        log.warning("session failed", session=s.session_id, error=error)
        self.metrics["sessions_failed"] += 1
        self.emit(s, SessionFailed(error))
        self.close(s)

    # --------------------------------------------------------------------------- round progress
    def first_token(self, s: Session, token: int, now: float, local: bool, worker: str) -> None:
        s.kv.commit(s.core.l_incr)
        s.dest = []
        s.position = s.kv.tokens
        s.last_token = token
        t = s.timing
        t.first_token = t.last_token = now
        t.tokens = 1
        t.local = local
        t.prefill_worker = worker
        self.emit(s, decode_pb2.DecodeEvent(tokens=common_pb2.Tokens(
            round=s.round, position=s.position, token_ids=[token], times=[now])))
        self.metrics["tokens"] += 1
        if self.core.first_token(s.core, now):
            self.wake.set()  # it joins the batch at the next step
        else:
            self.end_round(s, now)

    def end_round(self, s: Session, now: float) -> None:
        last = s.last_round()
        self.core.round_end(s.core, last)
        if not last:
            self.core.tool_call(s.core)
        # The round's last token is consumed as if by the next forward pass, so the session's
        # history holds every input and output token (l_hist of the next round).
        try:
            segs = s.kv.reserve(self.rt.pool, 1)
        except KVPoolExhausted as exc:
            self.fail(s, f"KV exhausted on {self.rt.cfg.worker_id}: {exc}")
            return
        self.rt.pool.write(segs, kv_pattern(s.session_id, s.position, 1, self.rt.pool.layout.bytes_per_token))
        s.kv.commit(1)
        s.rounds_done.append(s.timing)
        self.emit(s, decode_pb2.DecodeEvent(round_end=common_pb2.RoundEnd(timing=s.timing)))
        if last:
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
                detail = exc.details() if hasattr(exc, "details") else exc
                self.fail(s, f"tool {tool.name or 'replay'!r} failed: {detail}")
            return
        if not s.closed:
            self.begin_round(s, s.round + 1, res.result_tokens or result_tokens, time.time())

    # ------------------------------------------------------------------------------- the loop
    async def _loop(self) -> None:
        while True:
            work = self.core.schedule(time.time())
            if work is None:
                self.wake.clear()
                await self.wake.wait()
            elif isinstance(work, LocalPrefill):
                await self._prefill(work)
            else:
                self.core.cut(self.core.run_t0)  # a plan of one step: views count no step not run
                await self._step()

    async def _prefill(self, work: LocalPrefill) -> None:
        """One local prefill, or one chunk of it (the core chose it)."""
        s = self.sessions.get(work.session.session_id)
        if s is None or s.core is not work.session:  # cannot happen: drop() unqueues a closed session
            self.core.prefill_done(time.time())
            return
        self.rt.changed()  # the queue and busy_until moved
        start = s.l_hist + s.prefilled
        chunk = not (work.last and s.prefilled == 0)
        segs = s.kv.segments(start, work.tokens) if chunk else s.dest
        token = await self.engine.prefill(s.session_id, start, work.tokens, self.rt.pool, segs)
        s.prefilled += work.tokens
        if chunk:
            self.metrics["prefill_chunks"] += 1
        done = self.core.prefill_done(time.time())
        self.rt.changed()
        if done is not None and not s.closed:
            self.metrics["prefills_local"] += 1
            self.first_token(s, token, time.time(), True, self.rt.cfg.worker_id)

    async def _step(self) -> None:
        """One decode step of the core's batch."""
        pool = self.rt.pool
        seqs = []
        for c in self.core.batch():
            s = self.sessions.get(c.session_id)
            if s is None:
                continue
            try:
                segs = s.kv.reserve(pool, 1)
            except KVPoolExhausted as exc:
                self._after_step.append((s, f"KV exhausted on {self.rt.cfg.worker_id}: {exc}"))
                continue
            seqs.append((s, DecodeSeq(s.session_id, s.position, s.last_token, segs, s.position + 1)))
        self._stepping = True
        try:
            tokens = await self.engine.decode_step(pool, [d for _, d in seqs]) if seqs else []
        finally:
            self._stepping = False
        now = time.time()
        ended = self.core.step_done(now)
        live = 0
        for (s, _), tok in zip(seqs, tokens):
            if s.closed:
                continue
            s.kv.commit(1)
            s.position += 1
            s.last_token = tok
            live += 1
            t = s.timing
            t.last_token = now
            t.tokens += 1
            self.emit(s, decode_pb2.DecodeEvent(tokens=common_pb2.Tokens(
                round=s.round, position=s.position, token_ids=[tok], times=[now])))
        # sessions closed or out of KV during the step: the core forgets them now
        after, self._after_step = self._after_step, []
        gone = {id(s.core) for s, _ in after}
        for c in ended:
            if id(c) in gone:
                self.core.round_end(c, True)  # its round ended with this step: its whole charge goes
                continue
            s = self.sessions.get(c.session_id)
            if s is not None and s.core is c:
                self.end_round(s, now)
        for s, error in after:
            if error:
                self.fail(s, error)
            else:
                self.core.drop(s.core)
        if after:
            self._admit_waiting()
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
