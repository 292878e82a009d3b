"""A decode worker's sessions: the I/O side of one session (``Session``), its event log (``emit``,
``take_events``), the checks only a decode worker can make of a turn, and the errors its requests
raise."""
from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field

from ampd import tracing
from ampd.chat.stops import StopChecker
from ampd.engine.base import GREEDY, Engine, Sampling
from ampd.kv import Segment, SessionKV
from ampd.policy.kvwhere import KVWhere
from ampd.trust import token_matches
from ampd.v1 import common_pb2, decode_pb2
from ampd.worker import DecodeSession

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
    submitted_to: str = ""  # the address of the prefill worker this worker submitted the round's prefill to
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
    prefix_tokens: int = 0  # --prefix-sharing: leading tokens in prefix blocks (PrefillTask.prefix_tokens)
    shared_tokens: int = 0  # --prefix-sharing: of them, those its first round found shared (RoundTiming)
    scoped_seed: int = 0  # --prefix-sharing: its prompt blocks' hash seed, its prefix scope's (LivePrefix.seed_of)
    prefix_scope: str = ""  # OpenSession.prefix_scope (SessionState: a reattached coordinator moves it with it)
    route: decode_pb2.Route | None = None  # the coordinator's route for the round starting now
    where: tuple[int, KVWhere] | None = None  # (round, where its KV was as it started): services/decode/kvwhere.py
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


def check_secret(s: Session, secret: str) -> None:
    """Raises NotPermitted unless ``secret`` is the session's."""
    if not token_matches(s.secret, secret):
        raise NotPermitted(f"session_secret: not the secret of session {s.session_id!r}")


def check_turn(t: common_pb2.Turn, engine: Engine, history: int, path: str, text: bool = False,
               carried: int = 0) -> None:
    """What only the decode worker can check (its engine's vocabulary and context limit). ``carried``:
    a session moved here mid-round (``Resume.round_tokens``): output its round already made, which
    ``t`` holds in its history and which its ``max_tokens`` no longer has to come."""
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
    to_come = max(0, t.sampling.max_tokens - carried)
    if ctx + to_come > engine.max_context:
        made = f" ({carried} of them already made)" if carried else ""
        raise InvalidTurn(f"{path}.sampling.max_tokens: {ctx} context tokens + {to_come} output tokens to come{made} "
                          f"exceed the model's limit of {engine.max_context}")
    if t.sampling.stop and not text:
        raise InvalidTurn(f"{path}.sampling.stop: stop strings need an engine with a tokenizer "
                          f"({engine.name} has none); use stop_token_ids")


def made_before_move(req: decode_pb2.AttachRequest) -> int:
    """The output a session moved here mid-round already made (its round goes on here from there:
    ``Session.carried``); 0 for a new session, and for one whose tool calls run again."""
    r = req.resume
    return r.round_tokens if req.HasField("resume") and not r.rerun_tools else 0


class SessionFailed:
    """Queue sentinel: the Attach stream ends with this error and status code name (ABORTED: the
    session cannot go on; UNAVAILABLE: this worker is going away, the session can move)."""

    __slots__ = ("error", "code")

    def __init__(self, error: str, code: str = "ABORTED") -> None:
        self.error = error
        self.code = code


def emit(s: Session, event) -> None:
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

def take_events(s: Session, after: int) -> tuple[list, int, "SessionFailed | None"]:
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


def round_spans(s: Session, worker: str) -> None:
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


def keep_ended(ended: dict[str, Session], s: Session, grace_s: float) -> None:
    """An ended session's last events stay ``grace_s`` for a reattach (its coordinator may be lost
    before it sent them)."""
    while len(s.log) > ENDED_KEEP:
        s.log.popleft()
    ended[s.session_id] = s

    def forget() -> None:
        if ended.get(s.session_id) is s:
            del ended[s.session_id]
    try:
        asyncio.get_running_loop().call_later(grace_s, forget)
    except RuntimeError:  # no loop (a core driven by hand): nothing to wait for
        ended.pop(s.session_id, None)
