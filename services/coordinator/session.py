"""One client session on the coordinator: bound to a decode worker, its prefills routed, its events
forwarded, and moved to another decode worker when its own is lost.

Everything that happens to the session goes through one queue, in order: the client's messages,
the decode worker's events, the end of the decode stream. One loop takes them one at a time, so the
session's record (ampd.sessionlog.SessionLog) never races with itself. A decode stream that fails
with UNAVAILABLE (the worker died, or is shutting down) moves the session: the worker leaves routing,
the session is bound to another decode worker with a Resume (its history, prefilled there again),
and its stream goes on; at most ``migration_limit`` times. A decode worker that stopped answering
(fenced: not heard from for ``fence_after``) moves its sessions the same way.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from ampd import tracing
from ampd.agenthints import HINTS, hints_from_turn
from ampd.grpcserver import SESSION_OPEN
from ampd.policy.hints import queue_enqueued_at
from ampd.sessionlog import CannotResume, SessionLog
from ampd.trust import attach_token, new_secret, reattach_token
from ampd.v1 import common_pb2, coordinator_pb2, decode_pb2
from services.coordinator.admission import Refused
from services.coordinator.core import turn_kv_tokens
from services.coordinator.client import ClientMessages
from services.coordinator.errors import SessionEnd
from services.coordinator.inbox import Inbox
from services.coordinator.reattach import Reattach, cancel_stale_copy
from services.coordinator.routing import SessionRoutes

log = structlog.get_logger()

# what a decode worker's Attach stream ends with when another coordinator reattached the session
TAKEN_OVER = "reattached through another coordinator"
BIND_WAIT_S = 15.0  # a moving session waits this long for a live decode worker (one may be restarting)
OPEN_WAIT_S = 3.0  # a new session waits this long for one (then UNAVAILABLE: none is serving)


def yield_at(run: SessionRun) -> float | None:
    """Admission's order for a session whose opening turn yields (a negative priority hint): its
    arrival made later; None (no yield, or admitted already) leaves admission's own order."""
    if run.admitted or run.hints.priority >= 0:
        return None
    return queue_enqueued_at(run.arrived, run.hints.priority, HINTS)


def expected_kv(run: SessionRun) -> int | None:
    """The KV a new session is expected to hold (its opening turn's outputs by the windowed mean and
    its ``expected_output_tokens`` hint, ampd.policy.outlen), what the slo admission rule predicts
    its ITL from; None once admitted (only the KV rule judges it again) or without a mean."""
    mean = None if run.admitted else run.svc.admission.out_mean()
    if mean is None:
        return None
    return turn_kv_tokens(run.o.turn, run.o.limits.max_output_tokens, mean) + run.svc.block_tokens()


