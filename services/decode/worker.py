"""Decode worker service: drives the pure decode core (``ampd.worker.DecodeCore``) with the engine,
the KV pool, NIXL notifications, the session streams (gRPC) and the tool sidecar.

The core decides: KV admission (``kv_admission``), what runs next (a local prefill or one chunk of
it, or decode steps; prefill has priority), the local queue (Algorithm 2), the windowed ITL and the
published view. This module does the I/O and runs what the core says. A decode run is executed one
step at a time (each reported with ``DecodeCore.update`` at its measured end), so work that
arrives during a step is seen at the next ``schedule``: the run is cut there. See
docs/architecture.md "Timing semantics".

KV: the pool holds what the core charges, in blocks, and reserves each decode token's slot one
step late (when the step that writes its KV runs). Before each admission decision and each view the
core's capacity is set to what it has charged plus the pool's free tokens, so the core admits by the
pool's real free space. What the core lets through over capacity (its no-deadlock rule) and a
decode token the pool cannot hold fail the session ("KV exhausted"): a real pool does not overcommit.

The worker (this module) owns the sessions and their rounds (admission, routing, the round's end);
its collaborators own the rest: ``EngineLoop`` (engine_loop.py) runs what the core schedules,
``RemotePrefills`` (remote.py) the prefills on prefill workers and their NIXL notifications,
``ToolCalls`` (tools.py) the server-side tool calls, and session.py holds a session's I/O state and
event log.
"""
from __future__ import annotations

import time
from collections import deque

import structlog

from ampd import tracing
from ampd.agenthints import turn_queue_yield_s
from ampd.chat.stops import StopChecker
from ampd.chat.template import ChatFormat
from ampd.chat.toolcalls import parse_tool_calls
from ampd.engine.base import Engine
from ampd.kv import KVPoolExhausted
from ampd.policy import PrefillTask
from ampd.policy.prefixbind import prefix_seed
from ampd.runtime import WorkerRuntime, sampling_of
from ampd.validate import MAX_ROUNDS
from ampd.v1 import common_pb2, decode_pb2
from ampd.worker import ADMITTED, FAILED, DecodeCore, DecodeSession
from services.decode.engine_loop import EngineLoop
from services.decode.prefix import LivePrefix
from services.decode.prefixpub import PrefixPublisher
from services.decode.kv import KvSync
from services.decode.kvwhere import fetch_first, route_holds, turn_end
from services.decode.remote import RemotePrefills
from services.decode.session import (ABORTED, FINISH_LENGTH, FINISH_STOP, FINISH_STOP_REQUESTED,
                                     FINISH_TOOL, SHUTDOWN, EventsGone, InvalidTurn, NotOpen, NotPermitted, Session,
                                     SessionError, SessionFailed, check_secret, check_turn, emit, keep_ended,
                                     made_before_move, round_spans)
from services.decode.streamed import continue_remote_round, streams_rounds
from services.decode.streams import Attachments
from services.decode.tier import LiveTier, pause
from services.decode.tools import ToolCalls

__all__ = ["DecodeWorker", "Session", "SessionFailed", "SessionError", "InvalidTurn", "NotPermitted", "NotOpen",
           "EventsGone", "FINISH_STOP"]

log = structlog.get_logger()

# the worker's counters (its metrics reply)
METRICS = ("sessions_opened", "sessions_completed", "sessions_failed", "prefills_local", "prefills_remote",
           "decode_steps", "tokens", "kv_bytes_verified", "kv_bytes_mismatched", "tool_calls", "prefill_chunks",
           "kv_waits", "prefills_rerouted", "local_prefill_tokens", "sessions_resumed", "kv_held_for_remote",
           "kv_evictions", "kv_recomputed_tokens", "prefills_overdue", "sessions_detached", "sessions_reattached",
           "sessions_replaced", "prefix_shared_tokens")


