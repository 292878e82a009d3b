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
from ampd.events import merge_tokens
from ampd.grpcserver import SESSION_OPEN
from ampd.policy import PrefillTask
from ampd.sessionlog import CannotResume, SessionLog
from ampd.state.store import REDIS_ERRORS
from ampd.trust import attach_token, new_secret, reattach_token, token_matches
from ampd.v1 import common_pb2, coordinator_pb2, decode_pb2, prefill_pb2
from ampd.validate import stream_message_error, validate_reason
from services.coordinator.admission import Refused
from services.coordinator.core import InvalidArgument, route, turn_kv_tokens, validate_turn

log = structlog.get_logger()

# what a decode worker's Attach stream ends with when another coordinator reattached the session
TAKEN_OVER = "reattached through another coordinator"
BIND_WAIT_S = 15.0  # a moving session waits this long for a live decode worker (one may be restarting)
OPEN_WAIT_S = 3.0  # a new session waits this long for one (then UNAVAILABLE: none is serving)


async def _ignore_failure(reply) -> None:
    """Awaits a request's reply whose failure leaves nothing to do."""
    try:
        await reply
    except Exception:  # noqa: BLE001 - retrieved, so that asyncio does not log it
        pass


class SessionEnd(Exception):
    """The session ends with this gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class SessionRun:
    def __init__(self, svc, sid: str, o: common_pb2.OpenSession, request_iterator, on_open=None,
                 reattach: coordinator_pb2.ReattachSession | None = None) -> None:
        self.svc = svc
        self.on_open = on_open  # awaited once the session is bound (the server sends its headers then)
        self.sid = sid
        self.o = o
        self.requests = request_iterator
        self.log = SessionLog(sid, o.limits)
        self.q: asyncio.Queue = asyncio.Queue()
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
        self.routes: dict[int, tuple[str, str, bool]] = {}
        self.remote: dict[int, str] = {}  # round -> prefill worker its prefill was submitted to
        # The route sent with the client's last turn (decode.proto Route): (round, decision,
        # decide_ms, input ready); the round's first Tokens show it held
        self.ahead: tuple | None = None
        self.deferred: list = []  # bookkeeping that waits until the events in hand went to the client
        self.announce = True  # the next event to the client names the binding
        self.secret = new_secret()  # the session's credential on its decode worker (every request)
        self.closing = False  # the client sent Close: only stop or cancel may follow
        self.cancelled = False  # the client sent Cancel: the worker ends the session, nothing else goes
        # The KV the session may hold (its turns' inputs, outputs and scripted results, one block
        # more): promised to its decode worker by admission while it is bound there.
        self.need = turn_kv_tokens(o.turn, o.limits.max_output_tokens) + svc.block_tokens()
        self.promised_on = ""  # the decode worker holding that promise
        self.admitted = False
        self.arrived = time.monotonic()  # what admission's TTFT budget counts from
        # Reattached (its coordinator was lost): the client's ReattachSession, until the decode
        # worker's state comes; events up to ``replayed`` were in that state (sent, not logged again)
        self.reattach = reattach
        self.replayed = 0
        # Reattached: tokens before this position were in the worker's state, logged from it. The
        # first events after that state can carry some of them again, merged with new ones into one
        # Tokens (the worker's take_events, or _coalesce here): the log counts them once.
        self.logged_to = 0
        self.seq = 0  # the last decode event's number seen (a moved session numbers on after it)
        self.taken_over = False  # another coordinator reattached it: its record is not deleted from here

    # -------------------------------------------------------------------------------- the loop
    async def run(self):
        """The session's events for the client; raises SessionEnd."""
        if self.reattach is not None:
            await self._reattach(self.reattach)
        else:
            self.log.on_turn(self.o.turn)
            await self._bind(decode_pb2.AttachRequest(open=self.o, arrival=time.time()), wait_s=OPEN_WAIT_S)
        if self.on_open is not None:
            await self.on_open()
        reader = self.svc.tasks.spawn(self._read_client())
        try:
            while not self.finished:
                kind, gen, item = await self.q.get()
                if kind == "client":
                    outs = await self._client(item)
                elif gen != self.gen:
                    continue  # from a decode stream already replaced
                elif kind == "opened":
                    self.opened, outs = True, []
                elif kind == "event":
                    if item.HasField("tokens"):
                        self._coalesce(item, gen)
                    seq = item.seq
                    if seq <= self.replayed:  # in the reattached state already: to the client only
                        outs = self._replay(item)
                    else:
                        outs = await self._event(item)
                    if seq:
                        self.seq = seq
                        for out in outs:
                            out.seq = seq
                elif kind == "state":
                    outs = await self._adopt(item)
                elif kind == "error":
                    outs = await self._decode_failed(item)
                elif kind == "fenced":
                    outs = await self._move(item)
                else:
                    outs = await self._move("its stream ended without SessionDone")
                for out in outs:
                    yield out
                while self.deferred:
                    self.deferred.pop(0)()
                while self.held and self.opened and self.reattach is None and not self.finished:
                    for out in await self._client(self.held.pop(0)):
                        yield out
        finally:
            reader.cancel()
            if self.bound and not self.finished and not self.svc.stopping and self.control is not None:
                # Ended here (the client cancelled, or the session failed): the decode worker frees it
                # now. A stream that just ends leaves it there for another coordinator (reattach_grace).
                self._cancel_on_worker("the coordinator ended the session")
            self._unbind()
            self._release()
            self.svc.forget_remote(self)

    def _cancel_on_worker(self, why: str) -> None:
        reply = self.control.send(decode_pb2.ControlRequest(cancel=decode_pb2.CancelRequest(
            session_id=self.sid, reason=why, session_secret=self.secret)), timeout_s=self.svc.call_timeout_s)
        self.svc.tasks.spawn(_ignore_failure(reply))

    def fenced(self, why: str) -> None:
        """The bound decode worker was fenced: the session moves (in order, after the events in hand;
        any later event of that binding is dropped, the move replaces it)."""
        self.q.put_nowait(("fenced", self.gen, why))

    def _coalesce(self, ev: decode_pb2.DecodeEvent, gen: int) -> None:
        """Takes the token events of the same round queued right behind ``ev`` into it: one
        message to the client instead of several (the decode worker's Attach does the same)."""
        queue = self.q._queue  # asyncio.Queue keeps a deque: peek without taking
        while queue and queue[0][0] == "event" and queue[0][1] == gen and merge_tokens(ev, queue[0][2]):
            self.q.get_nowait()

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
    async def _bind(self, req: decode_pb2.AttachRequest, wait_s: float = BIND_WAIT_S) -> None:
        """Binds the session to the decode worker admission gives it (waiting for KV up to
        admission_wait, then RESOURCE_EXHAUSTED: a session is refused before it is accepted, never
        aborted for lack of KV after; --admission slo also refuses a new session that would miss its
        SLO)."""
        svc = self.svc
        deadline = time.monotonic() + wait_s
        self._release()
        while True:
            try:
                self.decode_id = await svc.admission.admit(self.need, svc.rooms, len(self.o.turn.token_ids),
                                                           self.arrived, new=not self.admitted, sid=self.sid)
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
            r = await self._route_ahead(0, 0, len(req.open.turn.token_ids))
            if r is not None:
                req.route.CopyFrom(r)
        req.first_seq = self.seq  # events there are numbered after those seen here
        self.gen += 1
        self.call = svc.stubs.decode(self.info.address, self.info.nixl_agent).Attach(req)
        self.pump = self.svc.tasks.spawn(self._pump(self.call, self.gen))
        self.bound, self.opened, self.announce = True, False, True
        # the secret: another coordinator reattaches the session with it when this one is lost
        svc.record(self.sid, {"decode_worker": self.decode_id, "round": req.resume.round, "moves": self.log.moves,
                              "secret": self.secret})

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
            return await self._move(exc.details())
        if code == grpc.StatusCode.ABORTED and TAKEN_OVER in (exc.details() or ""):
            # another coordinator serves it now: it is not cancelled from here, and its record and KV
            # promise are that coordinator's
            self.bound, self.taken_over, self.promised_on = False, True, ""
            raise SessionEnd(grpc.StatusCode.UNAVAILABLE, f"the session moved to another coordinator: {exc.details()}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise SessionEnd(code, exc.details())
        raise SessionEnd(code if code != grpc.StatusCode.UNKNOWN else grpc.StatusCode.INTERNAL,
                         f"decode worker {self.decode_id}: {exc.details()}")

    async def _move(self, why: str) -> list:
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
            outs.append(self._out(turn_end=self.log.turn_end()))
            state = "idle"
        if state == "idle":
            self.opened = True  # nothing to wait for: the next client message binds it again
            return outs
        try:
            await self._bind(self.log.resume())
        except CannotResume as exc:
            raise SessionEnd(grpc.StatusCode.UNAVAILABLE, f"decode worker {lost} lost ({why}); {exc}") from None
        return outs

    # ------------------------------------------------------------------------ client messages
    async def _client(self, msg) -> list:
        if (self.bound and not self.opened) or self.reattach is not None:  # (its state first)
            self.held.append(msg)
            return []
        kind = "close" if msg is None else msg.WhichOneof("msg")
        if msg is not None:
            try:
                error = stream_message_error(kind, self.closing)
                if error:
                    raise InvalidArgument(error)
                if kind == "turn":
                    validate_turn(msg.turn, "turn", self.svc.script_tools)
                elif kind == "cancel":
                    validate_reason(msg.cancel.reason, "cancel.reason")
            except InvalidArgument as exc:
                code = grpc.StatusCode.FAILED_PRECONDITION if self.closing else grpc.StatusCode.INVALID_ARGUMENT
                raise SessionEnd(code, str(exc)) from None
        if self.cancelled:  # (a Close or Stop after it would find the session gone there and move it)
            return []
        if kind == "turn":
            more = turn_kv_tokens(msg.turn, self.o.limits.max_output_tokens)
            self.need += more  # accepted sessions are not refused: their later turns are promised too
            if self.promised_on:
                self.svc.admission.add(self.promised_on, more, self.sid)
            if not self.bound:
                return await self._resume_with(msg.turn)
            r = await self._route_ahead(self.log.next_round, *self.log.expected_sizes(msg.turn))
            ok = await self._control(decode_pb2.ControlRequest(turn=decode_pb2.TurnRequest(
                session_id=self.sid, turn=msg.turn, session_secret=self.secret, route=r)))
            self.log.on_turn(msg.turn)  # accepted, or the worker is gone with it (the move runs it)
            return [] if ok else await self._move("its control stream failed")
        if kind == "close":
            self.closing = True
            if not self.bound:
                return [self._done(common_pb2.SessionDone())]
            ok = await self._control(decode_pb2.ControlRequest(close=decode_pb2.CloseRequest(
                session_id=self.sid, session_secret=self.secret)), ignore=grpc.StatusCode.FAILED_PRECONDITION)
            if ok:
                return []
            outs = await self._move("its control stream failed")
            if not self.bound and not self.finished:  # it was between turns: nothing more comes
                outs.append(self._done(common_pb2.SessionDone()))
            return outs
        if kind == "stop":  # the current turn's decoding ends at its next token; nothing between turns
            if self.bound:
                await self._control(decode_pb2.ControlRequest(stop=decode_pb2.StopRoundRequest(
                    session_id=self.sid, session_secret=self.secret)), ignore=grpc.StatusCode.FAILED_PRECONDITION)
            return []
        if kind == "cancel":
            if not self.bound:
                raise SessionEnd(grpc.StatusCode.CANCELLED, f"cancelled: {msg.cancel.reason}" if msg.cancel.reason
                                 else "cancelled")
            self.cancelled = True
            await self._control(decode_pb2.ControlRequest(cancel=decode_pb2.CancelRequest(
                session_id=self.sid, reason=msg.cancel.reason, session_secret=self.secret)))
            return []
        raise AssertionError(kind)  # stream_message_error refused every other kind

    async def _resume_with(self, turn: common_pb2.Turn) -> list:
        try:
            req = self.log.resume(turn)
        except CannotResume as exc:
            raise SessionEnd(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        await self._bind(req)
        return []

    async def _control(self, req, ignore: grpc.StatusCode | None = None) -> bool:
        """Sends ``req`` on the bound worker's control stream. False: the worker is unreachable, or
        stopped (no answer within the fence bound, or fenced: its stream closed, CANCELLED)."""
        try:
            await self.control.call(req, timeout_s=self.svc.call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND):
                # NOT_FOUND: the session is not open on the worker (it restarted, or dropped it when
                # fenced): the session moves, as when the worker is unreachable
                return False
            if exc.code() != ignore:
                raise SessionEnd(exc.code(), exc.details()) from None
        return True

    # ------------------------------------------------------------------------- decode events
    def _out(self, **event) -> coordinator_pb2.SessionEvent:
        out = coordinator_pb2.SessionEvent(session_id=self.sid, **event)
        if self.announce:
            out.decode_worker = self.decode_id
            out.reattach_token = reattach_token(self.secret)
            self.announce = False
        return out

    # ------------------------------------------------------------------------------ reattaching
    async def _reattach(self, r: coordinator_pb2.ReattachSession) -> None:
        """Takes the session over from its lost coordinator (coordinator.proto ReattachSession): its
        decode worker and secret from its record in Redis, its state from the worker (Reattach)."""
        svc = self.svc
        try:
            rec = await asyncio.wait_for(svc.store.session_record(self.sid), svc.call_timeout_s)
        except (asyncio.TimeoutError, *REDIS_ERRORS) as exc:
            raise SessionEnd(grpc.StatusCode.UNAVAILABLE, f"reattach: the session's record is out of reach: "
                                                          f"{exc or type(exc).__name__}") from None
        self.rec = rec
        secret, wid = rec.get("secret", ""), rec.get("decode_worker", "")
        if not secret or not wid:
            raise SessionEnd(grpc.StatusCode.NOT_FOUND, f"reattach: no session {self.sid!r} to reattach")
        if not token_matches(reattach_token(secret), r.reattach_token):
            raise SessionEnd(grpc.StatusCode.PERMISSION_DENIED, "reattach.reattach_token: not the session's")
        info = svc.cluster.infos.get(wid)
        if info is None:
            raise SessionEnd(grpc.StatusCode.NOT_FOUND, f"reattach: its decode worker {wid} is gone")
        svc.counters["sessions_reattached"] += 1
        self.secret, self.decode_id, self.info = secret, wid, info
        self.control = svc.stubs.control(info.address, info.nixl_agent)
        self.gen += 1
        self.call = svc.stubs.decode(info.address, info.nixl_agent).Reattach(decode_pb2.ReattachRequest(
            session_id=self.sid, session_secret=secret, after_seq=r.after_seq,
            attach_token=attach_token(bytes.fromhex(info.task_key), self.sid, wid, secret)))
        self.pump = self.svc.tasks.spawn(self._pump(self.call, self.gen))
        self.bound, self.opened, self.announce = True, False, True
        svc.record(self.sid, {"decode_worker": wid})  # this coordinator's now
        log.info("session reattached", session=self.sid, decode_worker=wid, after_seq=r.after_seq)

    async def _adopt(self, st: decode_pb2.SessionState) -> list:
        """The reattached session's state from its decode worker: this coordinator's record of it,
        its KV promised here, and what its lost coordinator may not have passed on done now."""
        r, self.reattach = self.reattach, None
        svc = self.svc
        self.log = SessionLog.from_state(self.sid, st)
        self.o = common_pb2.OpenSession(session_id=self.sid, limits=st.limits)
        self.replayed = self.seq = st.seq
        self.logged_to = len(st.history)
        self.admitted = True
        # the promise its lost coordinator made stays (it is in the session's record), else a new one
        promised = int(self.rec.get("promised", 0) or 0)
        self.need = promised or len(st.history) + svc.block_tokens() + (
            turn_kv_tokens(st.turn, st.limits.max_output_tokens) if st.HasField("turn") else 0)
        svc.admission.add(self.decode_id, self.need, self.sid, shared=not promised)
        self.promised_on = self.decode_id
        # the client's last turn, which its lost coordinator never passed on; then what it sent after
        if r.turns > st.turns and r.HasField("turn"):
            self.held.insert(0, coordinator_pb2.ClientMessage(turn=r.turn))
        if st.HasField("unrouted"):  # its prefill_task may never have been routed: route it now
            self.log.on_prefill_task(st.unrouted)
            await self._route(st.unrouted)
        return []

    def _replay(self, ev: decode_pb2.DecodeEvent) -> list:
        """An event the reattached state already holds, which the client may not have seen."""
        kind = ev.WhichOneof("event")
        if kind == "prefill_task" or kind is None:
            return []
        if kind == "done":
            return [self._done(ev.done)]
        if kind == "round_end":
            self._annotate(ev.round_end.timing)
        return [self._out(**{kind: getattr(ev, kind)})]

    def _done(self, done: common_pb2.SessionDone) -> coordinator_pb2.SessionEvent:
        del done.rounds[:]
        for t in self.log.rounds():  # every round, the ones made on a lost worker too
            self._annotate(t)
            done.rounds.append(t)
        self.finished = True
        return self._out(done=done)

    async def _event(self, ev: decode_pb2.DecodeEvent) -> list:
        self.opened = True
        kind = ev.WhichOneof("event")
        lg = self.log
        if kind == "prefill_task":
            lg.on_prefill_task(ev.prefill_task)
            await self._route(ev.prefill_task)
            return []
        if kind == "tokens":
            ahead = self.ahead
            if ahead is not None and ahead[0] == ev.tokens.round:  # its route held: no prefill_task came
                self.ahead = None
                lg.on_round_start(ev.tokens.round, ahead[3])
                # its record and log line once the first tokens are on their way to the client
                self.deferred.append(lambda: self._routed(ev.tokens.round, ahead[1], ahead[2]))
                counters = self.svc.counters
                counters[f"route_{ahead[1].reason}"] += 1
                counters["prefills_local" if ahead[1].local else "prefills_remote"] += 1
                counters["prefills_routed_with_turn"] += 1
            lg.on_tokens(self._unlogged(ev.tokens))
            self.svc.forget_remote(self, ev.tokens.round)
            return [self._out(tokens=ev.tokens)]
        if kind == "tool_call":
            lg.on_tool_call(ev.tool_call)
            return [self._out(tool_call=ev.tool_call)]
        if kind == "turn_end":
            lg.on_turn_end()
            return [self._out(turn_end=ev.turn_end)]
        if kind == "round_end":
            t = ev.round_end.timing
            lg.on_round_end(t)
            self._annotate(t)
            if tracing.on:
                tracing.round_span(self.sid, t)
            self.svc.rounds.observe(t)
            return [self._out(round_end=ev.round_end)]
        if kind == "done":
            return [self._done(ev.done)]
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
        if t.round in self.routes:
            t.route_reason = self.routes[t.round][1]

    # ------------------------------------------------------------------------------- routing
    async def _decide(self, rnd: int, l_hist: int, l_incr: int, input_ready: float):
        """(Algorithm 1's decision or None, ms it took) for the round on the cluster's view now."""
        svc = self.svc
        t0 = time.perf_counter()
        view = await svc.cluster.view()
        svc.route_read_ms_total += view.read_s * 1e3
        req = PrefillTask(self.sid, rnd, l_hist, l_incr, input_ready, self.decode_id, self.info.tp)
        try:
            now = time.time()
            decision = route(svc.router, view, req, now)
            svc.cluster.routed(view, req, decision, now)
        except LookupError:  # the bound worker left routing meanwhile: its stream says what happened
            decision = None
        took = time.perf_counter() - t0
        if tracing.on and decision is not None:
            end = time.time()
            tracing.route_span(self.sid, rnd, decision, end - took, end, l_hist, l_incr)
        return decision, took * 1e3

    async def _route_ahead(self, rnd: int, l_hist: int, l_incr: int) -> decode_pb2.Route | None:
        """Routes the first round of a client's turn as the turn goes to the decode worker, for the
        sizes it will have there if it holds the session's KV (decode.proto Route): the worker then
        starts a local prefill, or submits a remote one to its prefill worker, without a round trip
        through here. The decision is Algorithm 1's on the view it would read a moment later, when
        the worker's prefill_task came."""
        self._drop_ahead()
        now = time.time()
        decision, decide_ms = await self._decide(rnd, l_hist, l_incr, now)
        if decision is None:
            return None
        self.ahead = (rnd, decision, decide_ms, now)
        if not decision.local:  # the decode worker submits it: a lost prefill worker's rounds re-route
            self.remote[rnd] = decision.target
            self.svc.remember_remote(self, decision.target, rnd)
        return decode_pb2.Route(l_hist=l_hist, l_incr=l_incr,
                                prefill_worker="" if decision.local else decision.target)

    def _drop_ahead(self) -> None:
        """The route sent with the turn did not hold (the worker asked with a prefill_task)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and not ahead[1].local:
            self.svc.forget_remote(self, ahead[0])

    async def _route(self, need: common_pb2.PrefillTask) -> None:
        svc, sid, decode_id = self.svc, self.sid, self.decode_id
        self._drop_ahead()
        decision, decide_ms = await self._decide(need.round, need.l_hist, need.l_incr, need.input_ready)
        if decision is None:
            await self._local(need.round, "fallback-local")
            return
        svc.counters[f"route_{decision.reason}"] += 1  # the decision's own reason, a fallback's too
        if not decision.local:
            target = svc.cluster.infos.get(decision.target)
            try:
                # The task goes on as the decode worker sent it, bound to the worker this
                # coordinator bound the session to.
                need.session_id, need.decode_worker, need.decode_tp = sid, decode_id, self.info.tp
                self.remote[need.round] = decision.target
                svc.remember_remote(self, decision.target, need.round)
                await svc.stubs.submit(target.address, target.nixl_agent).call(prefill_pb2.SubmitRequest(task=need),
                                                                               timeout_s=svc.call_timeout_s)
                svc.counters["prefills_remote"] += 1
            except (grpc.aio.AioRpcError, AttributeError) as exc:
                # A prefill worker that vanished must not lose the round: run it locally.
                log.warning("remote prefill submit failed; running locally", session=sid,
                            target=decision.target, error=str(exc))
                svc.forget_remote(self, need.round)
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (grpc.StatusCode.UNAVAILABLE,
                                                                             grpc.StatusCode.DEADLINE_EXCEEDED):
                    svc.cluster.mark_lost(decision.target)
                svc.counters["route_fallback-local"] += 1
                decision = decision.__class__(decode_id, True, "fallback-local", decision.estimates)
        if decision.local:
            await self._local(need.round, decision.reason)
        self._routed(need.round, decision, decide_ms)

    def _routed(self, rnd: int, decision, decide_ms: float) -> None:
        """Round ``rnd``'s prefill went where ``decision`` says (after fallbacks)."""
        self.routes[rnd] = (decision.target, decision.reason, decision.local)
        # (no Redis write a round: the session's record holds what a move or a reattach needs, its
        # binding; a write a round took ~5% of the coordinator's CPU, benchmarks/coordinator_capacity.py)
        log.info("route", session=self.sid, round=rnd, target=decision.target, local=decision.local,
                 reason=decision.reason, decide_ms=round(decide_ms, 3),
                 **{k: round(v, 4) for k, v in decision.estimates.items()})

    async def _local(self, rnd: int, reason: str) -> None:
        """The round's prefill runs on the bound decode worker."""
        try:
            await self.control.call(decode_pb2.ControlRequest(local_prefill=decode_pb2.RouteInfo(
                session_id=self.sid, round=rnd, reason=reason, session_secret=self.secret)),
                timeout_s=self.svc.call_timeout_s)
            self.svc.counters["prefills_local"] += 1
        except grpc.aio.AioRpcError as exc:  # the worker is gone (its stream says so) or the round is
            log.warning("local prefill refused", session=self.sid, round=rnd, error=exc.details())

    async def reroute(self, rnd: int, lost: str) -> None:
        """The prefill worker running round ``rnd``'s prefill is lost: the decode worker, which still
        holds the KV it reserved for it, runs it instead (refused if it got the result meanwhile)."""
        if self.remote.get(rnd) != lost or self.control is None:
            return
        del self.remote[rnd]
        self.svc.counters["prefills_rerouted"] += 1
        log.warning("prefill worker lost; running the prefill on the decode worker", session=self.sid,
                    round=rnd, prefill_worker=lost)
        await self._local(rnd, "rerouted")
        if rnd in self.routes:
            self.routes[rnd] = (self.decode_id, "rerouted", True)
