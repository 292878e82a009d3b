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
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import grpc
import structlog

from ampd import tracing
from ampd.chat.stops import StopChecker
from ampd.chat.template import ChatFormat
from ampd.chat.toolcalls import parse_tool_calls
from ampd.engine.base import GREEDY, DecodeSeq, Engine, Sampling
from ampd.kv import KVPoolExhausted, Segment, SessionKV, verify_pattern
from ampd.policy import PrefillTask, WorkerView
from ampd.grpcserver import RPC_TIMEOUT_S
from ampd.runtime import WorkerRuntime, sampling_of
from ampd.stubs import Stubs
from ampd.trust import new_call_id, task_token, token_matches
from ampd.validate import MAX_ROUNDS
from ampd.workload.ids import filler_ids
from ampd.v1 import common_pb2, decode_pb2, prefill_pb2, sidecar_pb2
from ampd.worker import ADMITTED, FAILED, PREFILLING, DecodeCore, DecodeRun, DecodeSession, LocalPrefill
from services.decode.streamed import continue_remote_round, stops_of, streams_rounds

log = structlog.get_logger()


class SessionError(Exception):
    """A request that does not fit the session's state (FAILED_PRECONDITION, or ALREADY_EXISTS)."""


class InvalidTurn(ValueError):
    """A bad turn field (INVALID_ARGUMENT); the message starts with the field's path."""


class NotPermitted(SessionError):
    """A request on a session without its session secret (PERMISSION_DENIED)."""


def add_segments(field, segments: list[Segment]) -> None:
    """Appends ``segments`` to a repeated Segment field (``add`` costs half of building each message)."""
    add = field.add
    for s in segments:
        add(block=s.block, offset=s.offset, tokens=s.tokens)


FINISH_STOP, FINISH_LENGTH, FINISH_TOOL = "stop", "length", "tool_calls"
FINISH_STOP_REQUESTED = "stop_requested"  # the client's StopRound ended the turn
# How long a session ended during its remote prefill keeps the round's blocks at most, waiting for
# the prefill worker to report it wrote them (it normally does within the round's TTFT).
REMOTE_HOLD_S = 60.0
ABORTED, SHUTDOWN = "ABORTED", "UNAVAILABLE"  # the status a failed session's Attach stream ends with
# A session keeps its events already sent, beyond those not yet sent, up to this many: a coordinator
# that reattaches it (Reattach) sends again those its client missed. One that missed more opens the
# session again (ampd/coordinators.py).
SENT_KEEP = 512
ENDED_KEEP = 16  # of an ended session, kept for reattach_grace: its last events (SessionDone) may be lost


class NotOpen(SessionError):
    """The session is not open on this worker (NOT_FOUND: the coordinator moves it, or opens it again)."""


class EventsGone(SessionError):
    """A reattach asked for events this worker no longer keeps (OUT_OF_RANGE)."""


@dataclass(eq=False)
class Session:
    """The I/O side of one session: its tokens, KV blocks, event stream, the turn it answers and the
    round's timing. The core's ``DecodeSession`` (``core``) holds its scheduling state."""

    session_id: str
    max_rounds: int
    max_output: int
    kv: SessionKV
    core: DecodeSession
    secret: str = ""  # the session's credential (AttachRequest.session_secret)
    task_token: str = ""  # the current round's prefill task's (ampd.trust)
    # Its events, numbered (DecodeEvent.seq): those no stream sent yet and the last SENT_KEEP sent,
    # so that a coordinator that reattaches it sends again what its client missed.
    log: deque = field(default_factory=deque)  # (seq, DecodeEvent or SessionFailed)
    seq: int = 0  # the last event's number
    sent: int = 0  # the last event's number a stream sent
    notify: asyncio.Event = field(default_factory=asyncio.Event)  # an event was added (or a stream took over)
    owner: object = None  # the stream that sends its events (None: none; its coordinator went away)
    attachments: int = 0  # streams it had (a detached session expires unless another came)
    # What a reattaching coordinator rebuilds its record of the session from (decode.proto SessionState)
    limits: common_pb2.SessionLimits | None = None
    turns: int = 0  # the client's turns received (the open's counts)
    turn_round: int = 0  # the first round of the turn being answered
    round_begun: int = -1  # its round in progress or last begun (-1: none yet)
    round_ended: bool = False
    server_calls: list = field(default_factory=list)  # the ended round's server-side calls, running
    unrouted: common_pb2.PrefillTask | None = None  # the round's prefill_task sent to the coordinator
    moves: int = 0
    # Every token of the session, inputs and outputs. The KV covers tokens[:kv.tokens]; the rest (the
    # last output token, then a turn's new input) is the next prefill's input.
    tokens: list[int] = field(default_factory=list)
    next_round: int = 0
    turn: common_pb2.Turn | None = None  # the turn being answered
    script: deque = field(default_factory=deque)  # its scripted calls still to come
    params: common_pb2.SamplingParams | None = None  # the current round's
    sampling: Sampling = GREEDY
    out_start: int = 0  # tokens index of the round's first output token
    input_ready: float = 0.0
    l_hist: int = 0  # KV tokens before the round's prefill
    l_incr: int = 0  # tokens the round's prefill computes
    dest: list[Segment] = field(default_factory=list)
    prefilled: int = 0  # tokens of the round prefilled here so far (chunks)
    timing: common_pb2.RoundTiming | None = None
    rounds_done: list[common_pb2.RoundTiming] = field(default_factory=list)
    pending_calls: set[str] = field(default_factory=set)  # client-side calls the next turn may answer
    stops: StopChecker | None = None  # the round's text and stop strings (engines with a tokenizer)
    recovering: bool = False  # moved here from a lost worker: its first round here is marked recovered
    carried: int = 0  # output tokens of the first round here that the lost worker already made
    recompute: int = 0  # KV tokens an eviction took (--kv-evict): the next round prefills them again
    route: decode_pb2.Route | None = None  # the coordinator's route for the round starting now
    # (session, round) and token of a remote prefill given up on (overdue) that may still write its
    # blocks: they are held when the session ends, as for a prefill in flight
    overdue: tuple[tuple[str, int], str] | None = None
    closing: bool = False  # Close received: end after the turn
    stop_requested: bool = False  # StopRound received: the turn ends at its next token
    closed: bool = False
    # for the round's spans (tracing on only): when its KV was admitted, when its local prefill began
    admitted_at: float = 0.0
    prefill_at: float = 0.0

    @property
    def round(self) -> int:
        return self.core.round

    def max_tokens(self) -> int:
        n = self.params.max_tokens
        return (min(n, self.max_output) if self.max_output else n) - self.carried

    def finish(self, tok: int, engine: Engine) -> str:
        """Why the round ends with ``tok`` (its latest output token), or "" to go on."""
        if self.stop_requested:
            return FINISH_STOP_REQUESTED
        if self.stops is not None:
            return self.stops.add(tok) or ""
        p = self.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in engine.eos_token_ids):
            return FINISH_STOP
        if len(self.tokens) - self.out_start >= self.max_tokens():
            return FINISH_LENGTH
        return ""


