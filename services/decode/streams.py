"""The decode worker's session streams: which Attach stream sends a session's events, a session
left by a lost coordinator (detached: it goes on for ``reattach_grace_s``), and a coordinator that
takes a session over (Reattach) with its state."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from ampd.v1 import decode_pb2
from services.decode.session import EventsGone, NotOpen, Session, SessionFailed, check_secret

if TYPE_CHECKING:
    from services.decode.worker import DecodeWorker

log = structlog.get_logger()


class Attachments:
    """The streams of the worker's sessions (``attached``/``detached``) and their takeover
    (``reattach``, ``state_of``)."""

    def __init__(self, w: DecodeWorker) -> None:
        self.w = w

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
                 grace_s=self.w.reattach_grace_s)
        self.w.metrics["sessions_detached"] += 1

        def expire() -> None:
            if not s.closed and s.owner is None and s.attachments == n:
                self.w.fail(s, f"not reattached within {self.w.reattach_grace_s:g} s of its coordinator's loss")
        asyncio.get_running_loop().call_later(self.w.reattach_grace_s, expire)

    def reattach(self, session_id: str, secret: str, after_seq: int) -> tuple[Session, decode_pb2.SessionState]:
        """A coordinator takes over the session (Reattach): its state for that coordinator's record."""
        w = self.w
        s = w.sessions.get(session_id) or w.ended.get(session_id)
        if s is None or (s.closed and s.log and type(s.log[-1][1]) is SessionFailed):
            # (one that ended failing, e.g. cancelled by a coordinator that lost its client, is not
            # taken over: its client opens it again)
            raise NotOpen(f"session_id: {session_id!r} is not open on this worker")
        check_secret(s, secret)
        first = s.log[0][0] if s.log else s.seq + 1
        if after_seq + 1 < first:
            raise EventsGone(f"after_seq: the events after {after_seq} are gone (kept from {first})")
        self.w.metrics["sessions_reattached"] += 1
        return s, self.state_of(s)

    def state_of(self, s: Session) -> decode_pb2.SessionState:
        st = decode_pb2.SessionState(
            seq=s.seq, history=s.tokens, turn_round=s.turn_round, next_round=s.next_round, round=s.round_begun,
            round_ended=s.round_ended, server_calls=s.server_calls, client_calls=s.pending_calls,
            rounds=s.rounds_done, input_ready=s.input_ready, turns=s.turns, closing=s.closing, moves=s.moves,
            prefix_scope=s.prefix_scope)
        if s.limits is not None:
            st.limits.CopyFrom(s.limits)
        if s.turn is not None:
            st.turn.CopyFrom(s.turn)
        t = s.timing
        if t is not None and t.round == s.round_begun and s.round_begun >= 0:
            st.round_tokens = t.tokens + s.carried
            st.first_token_at = t.first_token
        u = s.unrouted
        if u is not None and self.w.remote.waiting(s, u.round) and not s.closed:
            st.unrouted.CopyFrom(u)
        return st