class DecodeWorker:
    def __init__(self, rt: WorkerRuntime, engine: Engine, core: DecodeCore, sidecar_stub=None,
                 chat: ChatFormat | None = None) -> None:
        self.rt = rt
        self.stopping = False  # set by stop(), before it ends the sessions
        self.engine = engine
        self.chat = chat  # text: stop strings and tool calls in the output (an engine with a tokenizer)
        if not core.step_by_step:
            raise ValueError("a live decode worker runs its core step by step (DecodeCore(step_by_step=True))")
        self.core = core
        self.sessions: dict[str, Session] = {}
        # sessions ended in the last reattach_grace seconds: a reattach still finds their last events
        self.ended: dict[str, Session] = {}
        self.reattach_grace_s = 30.0  # the server sets --reattach-grace
        self.metrics: dict[str, float] = dict.fromkeys(METRICS, 0)
        caps = engine.capabilities  # ampd.engine.capabilities
        # An engine that attends to the history in the pool (torch) is given where it lies; the others none.
        self.history_kv = caps.reads_history_kv
        # An engine that keeps the KV itself (sglang) needs every session's token ids instead.
        self.token_ids = caps.needs_token_ids
        # An engine that keeps a decoding round's KV beside the pool (torch) drops it when the round
        # ends: what a later prefill writes into the pool is then read from there.
        self.round_kv = caps.keeps_round_kv
        # An engine that decodes each round as one request of its own (services/decode/streamed.py).
        self.streams = streams_rounds(engine)
        # its collaborators: the engine loop, the remote prefills, the server-side tool calls
        self.loop = EngineLoop(self)
        self.kv = KvSync(self)
        self.attachments = Attachments(self)
        self.remote = RemotePrefills(self)
        self.tools = ToolCalls(self, sidecar_stub)
        self.tier = LiveTier(self, core.tier.host.num_blocks) if core.tier is not None else None  # --kv-host-mb
        self.prefix = LivePrefix(self, rt.cfg.prefix_sharing, prefix_seed(rt.cfg.model))  # --prefix-sharing
        if rt.cfg.prefix_sharing:  # the blocks it holds, published for the coordinators' binding
            rt.prefix_seed = self.prefix.index.seed
            rt.loops.append(PrefixPublisher(rt, self.prefix.index).run)
        rt.published = self.kv.published
        rt.on_fenced = self.fenced

    # ---------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self.loop.start()
        self.remote.start()

    async def stop(self) -> None:
        """Ends every session with UNAVAILABLE "worker shutting down": the coordinator moves each to
        another decode worker (as after a crash), within its migration limit."""
        self.stopping = True
        await self.loop.stop()
        await self.tools.stop()
        await self.remote.stop()
        for s in list(self.sessions.values()):
            self.fail(s, f"decode worker {self.rt.cfg.worker_id} shutting down", SHUTDOWN)

    async def fenced(self) -> None:
        """A coordinator fenced this worker out while it was stopped (``WorkerRuntime.on_fenced``): it
        moved or failed every session here, so each ends now (UNAVAILABLE: one whose stream is still
        attached moves) and frees its KV, before the worker registers anew. Blocks that a prefill
        worker may still write stay held until its notification, at most ``RemotePrefills.wait_s``."""
        why = f"decode worker {self.rt.cfg.worker_id} was fenced out (not heard from for {self.rt.cfg.fence_after_s:g} s)"
        for s in list(self.sessions.values()):
            self.fail(s, why, SHUTDOWN)
        self.remote.fenced()

    # ----------------------------------------------------------------------------- session events
    def open(self, req: decode_pb2.AttachRequest) -> Session:
        o = req.open
        old = self.sessions.get(o.session_id)
        if old is not None:
            if old.owner is not None:
                raise SessionError(f"session {o.session_id!r} is already open on this worker")
            # Left here by a lost coordinator and opened again (its client could not reattach it):
            # the open, with its attach token, replaces it.
            self.metrics["sessions_replaced"] += 1
            self.fail(old, "opened again through another coordinator")
        check_turn(o.turn, self.engine, 0, "open.turn", self.chat is not None, made_before_move(req))
        s = Session(
            session_id=o.session_id,
            max_rounds=o.limits.max_rounds or MAX_ROUNDS,  # a tool loop ends some time
            max_output=o.limits.max_output_tokens,
            kv=self.prefix.new_kv(o.session_id),
            core=DecodeSession(o.session_id),
            secret=req.session_secret,
            seq=req.first_seq, sent=req.first_seq, limits=o.limits, turns=1,
            prefix_scope=o.prefix_scope, scoped_seed=self.prefix.seed_of(o.prefix_scope),
        )
        self.ended.pop(s.session_id, None)
        self.sessions[s.session_id] = s
        self.rt.active_sessions = len(self.sessions)
        self.metrics["sessions_opened"] += 1
        try:
            if req.HasField("resume"):
                self._resume(s, o.turn, req.resume)
            else:
                self._start_turn(s, o.turn, req.arrival or time.time(), req.route if req.HasField("route") else None)
        except BaseException:
            self.close(s)  # nothing of a session that did not open stays behind
            raise
        return s

    def _resume(self, s: Session, t: common_pb2.Turn, r: decode_pb2.Resume) -> None:
        """A session moved here from a lost decode worker: ``t`` holds its whole history (prefilled
        here again) and the rest of its turn; its rounds keep their numbers (docs/deploy.md)."""
        log.info("session moved here", session=s.session_id, round=r.round, attempt=r.attempt,
                 history=len(t.token_ids), rerun_tools=r.rerun_tools)
        self.metrics["sessions_resumed"] += 1
        s.next_round, s.recovering, s.moves = r.round, True, r.attempt
        s.turns = r.turns or 1
        if not r.rerun_tools:
            s.carried = r.round_tokens
            self._start_turn(s, t, time.time())
            return
        self.tools.rerun(s, t, r)

    def turn(self, session_id: str, t: common_pb2.Turn, secret: str, route: decode_pb2.Route | None = None) -> None:
        """The client's next turn (after the previous one ended), with the coordinator's route for
        its first round if it decided one (decode.proto Route)."""
        s = self._session(session_id, secret)
        check_turn(t, self.engine, len(s.tokens), "turn", self.chat is not None)
        if s.turn is not None or s.closing:
            raise SessionError(f"session {session_id!r} is still answering its previous turn")
        if t.tool_call_id and t.tool_call_id not in s.pending_calls:
            raise InvalidTurn(f"turn.tool_call_id: {t.tool_call_id!r} is not a pending call of the session "
                              f"({len(s.pending_calls)} pending)")
        s.pending_calls.clear()
        if self.tier is not None:
            self.tier.resumed(s)
        s.turns += 1
        self._start_turn(s, t, time.time(), route)

    def _start_turn(self, s: Session, t: common_pb2.Turn, now: float, route: decode_pb2.Route | None = None) -> None:
        if t.HasField("keep_tokens") and t.keep_tokens < len(s.tokens):
            del s.tokens[t.keep_tokens:]
            if s.kv.tokens > t.keep_tokens:
                s.kv.truncate(self.rt.pool, t.keep_tokens)
            self.core.rewind(s.core, t.keep_tokens)
            self.prefix.rewound(s, t.keep_tokens)
        s.turn = t
        s.script = deque(t.script)
        s.turn_round, s.round_begun = s.next_round, -1
        s.stop_requested = False
        s.tokens.extend(t.token_ids)
        # the route holds only while the round starts now (its KV admitted at once, in begin_round)
        s.route = route
        try:
            self.begin_round(s, t.sampling, len(t.token_ids), now)
        finally:
            s.route = None

    def begin_round(self, s: Session, params: common_pb2.SamplingParams, new: int, input_ready: float) -> None:
        """The round's input is ready (``new`` tokens appended to ``s.tokens``): the core admits its KV
        now, later (it waits) or never."""
        if s.max_rounds and s.next_round >= s.max_rounds:
            self.fail(s, f"limits.max_rounds: the session reached its {s.max_rounds} rounds")
            return
        s.params, s.sampling = params, sampling_of(params)
        if self.chat is not None:
            tok = self.chat.tokenizer
            s.stops = StopChecker(s.max_tokens(), lambda ids: tok.decode(ids, skip_special_tokens=False),
                                  self.engine.eos_token_ids, params.stop_token_ids, params.stop, params.ignore_eos)
        c = s.core
        # The core counts the round's new tokens; the prefill also computes the previous round's
        # last output token, which the core already counted in the history. A session that moved
        # here has no history in the core yet: its whole history is new.
        new -= self.prefix.share(s)  # --prefix-sharing: KV there already, the round's history
        if s.recovering:
            new = len(s.tokens) - s.kv.tokens
        c.round, c.l_incr, c.out = s.next_round, new, s.max_tokens()
        s.round_begun, s.round_ended, s.server_calls, s.unrouted = s.next_round, False, [], None
        s.next_round += 1
        s.input_ready = input_ready
        bt = self.rt.pool.block_tokens
        self.kv.sync(room=len(s.kv.blocks) * bt - s.kv.tokens)
        r = self.core.round_ready(c, time.time())
        evicted = self.kv.free_evicted()
        if r == FAILED:
            self.fail(s, c.error)
        elif r == ADMITTED:
            self.start_round(s)
        else:
            self.metrics["kv_waits"] += 1
            self.rt.changed()
            if evicted:  # the core counts a dropped pinned prefix free only by the pool's count
                self.kv.admit_waiting()

    def start_round(self, s: Session) -> None:
        """The round's KV is admitted (its host tier moves done): reserve it, route the prefill."""
        if self.tier is not None and self.tier.defer(s):
            return
        rnd = s.round
        hr = self.tier.reads.get(s) if self.tier is not None else None  # its KV reserved from host (hostread.py)
        s.l_hist = s.kv.tokens if hr is None else hr.l_hist
        s.l_incr = len(s.tokens) - s.l_hist
        s.prefilled = 0
        if self.core.kv_evict and hr is None:
            self.kv.room_for(s)
        try:
            s.dest = s.kv.reserve(self.rt.pool, s.l_incr) if hr is None else hr.dest
        except KVPoolExhausted as exc:
            self.fail(s, f"KV exhausted on {self.rt.cfg.worker_id}: {exc}")
            return
        self.rt.changed()
        s.timing = common_pb2.RoundTiming(round=rnd, input_ready=s.input_ready, l_hist=s.l_hist, l_incr=s.l_incr,
                                          recovered=s.recovering, kv_recomputed_tokens=s.recompute,
                                          prefix_shared_tokens=s.shared_tokens)
        self.metrics["kv_recomputed_tokens"] += s.recompute
        s.recovering, s.recompute = False, 0
        if tracing.on:
            s.admitted_at, s.prefill_at = time.time(), 0.0
        routed = route_holds(s, fetch_first(self, s))  # for the round's sizes and its KV's location
        if routed and not s.route.prefill_worker:  # the coordinator's local route holds
            self.queue_local(s)
            return
        self.remote.send(s, rnd, routed)

    def local_prefill(self, session_id: str, rnd: int, secret: str) -> None:
        self.remote.run_here(self._session(session_id, secret), rnd)

    def remote_prefill(self, session_id: str, rnd: int, secret: str, target: str) -> None:
        self.remote.routed(self._session(session_id, secret), rnd, target)

    def queue_local(self, s: Session) -> None:
        """The round's prefill runs here: it joins the core's local queue (once its history is back
        from host: hostread.py)."""
        if self.tier is not None and self.tier.reads.local(s):
            return
        c = s.core
        # TTFT counts from the real input; a yielding turn's hint only orders the queue later
        self.core.submit_local(PrefillTask(s.session_id, c.round, c.l_hist, c.l_incr, s.input_ready,
                                           self.rt.cfg.worker_id, self.rt.cfg.tp,
                                           queue_yield_s=turn_queue_yield_s(s.turn)))
        self.rt.took(s.session_id, c.round)
        self.loop.wake.set()

    def cancel(self, session_id: str, reason: str, secret: str) -> None:
        """Ends the session now, its prefill, KV and queue slots freed (one already gone is no error)."""
        s = self.sessions.get(session_id)
        if s is not None:
            check_secret(s, secret)
            self.fail(s, f"cancelled: {reason}" if reason else "cancelled")

    def stop_round(self, session_id: str, secret: str) -> None:
        """StopRound: the turn ends at its next token as if at max_tokens (no tool call); between turns, nothing."""
        s = self._session(session_id, secret)
        if s.turn is not None:
            s.stop_requested = True

    def close_session(self, session_id: str, secret: str) -> None:
        """Close: the session ends once its current turn (if any) is answered."""
        s = self._session(session_id, secret)
        s.closing = True
        if s.turn is None:
            self._done(s)

    def _done(self, s: Session) -> None:
        emit(s, decode_pb2.DecodeEvent(done=common_pb2.SessionDone(rounds=s.rounds_done)))
        self.metrics["sessions_completed"] += 1
        self.close(s)

    def _session(self, session_id: str, secret: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise NotOpen(f"session_id: {session_id!r} is not open on this worker")
        check_secret(s, secret)
        return s

    def close(self, s: Session) -> None:
        """Frees everything the session holds on this worker (in the core once no step holds it)."""
        if s.closed:
            return
        s.closed = True
        if self.sessions.get(s.session_id) is s:
            del self.sessions[s.session_id]
        keep_ended(self.ended, s, self.reattach_grace_s)
        remote = self.remote.take(s.session_id, s.round) is not None
        self.loop.forget(s)
        moving = self.tier is not None and self.tier.close(s)
        # its blocks: freed by its local prefill, held for a prefill worker or a host tier move, or now
        if not self.loop.cancel_prefill(s) and not self.remote.hold(s, remote) and not moving:
            s.kv.release(self.rt.pool)
        if self.token_ids or self.round_kv:
            self.engine.forget(s.session_id)
        self.rt.active_sessions = len(self.sessions)
        self.rt.changed()
        if not self.loop.stepping:
            self.kv.admit_waiting()

    def fail(self, s: Session, error: str, code: str = ABORTED) -> None:
        if s.closed:
            return
        log.warning("session failed", session=s.session_id, error=error)
        self.metrics["sessions_failed"] += 1
        emit(s, SessionFailed(error, code))
        self.close(s)

    # --------------------------------------------------------------------------- round progress
    def first_token(self, s: Session, token: int, now: float, local: bool, worker: str) -> None:
        s.kv.commit(s.l_incr)
        s.dest = []
        self.prefix.published(s)  # --prefix-sharing: its prompt blocks may be shared from now on
        s.out_start = len(s.tokens)
        s.tokens.append(token)
        t = s.timing
        t.first_token = t.last_token = now
        t.tokens = 1
        t.local = local
        t.prefill_worker = worker
        emit(s, decode_pb2.DecodeEvent(tokens=common_pb2.Tokens(
            round=s.round, position=s.out_start, token_ids=[token], times=[now])))
        self.metrics["tokens"] += 1
        reason = s.finish(token, self.engine)
        if not reason and self.streams and not local:
            continue_remote_round(s, self.engine)
        if self.core.first_token(s.core, now, last=bool(reason)):  # a reason: the round ends with it
            self.loop.wake.set()  # it joins the batch at the next step
        else:
            self.end_round(s, now, reason or FINISH_LENGTH)

    def end_round(self, s: Session, now: float, reason: str) -> None:
        """The round's last token is made. What follows: a server-side tool's result (the next round
        of the turn), or the end of the turn (a client-side call, or the answer is complete). The
        calls are the turn's scripted ones, else those parsed from the output (engines with text)."""
        self.core.round_end(s.core, False)
        if self.round_kv:
            self.engine.forget(s.session_id)
        if self.streams:
            self.engine.end_round(s.session_id)  # where it still runs (the worker stopped first)
        s.carried = 0
        if reason == FINISH_STOP_REQUESTED:
            s.script.clear()  # the turn ends here: no tool call, no later round
        scripted = s.script.popleft() if s.script else None
        parsed = parse_tool_calls(s.stops.text)[1] if scripted is None and s.stops is not None \
            and reason != FINISH_STOP_REQUESTED else []
        # idle until its next round (a tool result, or the next turn): its KV may go, or move to host
        pause(self, s, scripted, parsed)
        if scripted is not None or parsed:
            reason = FINISH_TOOL
        s.timing.finish_reason = reason
        s.round_ended = True
        s.rounds_done.append(s.timing)
        if tracing.on:
            round_spans(s, self.rt.cfg.worker_id)
        emit(s, decode_pb2.DecodeEvent(round_end=common_pb2.RoundEnd(timing=s.timing)))
        if self.tools.announce(s, scripted, parsed):
            return  # the server-side calls run: their results begin the turn's next round
        s.turn = None
        emit(s, decode_pb2.DecodeEvent(turn_end=turn_end(self, s, reason)))  # with where its KV went
        if s.closing:
            self._done(s)