def check_turn(t: common_pb2.Turn, engine: Engine, history: int, path: str, text: bool = False) -> None:
    """What only the decode worker can check (its engine's vocabulary and context limit)."""
    if t.HasField("keep_tokens") and t.keep_tokens > history:
        raise InvalidTurn(f"{path}.keep_tokens: {t.keep_tokens} is beyond the session's {history} tokens")
    kept = t.keep_tokens if t.HasField("keep_tokens") else history
    if t.token_ids and max(t.token_ids[:]) >= engine.vocab_size:  # a list's max: 5x the loop's speed
        i, tok = next((i, tok) for i, tok in enumerate(t.token_ids) if tok >= engine.vocab_size)
        raise InvalidTurn(f"{path}.token_ids[{i}]: {tok} is outside the vocabulary [0, {engine.vocab_size})")
    ctx = kept + len(t.token_ids)
    if ctx > engine.max_context:
        raise InvalidTurn(f"{path}.token_ids: the context would be {ctx} tokens, over the model's limit of "
                          f"{engine.max_context}")
    if ctx + t.sampling.max_tokens > engine.max_context:
        raise InvalidTurn(f"{path}.sampling.max_tokens: {ctx} context tokens + {t.sampling.max_tokens} exceed "
                          f"the model's limit of {engine.max_context}")
    if t.sampling.stop and not text:
        raise InvalidTurn(f"{path}.sampling.stop: stop strings need an engine with a tokenizer "
                          f"({engine.name} has none); use stop_token_ids")


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
        self.sidecar = sidecar_stub
        self.sessions: dict[str, Session] = {}
        # sessions ended in the last reattach_grace seconds: a reattach still finds their last events
        self.ended: dict[str, Session] = {}
        self.reattach_grace_s = 30.0  # the server sets --reattach-grace
        self.awaiting_remote: dict[tuple[str, int], Session] = {}
        self.wake = asyncio.Event()
        self._stepping = False  # a decode step is in flight: the core forgets sessions after it
        self._after_step: list[tuple[Session, str]] = []  # (session, error) to end after the step
        # the local prefill (or chunk) the engine runs now: a cancel stops it (see close)
        self._prefilling: tuple[Session, asyncio.Future] | None = None
        # sessions ended while a prefill worker may still write their round's blocks: the blocks
        # stay reserved until its PrefillDone comes (or REMOTE_HOLD_S passes), so no other session
        # gets them meanwhile
        self._held: dict[tuple[str, int], Session] = {}
        self.metrics: dict[str, float] = {
            "sessions_opened": 0, "sessions_completed": 0, "sessions_failed": 0,
            "prefills_local": 0, "prefills_remote": 0, "decode_steps": 0, "tokens": 0,
            "kv_bytes_verified": 0, "kv_bytes_mismatched": 0, "tool_calls": 0, "prefill_chunks": 0,
            "kv_waits": 0, "prefills_rerouted": 0, "local_prefill_tokens": 0, "sessions_resumed": 0,
            "kv_held_for_remote": 0, "kv_evictions": 0, "kv_recomputed_tokens": 0,
            "prefills_overdue": 0, "sessions_detached": 0, "sessions_reattached": 0, "sessions_replaced": 0,
        }
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()  # submits of routed prefills in flight
        self.stubs = Stubs()  # to the prefill workers routed prefills go to
        # A real engine attends to the history in the pool; the mock needs none (and its KV is checkable).
        self._history_kv = engine.name != "mock"
        # An engine that keeps the KV itself (sglang) needs every session's token ids instead.
        self._token_ids = bool(getattr(engine, "needs_token_ids", False))
        # An engine that keeps a decoding round's KV beside the pool (torch) drops it when the round
        # ends: what a later prefill writes into the pool is then read from there.
        self._round_kv = bool(getattr(engine, "keeps_round_kv", False))
        # An engine that decodes each round as one request of its own (services/decode/streamed.py).
        self._streams = streams_rounds(engine)
        rt.published = self.published
        rt.on_fenced = self.fenced
        # how long a round waits for its remote prefill's notification (beyond the prefill's own
        # compute time) before it runs here instead
        self.remote_wait_s = 2 * rt.cfg.fence_after_s

    # ---------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._loop(), name="decode-loop"))
        self._notifs = self.rt.transport.listen(lambda _peer, msg: self._on_prefill_done(msg),
                                                pending=lambda: bool(self.awaiting_remote or self._held))

    async def stop(self) -> None:
        """Ends every session with UNAVAILABLE "worker shutting down": the coordinator moves each to
        another decode worker (as after a crash), within its migration limit."""
        self.stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._stepping = False
        await self._notifs.stop()
        for s in list(self.sessions.values()):
            self.fail(s, f"decode worker {self.rt.cfg.worker_id} shutting down", SHUTDOWN)

    async def fenced(self) -> None:
        """A coordinator fenced this worker out while it was stopped (``WorkerRuntime.on_fenced``): it
        moved or failed every session here, so each ends now (UNAVAILABLE: one whose stream is still
        attached moves) and frees its KV, before the worker registers anew. Blocks that a prefill
        worker may still write stay held until its notification, at most ``remote_wait_s``."""
        why = f"decode worker {self.rt.cfg.worker_id} was fenced out (not heard from for {self.rt.cfg.fence_after_s:g} s)"
        for s in list(self.sessions.values()):
            self.fail(s, why, SHUTDOWN)
        # A prefill worker that dropped this worker from its peers while it was out of the registry
        # cannot report on the blocks held for it (nor write them): they go after the remote wait,
        # not REMOTE_HOLD_S.
        loop = asyncio.get_running_loop()
        for key in list(self._held):
            loop.call_later(self.remote_wait_s, self._release_held, key)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------------------------ KV / view
    def _sync_kv(self, room: int = 0) -> None:
        """The core admits by the pool's free space (``room``: what the deciding session's partial
        last block still holds)."""
        self.core.sync_kv_free(self.rt.pool.free_tokens + room)

    def published(self, now: float) -> tuple[WorkerView, float]:
        self._sync_kv()
        core = self.core
        return core.view(now), (core.busy_until if core.state == PREFILLING else 0.0)

    # ----------------------------------------------------------------------------- session events
    def emit(self, s: Session, event) -> None:
        """Adds ``event`` (a DecodeEvent, or SessionFailed) to the session's log for its stream."""
        if s.closed:
            return
        s.seq += 1
        if type(event) is not SessionFailed:
            event.seq = s.seq
        log = s.log
        log.append((s.seq, event))
        if len(log) > SENT_KEEP and log[0][0] <= s.sent:
            log.popleft()
        s.notify.set()

    # ------------------------------------------------------------------------------- streams
    def take_events(self, s: Session, after: int) -> tuple[list, int, "SessionFailed | None"]:
        """The session's events after number ``after``, those ready together in one list (a
        round's consecutive Tokens merged into one; SessionDone last), the last one's number, and
        the failure that ends the stream after them if there is one."""
        log = s.log
        if not log or log[-1][0] <= after:
            return [], after, None
        out: list = []
        copied = False
        for seq, ev in itertools.islice(log, max(0, after - log[0][0] + 1), None):
            if type(ev) is SessionFailed:
                return out, seq, ev
            last = out[-1] if out else None
            if last is not None and ev.HasField("tokens") and last.HasField("tokens") \
                    and last.tokens.round == ev.tokens.round:
                if not copied:  # the log's own event stays as it is (a reattach may send it again)
                    last = decode_pb2.DecodeEvent()
                    last.CopyFrom(out[-1])
                    out[-1], copied = last, True
                last.tokens.token_ids.extend(ev.tokens.token_ids)
                last.tokens.times.extend(ev.tokens.times)
                last.seq = seq
            else:
                out.append(ev)
                copied = False
            after = seq
            if ev.HasField("done"):
                break
        return out, after, None

    def attached(self, s: Session) -> object:
        """A stream takes the session's events over (an earlier one ends: it sees it is not the owner)."""
        me = object()
        s.owner = me
        s.attachments += 1
        s.notify.set()
        return me

    def detached(self, s: Session, me: object) -> None:
        """The stream ``me`` ended. Its coordinator went away without cancelling the session (it
        died, or stopped): the session goes on here, its events kept, for ``reattach_grace``
        seconds for its client to reattach it through another coordinator; then it is cancelled."""
        if s.owner is not me:
            return
        s.owner = None
        if s.closed:
            return
        n = s.attachments
        log.info("session detached: its coordinator went away", session=s.session_id,
                 grace_s=self.reattach_grace_s)
        self.metrics["sessions_detached"] += 1

        def expire() -> None:
            if not s.closed and s.owner is None and s.attachments == n:
                self.fail(s, f"not reattached within {self.reattach_grace_s:g} s of its coordinator's loss")
        asyncio.get_running_loop().call_later(self.reattach_grace_s, expire)

    def reattach(self, session_id: str, secret: str, after_seq: int) -> tuple[Session, decode_pb2.SessionState]:
        """A coordinator takes over the session (Reattach): its state for that coordinator's record."""
        s = self.sessions.get(session_id) or self.ended.get(session_id)
        if s is None or (s.closed and s.log and type(s.log[-1][1]) is SessionFailed):
            # (one that ended failing, e.g. cancelled by a coordinator that lost its client, is not
            # taken over: its client opens it again)
            raise NotOpen(f"session_id: {session_id!r} is not open on this worker")
        self._check_secret(s, secret)
        first = s.log[0][0] if s.log else s.seq + 1
        if after_seq + 1 < first:
            raise EventsGone(f"after_seq: the events after {after_seq} are gone (kept from {first})")
        self.metrics["sessions_reattached"] += 1
        return s, self.state_of(s)

    def state_of(self, s: Session) -> decode_pb2.SessionState:
        st = decode_pb2.SessionState(
            seq=s.seq, history=s.tokens, turn_round=s.turn_round, next_round=s.next_round, round=s.round_begun,
            round_ended=s.round_ended, server_calls=s.server_calls, client_calls=s.pending_calls,
            rounds=s.rounds_done, input_ready=s.input_ready, turns=s.turns, closing=s.closing, moves=s.moves)
        if s.limits is not None:
            st.limits.CopyFrom(s.limits)
        if s.turn is not None:
            st.turn.CopyFrom(s.turn)
        t = s.timing
        if t is not None and t.round == s.round_begun and s.round_begun >= 0:
            st.round_tokens = t.tokens + s.carried
            st.first_token_at = t.first_token
        u = s.unrouted
        if u is not None and (s.session_id, u.round) in self.awaiting_remote and not s.closed:
            st.unrouted.CopyFrom(u)
        return st

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
        check_turn(o.turn, self.engine, 0, "open.turn", self.chat is not None)
        s = Session(
            session_id=o.session_id,
            max_rounds=o.limits.max_rounds or MAX_ROUNDS,  # a tool loop ends some time
            max_output=o.limits.max_output_tokens,
            kv=SessionKV(self.rt.pool.block_tokens),
            core=DecodeSession(o.session_id),
            secret=req.session_secret,
            seq=req.first_seq, sent=req.first_seq, limits=o.limits, turns=1,
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
        # the previous round ended with server-side calls whose results never came: run them again
        s.turn, s.script = t, deque(t.script)
        s.turn_round = s.round_begun = r.round - 1
        s.round_ended = True
        s.tokens.extend(t.token_ids)
        scripted = s.script.popleft() if s.script else None
        calls = [(scripted.tool.name or "replay", scripted.tool.arguments, False)] if scripted \
            else [(c.name, c.arguments, False) for c in r.calls]
        after_eos = s.tokens[-1] in self.engine.eos_token_ids
        asyncio.create_task(self._run_tools(s, scripted, calls, after_eos))

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
        s.turns += 1
        self._start_turn(s, t, time.time(), route)

    def _start_turn(self, s: Session, t: common_pb2.Turn, now: float, route: decode_pb2.Route | None = None) -> None:
        if t.HasField("keep_tokens") and t.keep_tokens < len(s.tokens):
            del s.tokens[t.keep_tokens:]
            if s.kv.tokens > t.keep_tokens:
                s.kv.truncate(self.rt.pool, t.keep_tokens)
            self.core.rewind(s.core, t.keep_tokens)
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
        if s.recovering:
            new = len(s.tokens) - s.kv.tokens
        c.round, c.l_incr, c.out = s.next_round, new, s.max_tokens()
        s.round_begun, s.round_ended, s.server_calls, s.unrouted = s.next_round, False, [], None
        s.next_round += 1
        s.input_ready = input_ready
        bt = self.rt.pool.block_tokens
        self._sync_kv(room=len(s.kv.blocks) * bt - s.kv.tokens)
        r = self.core.round_ready(c, time.time())
        self._free_evicted()
        if r == FAILED:
            self.fail(s, c.error)
        elif r == ADMITTED:
            self._start_round(s)
        else:
            self.metrics["kv_waits"] += 1
            self.rt.changed()

    def _start_round(self, s: Session) -> None:
        """The round's KV is admitted: reserve it and ask the coordinator to route the prefill."""
        rnd = s.round
        s.l_hist = s.kv.tokens
        s.l_incr = len(s.tokens) - s.l_hist
        s.prefilled = 0
        if self.core.kv_evict:
            self._room_for(s)
        try:
            s.dest = s.kv.reserve(self.rt.pool, s.l_incr)
        except KVPoolExhausted as exc:
            self.fail(s, f"KV exhausted on {self.rt.cfg.worker_id}: {exc}")
            return
        self.rt.changed()
        s.timing = common_pb2.RoundTiming(round=rnd, input_ready=s.input_ready, l_hist=s.l_hist, l_incr=s.l_incr,
                                          recovered=s.recovering, kv_recomputed_tokens=s.recompute)
        self.metrics["kv_recomputed_tokens"] += s.recompute
        s.recovering, s.recompute = False, 0
        if tracing.on:
            s.admitted_at, s.prefill_at = time.time(), 0.0
        routed = s.route is not None and (s.route.l_hist, s.route.l_incr) == (s.l_hist, s.l_incr)
        if routed and not s.route.prefill_worker:  # the coordinator's local route holds
            self._queue_local(s)
            return
        task = common_pb2.PrefillTask(
            session_id=s.session_id, round=rnd, l_hist=s.l_hist, l_incr=s.l_incr, input_ready=s.input_ready,
            decode_worker=self.rt.cfg.worker_id, decode_tp=self.rt.cfg.tp,
            token_ids=s.tokens[s.l_hist:], sampling=s.params,
            history_token_ids=s.tokens[:s.l_hist] if self._token_ids else (),
        )
        history = s.kv.segments(0, s.l_hist)
        add_segments(task.history, history)
        add_segments(task.dest, s.dest)
        # the blocks just reserved may be written by a prefill worker with this token only
        task.task_token = s.task_token = task_token(self.rt.task_key, task, history, s.dest)
        self.awaiting_remote[(s.session_id, rnd)] = s
        self._notifs.arm()
        # its bound: the remote wait, plus what the prefill would take here (a long one is not overdue)
        wait = self.remote_wait_s + self.core.cost.t_pre(self.core.tp, s.l_hist, s.l_incr)
        asyncio.get_running_loop().call_later(wait, self._remote_overdue, s, rnd, wait)
        if routed:  # its remote route holds: the task goes to that prefill worker from here, now
            target = s.route.prefill_worker
            info = self.rt.peers.get(target)
            reply = self.stubs.submit(info.address, info.nixl_agent).send(prefill_pb2.SubmitRequest(task=task)) \
                if info is not None else None
            self._spawn(self._submitted(s, task, target, reply))
        else:
            s.unrouted = task
            self.emit(s, decode_pb2.DecodeEvent(prefill_task=task))

    async def _submitted(self, s: Session, task: common_pb2.PrefillTask, target: str, reply) -> None:
        """The answer to a routed remote prefill's submit; one that could not be submitted goes to
        the coordinator as a plain prefill_task, which routes it again (and runs it here if its
        prefill worker is gone)."""
        try:
            if reply is None:
                raise LookupError(f"prefill worker {target!r} is not known here")
            await reply
        except (grpc.aio.AioRpcError, LookupError) as exc:
            log.warning("routed prefill submit failed; asking the coordinator", session=s.session_id,
                        round=task.round, target=target, error=exc.details() if isinstance(exc, grpc.aio.AioRpcError)
                        else str(exc))
            if not s.closed and self.awaiting_remote.get((s.session_id, task.round)) is s:
                s.unrouted = task
                self.emit(s, decode_pb2.DecodeEvent(prefill_task=task))

    def _remote_overdue(self, s: Session, rnd: int, waited_s: float) -> None:
        """The round's remote prefill did not report within ``remote_wait_s`` plus its own compute
        time here (its prefill worker stopped, or its notification was lost): the round runs here,
        into the KV reserved for it.
        Should the prefill worker still write it (the same KV), the blocks stay held when the
        session ends until it reports, at most ``remote_wait_s`` more."""
        key = (s.session_id, rnd)
        if self.awaiting_remote.get(key) is not s or s.closed:
            return
        del self.awaiting_remote[key]
        s.overdue = (key, s.task_token)
        log.warning("remote prefill overdue; running it locally", session=s.session_id, round=rnd,
                    waited_s=round(waited_s, 3))
        self.metrics["prefills_overdue"] += 1
        self._queue_local(s)

    def _admit_waiting(self) -> None:
        """KV freed: start the waiting rounds that fit now, in the core's order."""
        while True:
            self._sync_kv()
            c = self.core.admit_next(time.time())
            self._free_evicted()
            if c is None:
                return
            self._start_round(self.sessions[c.session_id])

    # ------------------------------------------------------------------------ KV eviction
    def _free_evicted(self) -> int:
        """The core evicted these idle sessions' KV (--kv-evict): their blocks go back to the pool.
        Each keeps its tokens (``s.tokens``), so its next round prefills the whole history again, as
        a session moved here from a lost worker does (l_hist 0), routed like any prefill. Returns
        how many the core evicted."""
        victims = self.core.take_victims()
        for c in victims:
            s = self.sessions.get(c.session_id)
            if s is None or s.core is not c:
                continue
            s.recompute = s.kv.tokens
            s.kv.release(self.rt.pool)
            self.metrics["kv_evictions"] += 1
            log.info("KV evicted", session=s.session_id, tokens=s.recompute)
        return len(victims)

    def _room_for(self, s: Session) -> None:
        """Right before a round reserves its KV: evict more idle sessions while the pool itself lacks
        the room. The core admitted the round by its own count, and the pool differs from it by a
        token or so per session (a victim's blocks hold its history less the last output token, and
        the round's prefill writes that token too)."""
        pool = self.rt.pool
        room = len(s.kv.blocks) * pool.block_tokens - s.kv.tokens
        while pool.free_tokens + room < s.l_incr:
            self._sync_kv(room)
            self.core.make_room(s.l_incr)
            if not self._free_evicted():
                return  # nothing left to evict: the reservation fails the session

    def local_prefill(self, session_id: str, rnd: int, secret: str) -> None:
        s = self._session(session_id, secret)
        if s.round != rnd or (session_id, rnd) not in self.awaiting_remote:
            raise SessionError(f"session {session_id!r} round {rnd} is not waiting for a prefill")
        del self.awaiting_remote[(session_id, rnd)]
        self._queue_local(s)

    def _queue_local(self, s: Session) -> None:
        c = s.core
        self.core.submit_local(PrefillTask(s.session_id, c.round, c.l_hist, c.l_incr, s.input_ready,
                                           self.rt.cfg.worker_id, self.rt.cfg.tp))
        self.rt.took(s.session_id, c.round)
        self.wake.set()

    def cancel(self, session_id: str, reason: str, secret: str) -> None:
        """Ends the session now: its queued and running prefill leave the core, its KV and queue slots
        free at once (a session already gone is no error: cancels race with the end)."""
        s = self.sessions.get(session_id)
        if s is not None:
            self._check_secret(s, secret)
            self.fail(s, f"cancelled: {reason}" if reason else "cancelled")

    def stop_round(self, session_id: str, secret: str) -> None:
        """StopRound: the turn being answered ends at its next token, as if its max_tokens were
        reached (no tool call follows); nothing else of the session changes. Between turns: nothing."""
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
        self.emit(s, decode_pb2.DecodeEvent(done=common_pb2.SessionDone(rounds=s.rounds_done)))
        self.metrics["sessions_completed"] += 1
        self.close(s)

    def _session(self, session_id: str, secret: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise NotOpen(f"session_id: {session_id!r} is not open on this worker")
        self._check_secret(s, secret)
        return s

    @staticmethod
    def _check_secret(s: Session, secret: str) -> None:
        if not token_matches(s.secret, secret):
            raise NotPermitted(f"session_secret: not the secret of session {s.session_id!r}")

    def close(self, s: Session) -> None:
        """Frees everything the session holds on this worker (in the core once no step holds it)."""
        if s.closed:
            return
        s.closed = True
        if self.sessions.get(s.session_id) is s:
            del self.sessions[s.session_id]
        # Its last events stay for a reattach (its coordinator may be lost before it sent them).
        while len(s.log) > ENDED_KEEP:
            s.log.popleft()
        self.ended[s.session_id] = s
        try:
            asyncio.get_running_loop().call_later(self.reattach_grace_s, self._forget_ended, s)
        except RuntimeError:  # no loop (a core driven by hand): nothing to wait for
            self.ended.pop(s.session_id, None)
        remote = self.awaiting_remote.pop((s.session_id, s.round), None) is not None
        if self._stepping:
            self._after_step.append((s, ""))
        else:
            self.core.drop(s.core)
        running = self._prefilling
        if running is not None and running[0] is s:
            # Its local prefill is running: stop it now (an engine whose prefill can be cancelled,
            # like the mock, stops at once; another finishes its pass). The engine may still write
            # the session's blocks until then, so _prefill frees them when it lets go.
            if getattr(self.engine, "cancellable_prefill", False):
                running[1].cancel()
        elif (remote and s.task_token) or s.overdue is not None:
            key = (s.session_id, s.round) if remote else s.overdue[0]
            if not remote:
                s.task_token = s.overdue[1]
            self._held[key] = s
            self.metrics["kv_held_for_remote"] += 1
            asyncio.get_running_loop().call_later(REMOTE_HOLD_S if remote else self.remote_wait_s,
                                                  self._release_held, key)
        else:
            s.kv.release(self.rt.pool)
        if self._token_ids or self._round_kv:
            self.engine.forget(s.session_id)
        self.rt.active_sessions = len(self.sessions)
        self.rt.changed()
        if not self._stepping:
            self._admit_waiting()

    def _forget_ended(self, s: Session) -> None:
        if self.ended.get(s.session_id) is s:
            del self.ended[s.session_id]

    def _release_held(self, key: tuple[str, int]) -> None:
        s = self._held.pop(key, None)
        if s is not None:
            s.kv.release(self.rt.pool)
            self.rt.changed()
            self._admit_waiting()

    def fail(self, s: Session, error: str, code: str = ABORTED) -> None:
        if s.closed:
            return
        log.warning("session failed", session=s.session_id, error=error)
        self.metrics["sessions_failed"] += 1
        self.emit(s, SessionFailed(error, code))
        self.close(s)

    # --------------------------------------------------------------------------- round progress
    def first_token(self, s: Session, token: int, now: float, local: bool, worker: str) -> None:
        s.kv.commit(s.l_incr)
        s.dest = []
        s.out_start = len(s.tokens)
        s.tokens.append(token)
        t = s.timing
        t.first_token = t.last_token = now
        t.tokens = 1
        t.local = local
        t.prefill_worker = worker
        self.emit(s, decode_pb2.DecodeEvent(tokens=common_pb2.Tokens(
            round=s.round, position=s.out_start, token_ids=[token], times=[now])))
        self.metrics["tokens"] += 1
        reason = s.finish(token, self.engine)
        if reason:
            s.core.out = 1  # the round ends with its first token
        elif self._streams and not local:
            continue_remote_round(s, self.engine)
        if self.core.first_token(s.core, now):
            self.wake.set()  # it joins the batch at the next step
        else:
            self.end_round(s, now, reason or FINISH_LENGTH)

    def end_round(self, s: Session, now: float, reason: str) -> None:
        """The round's last token is made. What follows: a server-side tool's result (the next round
        of the turn), or the end of the turn (a client-side call, or the answer is complete). The
        calls are the turn's scripted ones, else those parsed from the output (engines with text)."""
        self.core.round_end(s.core, False)
        if self._round_kv:
            self.engine.forget(s.session_id)
        if self._streams:
            self.engine.end_round(s.session_id)  # where it still runs (the worker stopped first)
        # idle until its next round (a tool result, or the next turn); with --kv-evict its KV may go
        if self.core.tool_call(s.core):
            self._admit_waiting()
        s.carried = 0
        if reason == FINISH_STOP_REQUESTED:
            s.script.clear()  # the turn ends here: no tool call, no later round
        scripted = s.script.popleft() if s.script else None
        parsed = parse_tool_calls(s.stops.text)[1] if scripted is None and s.stops is not None \
            and reason != FINISH_STOP_REQUESTED else []
        if scripted is not None or parsed:
            reason = FINISH_TOOL
        s.timing.finish_reason = reason
        s.round_ended = True
        s.rounds_done.append(s.timing)
        if tracing.on:
            _round_spans(s, self.rt.cfg.worker_id)
        self.emit(s, decode_pb2.DecodeEvent(round_end=common_pb2.RoundEnd(timing=s.timing)))
        calls = [(scripted.tool.name or "replay", scripted.tool.arguments, scripted.tool.client_side)] if scripted \
            else [(c.name, c.arguments, c.name not in s.turn.server_tools) for c in parsed]
        client = any(side for _, _, side in calls)
        for i, (name, arguments, _) in enumerate(calls):
            call_id = new_call_id()  # unguessable: the next turn answers a client-side call by it
            tc = common_pb2.ToolCall(round=s.round, call_id=call_id, name=name, arguments=arguments,
                                     client_side=client)
            self.emit(s, decode_pb2.DecodeEvent(tool_call=tc))
            if not client:
                s.server_calls.append(tc)
            self.metrics["tool_calls"] += 1
            if client:
                s.pending_calls.add(call_id)
        if calls and not client:
            after_eos = s.tokens[-1] in self.engine.eos_token_ids
            asyncio.create_task(self._run_tools(s, scripted, calls, after_eos))
            return
        s.turn = None
        self.emit(s, decode_pb2.DecodeEvent(turn_end=common_pb2.TurnEnd(
            round=s.round, finish_reason=reason, history_tokens=len(s.tokens))))
        if s.closing:
            self._done(s)

    async def _run_tools(self, s: Session, scripted: common_pb2.ScriptedCall | None,
                         calls: list[tuple[str, str, bool]], after_eos: bool) -> None:
        """Off the decode loop: the sidecar runs the round's server-side calls, in order; their
        results are the next round's input (a scripted call's result is ``result_tokens`` long)."""
        results = []
        for name, arguments, _ in calls:
            latency = scripted.tool.latency_s if scripted else 0.0
            # its span is the parent of the sidecar's (traceparent in the call's metadata)
            span = tracing.start("tool_call", tracing.round_context(s.session_id, s.round), {
                "ampd.session_id": s.session_id, "ampd.round": s.round, "ampd.tool.name": name},
                kind="client") if tracing.on else None
            try:  # the deadline: the tool's own latency and an RPC's
                res = await self.sidecar.Call(sidecar_pb2.ToolCallRequest(
                    session_id=s.session_id, round=s.round, name=name, arguments=arguments,
                    latency_s=latency, result_tokens=scripted.result_tokens if scripted else 0),
                    timeout=latency + RPC_TIMEOUT_S, wait_for_ready=True,  # a restarting sidecar: wait
                    metadata=tracing.metadata(span.context) if span is not None else None)
            except Exception as exc:  # grpc.aio.AioRpcError and connection failures
                detail = exc.details() if hasattr(exc, "details") else exc
                if span is not None:
                    span.end(error=str(detail))
                if not s.closed:
                    self.fail(s, f"tool {name!r} failed: {detail}")
                return
            if span is not None:
                span.end(error=res.error, **{"ampd.tool.result_tokens": res.result_tokens})
            results.append((name, res))
        if s.closed:
            return
        if self.chat is not None and all(res.content for _, res in results):
            ids = self.chat.continuation_ids([{"role": "tool", "name": name, "content": res.content}
                                              for name, res in results], after_eos=after_eos)
        else:  # a replayed result: its length is what matters
            n = sum(res.result_tokens for _, res in results) or (scripted.result_tokens if scripted else 1)
            ids = filler_ids(n, len(s.tokens), self.engine.vocab_size)
        s.tokens.extend(ids)
        self.begin_round(s, scripted.sampling if scripted else s.turn.sampling, len(ids), time.time())

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
                await self._step(work)  # the core plans one step (step_by_step)

    async def _prefill(self, work: LocalPrefill) -> None:
        """One local prefill, or one chunk of it (the core chose it)."""
        s = self.sessions.get(work.session.session_id)
        if s is None or s.core is not work.session:  # cannot happen: drop() unqueues a closed session
            self.core.update(work, time.time())
            return
        self.rt.changed()  # the queue and busy_until moved
        start = s.l_hist + s.prefilled
        # the core chunks the round's new tokens; the last piece also holds the previous round's
        # last output token (see begin_round)
        n = s.l_incr - s.prefilled if work.last else work.tokens
        chunk = not (work.last and s.prefilled == 0)
        segs = s.kv.segments(start, n) if chunk else s.dest
        extra = {"history_ids": s.tokens} if self._token_ids else {}
        if tracing.on and not s.prefill_at:
            s.prefill_at = time.time()
        if self._streams and work.last:
            extra["stops"] = stops_of(s, self.engine)  # the round's request: prefill, then its decode
        run = asyncio.ensure_future(self.engine.prefill(
            s.session_id, start, n, self.rt.pool, segs, token_ids=s.tokens[start:start + n],
            history_kv=s.kv.segments(0, start) if self._history_kv else (), sampling=s.sampling, **extra))
        self._prefilling = (s, run)
        try:
            token = await run
        except asyncio.CancelledError:
            if not s.closed or asyncio.current_task().cancelling():
                raise  # the worker stops
            token = -1  # the session was cancelled: its prefill stopped (close)
        finally:
            self._prefilling = None
            if s.closed:  # the blocks close() left to the prefill
                s.kv.release(self.rt.pool)
        if s.closed:
            self.core.update(work, time.time())
            self.rt.changed()
            self._admit_waiting()
            return
        s.prefilled += n
        self.metrics["local_prefill_tokens"] += n
        if chunk:
            self.metrics["prefill_chunks"] += 1
        done = self.core.update(work, time.time())
        self.rt.changed()
        if done and not s.closed:
            self.metrics["prefills_local"] += 1
            self.first_token(s, token, time.time(), True, self.rt.cfg.worker_id)

    async def _step(self, work: DecodeRun) -> None:
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
            pos = len(s.tokens) - 1
            seqs.append((s, DecodeSeq(s.session_id, pos, s.tokens[pos], segs, pos + 1,
                                      s.kv.segments(0, pos) if self._history_kv else [], s.sampling,
                                      s.tokens if self._token_ids else ())))
        self._stepping = True
        try:
            tokens = await self.engine.decode_step(pool, [d for _, d in seqs]) if seqs else []
        finally:
            self._stepping = False
        now = time.time()
        ended = {id(c) for c in self.core.update(work, now)}
        live = 0
        finished: list[tuple[Session, str]] = []
        for (s, _), tok in zip(seqs, tokens):
            if s.closed:
                continue
            s.kv.commit(1)
            s.tokens.append(tok)
            live += 1
            t = s.timing
            t.last_token = now
            t.tokens += 1
            self.emit(s, decode_pb2.DecodeEvent(tokens=common_pb2.Tokens(
                round=s.round, position=len(s.tokens) - 1, token_ids=[tok], times=[now])))
            reason = s.finish(tok, self.engine)
            if id(s.core) in ended:
                finished.append((s, reason or FINISH_LENGTH))
            elif reason:
                self.core.stop_early(s.core, len(s.tokens) - s.out_start)
                finished.append((s, reason))
        # sessions closed or out of KV during the step: the core forgets them now
        after, self._after_step = self._after_step, []
        gone = {id(s.core) for s, _ in after}
        for s, reason in finished:
            if id(s.core) not in gone and self.sessions.get(s.session_id) is s:
                self.end_round(s, now, reason)
        stopped = ended | {id(s.core) for s, _ in finished}
        for s, error in after:
            if id(s.core) in stopped:
                self.core.round_end(s.core, True)  # its round ended with this step: its whole charge goes
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
        key = (done.session_id, done.round)
        s = self.awaiting_remote.pop(key, None)
        if s is None:
            held = self._held.get(key)
            live = self.sessions.get(done.session_id)
            if held is not None and token_matches(held.task_token, done.task_token):
                self._release_held(key)  # the prefill worker is done with the ended session's blocks
            elif live is not None and live.overdue is not None and live.overdue[0] == key \
                    and token_matches(live.overdue[1], done.task_token):
                live.overdue = None  # the overdue prefill reported after all: its blocks are free to go
            else:
                log.warning("prefill done for an unknown session", session=done.session_id, round=done.round)
            return
        if not token_matches(s.task_token, done.task_token):
            self.awaiting_remote[(done.session_id, done.round)] = s  # not its task's: keep waiting
            log.warning("prefill done with a wrong task token", session=done.session_id, round=done.round)
            return
        if done.error:
            # The prefill worker could not do it (shutting down, a transfer failed): the reserved KV
            # is still here, so the round runs locally instead of failing the session.
            log.warning("remote prefill failed; running it locally", session=s.session_id, round=done.round,
                        prefill_worker=done.prefill_worker, error=done.error)
            self.metrics["prefills_rerouted"] += 1
            self.awaiting_remote[(done.session_id, done.round)] = s
            self.local_prefill(done.session_id, done.round, s.secret)
            return
        if not self._history_kv:  # the mock's KV content is a function of (session, position): check it
            data = self.rt.pool.read(s.dest, copy=False)  # only compared: a view when it is one run
            bad = verify_pattern(s.session_id, s.l_hist, data, self.rt.pool.layout.bytes_per_token)
            self.metrics["kv_bytes_verified"] += data.size
            self.metrics["kv_bytes_mismatched"] += bad
            if bad:
                self.fail(s, f"KV written by {done.prefill_worker} has {bad} wrong bytes")
                return
        self.metrics["prefills_remote"] += 1
        self.first_token(s, done.first_token, time.time(), False, done.prefill_worker)


class SessionFailed:
    """Queue sentinel: the Attach stream ends with this error and status code name (ABORTED: the
    session cannot go on; UNAVAILABLE: this worker is going away, the session can move)."""

    __slots__ = ("error", "code")

    def __init__(self, error: str, code: str = "ABORTED") -> None:
        self.error = error
        self.code = code


def _round_spans(s: Session, worker: str) -> None:
    """The decode worker's spans of the round that just ended (tracing on): its admission (from its
    input being ready to its KV reserved here: a wait for KV when the pool is full; for a session's
    first round, from the coordinator's arrival time), its local prefill (queue wait and compute) or
    its wait for a remote one, and its decode."""
    t, parent = s.timing, tracing.round_context(s.session_id, s.timing.round)
    base = {"ampd.session_id": s.session_id, "ampd.round": t.round, "ampd.worker": worker}
    admitted = s.admitted_at or t.input_ready
    if admitted > t.input_ready:
        tracing.record("kv_admit", t.input_ready, admitted, parent, base)
    if t.local:
        started = s.prefill_at or admitted
        local = tracing.record("prefill", admitted, t.first_token, parent, {
            **base, "ampd.route.local": True, "ampd.l_hist": t.l_hist, "ampd.l_incr": t.l_incr})
        tracing.record("queue_wait", admitted, started, local, base)
        tracing.record("compute", started, t.first_token, local, base)
    else:  # the prefill worker's own spans are beside this one
        tracing.record("remote_prefill_wait", admitted, t.first_token, parent, {
            **base, "ampd.prefill_worker": t.prefill_worker})
    tracing.record("decode", t.first_token, t.last_token, parent, {
        **base, "ampd.tokens": t.tokens, "ampd.finish_reason": t.finish_reason})