class SessionRun:
    """One client session: its loop over its inbox (``run``), its binding to a decode worker and
    its moves, the client's messages and the decode worker's events. Its prefill routing is
    ``routing`` (services/coordinator/routing.py), a reattach in progress ``reattach``
    (services/coordinator/reattach.py)."""

    def __init__(self, svc, sid: str, o: common_pb2.OpenSession, request_iterator, on_open=None,
                 reattach: coordinator_pb2.ReattachSession | None = None) -> None:
        self.svc = svc
        self.on_open = on_open  # awaited once the session is bound (the server sends its headers then)
        self.sid = sid
        self.o = o
        self.requests = request_iterator
        self.log = SessionLog(sid, o.limits, prefix_scope=o.prefix_scope)
        self.q = Inbox()
        self.gen = 0  # the binding's number: events of a replaced binding are dropped
        self.bound = False
        self.opened = False  # the bound worker opened the session (Attach's metadata or first event came)
        self.held: list = []  # client messages that came before it did
        self.finished = False
        self.decode_id = ""
        self.info = None
        self.control = None
        self.call = None
        self.pump: asyncio.Task | None = None
        self.routing = SessionRoutes(self)  # its rounds' prefills: where each ran
        self.client = ClientMessages(self)  # what the client's messages do
        self.deferred: list = []  # bookkeeping that waits until the events in hand went to the client
        self.announce = True  # the next event to the client names the binding
        self.secret = new_secret()  # the session's credential on its decode worker (every request)
        self.closing = False  # the client sent Close: only stop or cancel may follow
        self.cancelled = False  # the client sent Cancel: the worker ends the session, nothing else goes
        # The KV the session may hold (its turns' inputs, outputs and scripted results, one block
        # more): promised to its decode worker by admission while it is bound there.
        self.need = turn_kv_tokens(o.turn, o.limits.max_output_tokens) + svc.block_tokens()
        self.promised_on = ""  # the decode worker holding that promise
        self.last_round: tuple[float, int] | None = None  # its last round's last token and KV (admission's samples)
        self.admitted = False
        self.arrived = time.monotonic()  # what admission's TTFT budget counts from
        self.hints = hints_from_turn(o.turn)  # the opening turn's agent hints (advice: ampd.policy.hints)
        # Reattached (its coordinator was lost): its ReattachSession, until the decode worker's state
        # comes; events up to ``replayed`` were in that state (sent, not logged again)
        self.reattach = Reattach(self, reattach) if reattach is not None else None
        self.replayed = 0
        # Reattached: tokens before this position were in the worker's state, logged from it. The
        # first events after that state can carry some of them again, merged with new ones into one
        # Tokens (the worker's take_events, or Inbox.merge_tokens here): the log counts them once.
        self.logged_to = 0
        self.seq = 0  # the last decode event's number seen (a moved session numbers on after it)
        self.taken_over = False  # another coordinator reattached it: its record is not deleted from here

    # -------------------------------------------------------------------------------- the loop
    async def run(self):
        """The session's events for the client, those ready together in one list (one message to
        the client: coordinator.proto SessionEvents); raises SessionEnd."""
        if self.reattach is not None:
            await self.reattach.start()
        else:
            self.log.on_turn(self.o.turn)
            await self.bind(decode_pb2.AttachRequest(open=self.o, arrival=time.time()), wait_s=OPEN_WAIT_S)
        if self.on_open is not None:
            await self.on_open()
        reader = self.svc.tasks.spawn(self._read_client())
        try:
            batch: list = []
            try:
                while not self.finished:
                    batch += await self._step(await self.q.get())
                    if batch and (not self.q or self.finished):  # (more queued: they join this message)
                        yield batch
                        batch = []
                    if not batch:  # (after the events in hand went to the client)
                        while self.deferred:
                            self.deferred.pop(0)()
                    while self.held and self.opened and self.reattach is None and not self.finished:
                        batch += await self.client.handle(self.held.pop(0))
            except SessionEnd:
                if batch:  # the events before the end still go
                    yield batch
                raise
            if batch:
                yield batch
        finally:
            reader.cancel()
            if self.bound and not self.finished and not self.svc.stopping and self.control is not None:
                # Ended here (the client cancelled, or the session failed): the decode worker frees it
                # now. A stream that just ends leaves it there for another coordinator (reattach_grace).
                self._cancel_on_worker("the coordinator ended the session")
            self._unbind()
            self._release()
            self.svc.forget_remote(self)

    async def _step(self, item: tuple) -> list:
        """What one thing in the inbox does: the events for the client."""
        kind, gen, item = item
        if kind == "client":
            return await self.client.handle(item)
        if gen != self.gen:
            return []  # from a decode stream already replaced
        if kind == "opened":
            self.opened = True
            return []
        if kind == "event":
            if item.HasField("tokens"):
                self.q.merge_tokens(item, gen)
            seq = item.seq
            if seq <= self.replayed:  # in the reattached state already: to the client only
                outs = self._replay(item)
            else:
                outs = await self._event(item)
            if seq:
                self.seq = seq
                for out in outs:
                    out.seq = seq
            return outs
        if kind == "state":
            return await self.reattach.adopt(item)
        if kind == "error":
            return await self._decode_failed(item)
        if kind == "fenced":
            return await self.move(item)
        return await self.move("its stream ended without SessionDone")

    def _cancel_on_worker(self, why: str) -> None:
        # unanswered (CallStream.post): a failure leaves nothing to do here
        self.control.post(decode_pb2.ControlRequest(cancel=decode_pb2.CancelRequest(
            session_id=self.sid, reason=why, session_secret=self.secret)))

    def fenced(self, why: str) -> None:
        """The bound decode worker was fenced: the session moves (in order, after the events in hand;
        any later event of that binding is dropped, the move replaces it)."""
        self.q.put_nowait(("fenced", self.gen, why))

    async def _read_client(self) -> None:
        try:
            async for msg in self.requests:
                self.q.put_nowait(("client", 0, msg))
            self.q.put_nowait(("client", 0, None))  # half-closed: end after the current turn
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass

    async def _pump(self, call, gen: int) -> None:
        try:
            # The worker opened the session: held client messages may go. Its first event may come
            # much later (a long prefill routed with the open).
            if SESSION_OPEN in tuple(await call.initial_metadata() or ()):
                self.q.put_nowait(("opened", gen, None))
            async for batch in call:
                if batch.HasField("state"):  # Reattach's first message
                    self.q.put_nowait(("state", gen, batch.state))
                for ev in batch.events:
                    self.q.put_nowait(("event", gen, ev))
            self.q.put_nowait(("end", gen, None))
        except grpc.aio.AioRpcError as exc:
            self.q.put_nowait(("error", gen, exc))
        except asyncio.CancelledError:
            pass

    # ------------------------------------------------------------------------------- binding
    async def bind(self, req: decode_pb2.AttachRequest, wait_s: float = BIND_WAIT_S) -> None:
        """Binds the session to the decode worker admission gives it (waiting for KV up to
        admission_wait, then RESOURCE_EXHAUSTED: a session is refused before it is accepted, never
        aborted for lack of KV after; --admission slo also refuses a new session that would miss its
        SLO)."""
        svc = self.svc
        deadline = time.monotonic() + wait_s
        self._release()
        prefer = None if self.admitted or req.HasField("resume") else await svc.prefix_choice(self)
        while True:
            try:
                self.decode_id = await svc.admission.admit(self.need, svc.rooms, len(self.o.turn.token_ids),
                                                           self.arrived, new=not self.admitted, sid=self.sid,
                                                           order_at=yield_at(self), prefer=prefer, expect=expected_kv(self),
                                                           stale=lambda w, sec: cancel_stale_copy(self, w, sec))
                break
            except Refused as exc:
                svc.counters["refused_" + exc.reason] += 1
                raise SessionEnd(grpc.StatusCode.RESOURCE_EXHAUSTED, f"admission: {exc.reason}: {exc}") from None
            except LookupError:  # no decode worker serves (one may be restarting)
                if time.monotonic() >= deadline:
                    raise SessionEnd(grpc.StatusCode.UNAVAILABLE, "no decode worker is serving") from None
                await asyncio.sleep(0.25)
        self.promised_on, self.admitted = self.decode_id, True
        req.session_secret = self.secret
        self.info = svc.cluster.infos[self.decode_id]
        req.attach_token = attach_token(bytes.fromhex(self.info.task_key), self.sid, self.decode_id, self.secret)
        self.control = svc.stubs.control(self.info.address, self.info.nixl_agent)
        if not req.HasField("resume"):
            r = await self.routing.route_ahead(0, 0, len(req.open.turn.token_ids))
            if r is not None:
                req.route.CopyFrom(r)
        req.first_seq = self.seq  # events there are numbered after those seen here
        self.attach(svc.stubs.decode(self.info.address, self.info.nixl_agent).Attach(req))
        # the secret: another coordinator reattaches the session with it when this one is lost
        svc.record(self.sid, {"decode_worker": self.decode_id, "round": req.resume.round, "moves": self.log.moves,
                              "secret": self.secret})

    def attach(self, call) -> None:
        """The session's stream from its decode worker is ``call`` (Attach or Reattach) now."""
        self.gen += 1
        self.call = call
        self.pump = self.svc.tasks.spawn(self._pump(call, self.gen))
        self.bound, self.opened, self.announce = True, False, True

    def _release(self) -> None:
        if self.promised_on:
            self.svc.admission.release(self.promised_on, self.need, self.sid)
            self.promised_on = ""

    def _unbind(self) -> None:
        self.gen += 1
        if self.pump is not None:
            self.pump.cancel()
        if self.call is not None:
            self.call.cancel()
        self.pump = self.call = None
        self.bound = False

    async def _decode_failed(self, exc: grpc.aio.AioRpcError) -> list:
        code = exc.code()
        if self.reattach is not None:  # the reattach failed before the worker's state came
            if code == grpc.StatusCode.OUT_OF_RANGE:  # it goes on there without its client: end it
                self._cancel_on_worker("its client missed events the worker no longer keeps")
            raise SessionEnd(grpc.StatusCode.NOT_FOUND, f"reattach: decode worker {self.decode_id}: {exc.details()}")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
            # NOT_FOUND: the worker does not hold the session (it restarted, or was fenced meanwhile)
            return await self.move(exc.details())
        if code == grpc.StatusCode.ABORTED and TAKEN_OVER in (exc.details() or ""):
            # another coordinator serves it now: it is not cancelled from here, and its record and KV
            # promise are that coordinator's
            self.bound, self.taken_over, self.promised_on = False, True, ""
            raise SessionEnd(grpc.StatusCode.UNAVAILABLE, f"the session moved to another coordinator: {exc.details()}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise SessionEnd(code, exc.details())
        raise SessionEnd(code if code != grpc.StatusCode.UNKNOWN else grpc.StatusCode.INTERNAL,
                         f"decode worker {self.decode_id}: {exc.details()}")

    async def move(self, why: str) -> list:
        """The bound decode worker is lost: bind the session to another one, or wait for the next
        turn when it was idle."""
        svc, lost = self.svc, self.decode_id
        svc.cluster.mark_lost(lost)
        self._unbind()
        self._release()  # the lost worker's KV is gone; the next binding promises it again
        if self.log.moves >= svc.migration_limit:
            raise SessionEnd(grpc.StatusCode.UNAVAILABLE,
                             f"decode worker {lost} lost ({why}); the session already moved {self.log.moves} "
                             f"times, its limit (--migration-limit)")
        svc.counters["sessions_moved"] += 1
        log.warning("decode worker lost; moving the session", session=self.sid, worker=lost, why=why,
                    round=self.log.round, tokens=len(self.log.history))
        outs = []
        state = self.log.lost()
        if state == "turn_end":
            outs.append(self.to_client(turn_end=self.log.turn_end()))
            state = "idle"
        if state == "idle":
            self.opened = True  # nothing to wait for: the next client message binds it again
            return outs
        try:
            await self.bind(self.log.resume())
        except CannotResume as exc:
            raise SessionEnd(grpc.StatusCode.UNAVAILABLE, f"decode worker {lost} lost ({why}); {exc}") from None
        return outs

    # ------------------------------------------------------------------------- decode events
    def to_client(self, **event) -> coordinator_pb2.SessionEvent:
        out = coordinator_pb2.SessionEvent(session_id=self.sid, **event)
        if self.announce:
            out.decode_worker = self.decode_id
            out.reattach_token = reattach_token(self.secret)
            self.announce = False
        return out

    def _replay(self, ev: decode_pb2.DecodeEvent) -> list:
        """An event the reattached state already holds, which the client may not have seen."""
        kind = ev.WhichOneof("event")
        if kind == "prefill_task" or kind is None:
            return []
        if kind == "done":
            return [self.session_done(ev.done)]
        if kind == "round_end":
            self._annotate(ev.round_end.timing)
        return [self.to_client(**{kind: getattr(ev, kind)})]

    def session_done(self, done: common_pb2.SessionDone) -> coordinator_pb2.SessionEvent:
        del done.rounds[:]
        for t in self.log.rounds():  # every round, the ones made on a lost worker too
            self._annotate(t)
            done.rounds.append(t)
        self.finished = True
        return self.to_client(done=done)

    async def _event(self, ev: decode_pb2.DecodeEvent) -> list:
        self.opened = True
        kind = ev.WhichOneof("event")
        lg = self.log
        if kind == "prefill_task":
            lg.on_prefill_task(ev.prefill_task)
            await self.routing.route(ev.prefill_task)
            return []
        if kind == "tokens":
            routing = self.routing
            if routing.ahead is not None and (ahead := routing.held(ev.tokens.round)) is not None:
                # its route held: no prefill_task came
                lg.on_round_start(ahead.round, ahead.input_ready)
                # its record and log line once the first tokens are on their way to the client
                self.deferred.append(lambda: routing.routed(ahead.round, ahead.decision, ahead.decide_ms))
            lg.on_tokens(self._unlogged(ev.tokens))
            self.svc.forget_remote(self, ev.tokens.round)
            return [self.to_client(tokens=ev.tokens)]
        if kind == "tool_call":
            lg.on_tool_call(ev.tool_call)
            return [self.to_client(tool_call=ev.tool_call)]
        if kind == "turn_end":
            lg.on_turn_end()
            return [self.to_client(turn_end=self.routing.heard(ev.turn_end))]  # its KV location stripped
        if kind == "round_end":
            t = ev.round_end.timing
            lg.on_round_end(t)
            self._annotate(t)
            if tracing.on:
                tracing.round_span(self.sid, t)
            self.svc.rounds.observe(t)
            self.last_round = self.svc.admission.round_ended(t, self.last_round, self.info.tp if self.info else 1)
            return [self.to_client(round_end=ev.round_end)]
        if kind == "done":
            return [self.session_done(ev.done)]
        return []

    def _unlogged(self, t: common_pb2.Tokens) -> common_pb2.Tokens:
        """``t`` less its tokens that the reattached state held (logged already; the client still
        gets them all): counted twice, the round's count would run ahead of its tokens, and a
        move would resume the round that many tokens short."""
        end = min(self.logged_to, len(self.log.history))
        self.logged_to = 0  # only the first Tokens after the state can carry such tokens
        if t.position >= end:
            return t
        skip = min(end - t.position, len(t.token_ids))
        rest = common_pb2.Tokens()
        rest.CopyFrom(t)
        del rest.token_ids[:skip]
        del rest.times[:skip]
        rest.position = t.position + skip
        return rest

    def _annotate(self, t: common_pb2.RoundTiming) -> None:
        reason = self.routing.reason(t.round)
        if reason is not None:
            t.route_reason = reason
