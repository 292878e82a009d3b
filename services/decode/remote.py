"""The decode worker's remote prefills: a round's prefill task goes to a prefill worker (directly
when the coordinator's route holds, else through the coordinator), the round waits for its NIXL
notification, and the blocks of a session that ended meanwhile stay held until the prefill worker
is done with them."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc
import structlog

from ampd.agenthints import turn_queue_yield_s
from ampd.kv import verify_pattern
from ampd.stubs import Stubs
from ampd.trust import task_token, token_matches
from ampd.v1 import common_pb2, decode_pb2, prefill_pb2
from services.decode.kvwhere import send_fields
from services.decode.session import emit, REMOTE_HOLD_S, Session, SessionError, add_segments

if TYPE_CHECKING:
    from services.decode.worker import DecodeWorker

log = structlog.get_logger()


class RemotePrefills:
    """The rounds waiting for a remote prefill (``awaiting``), the blocks held for prefill workers
    of ended sessions (``held``), and the notification listener (``start``/``stop``)."""

    def __init__(self, w: DecodeWorker) -> None:
        self.w = w
        self.awaiting: dict[tuple[str, int], Session] = {}
        # sessions ended while a prefill worker may still write their round's blocks: the blocks
        # stay reserved until its PrefillDone comes (or REMOTE_HOLD_S passes), so no other session
        # gets them meanwhile
        self.held: dict[tuple[str, int], Session] = {}
        # to the prefill workers routed prefills go to; a broken stream to one runs its rounds here
        self.stubs = Stubs(self._lost)
        self._submits: set[asyncio.Task] = set()  # submits of routed prefills in flight
        self.notifs = None
        # how long a round waits for its remote prefill's notification (beyond the prefill's own
        # compute time) before it runs here instead
        self.wait_s = 2 * w.rt.cfg.fence_after_s

    def start(self) -> None:
        self.notifs = self.w.rt.transport.listen(lambda _peer, msg: self.on_done(msg),
                                                 pending=lambda: bool(self.awaiting or self.held))

    async def stop(self) -> None:
        submits = list(self._submits)
        for t in submits:
            t.cancel()
        await asyncio.gather(*submits, return_exceptions=True)
        if self.notifs is not None:
            await self.notifs.stop()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._submits.add(task)
        task.add_done_callback(self._submits.discard)

    def waiting(self, s: Session, rnd: int) -> bool:
        """The session's round ``rnd`` waits for its remote prefill."""
        return self.awaiting.get((s.session_id, rnd)) is s

    def take(self, session_id: str, rnd: int) -> Session | None:
        """The round stops waiting for its remote prefill (it runs here): its session, or None."""
        return self.awaiting.pop((session_id, rnd), None)

    def hold(self, s: Session, remote: bool) -> bool:
        """The session ended (``remote``: while its round waited for a remote prefill): True when a
        prefill worker may still write its blocks, which then stay held until it reports (or a
        bound passes), else False (the caller frees them). A round whose task never reached a
        prefill worker (unrouted: its coordinator was lost, or the session was cancelled first) has
        no writer to wait for."""
        if not ((remote and s.task_token and s.submitted_to) or s.overdue is not None):
            return False
        key = (s.session_id, s.round) if remote else s.overdue[0]
        if not remote:
            s.task_token = s.overdue[1]
        self.held[key] = s
        self.w.metrics["kv_held_for_remote"] += 1
        asyncio.get_running_loop().call_later(REMOTE_HOLD_S if remote else self.wait_s, self.release_held, key)
        return True

    def fenced(self) -> None:
        """A prefill worker that dropped this worker from its peers while it was out of the registry
        cannot report on the blocks held for it (nor write them): they go after the remote wait,
        not REMOTE_HOLD_S."""
        loop = asyncio.get_running_loop()
        for key in list(self.held):
            loop.call_later(self.wait_s, self.release_held, key)

    def send(self, s: Session, rnd: int, routed: bool) -> None:
        """The round's prefill runs on a prefill worker: its task goes to the one routed (``routed``:
        the coordinator's route holds), else to the coordinator, which routes it (a prefill_task
        event). The round waits for its notification (``on_done``), at most ``wait_s`` plus the
        prefill's own time here (then it runs here: overdue)."""
        w = self.w
        task = common_pb2.PrefillTask(
            session_id=s.session_id, round=rnd, l_hist=s.l_hist, l_incr=s.l_incr, input_ready=s.input_ready,
            decode_worker=w.rt.cfg.worker_id, decode_tp=w.rt.cfg.tp,
            token_ids=s.tokens[s.l_hist:], sampling=s.params,
            history_token_ids=s.tokens[:s.l_hist] if w.token_ids else (), prefix_tokens=s.prefix_tokens,
            queue_yield_s=turn_queue_yield_s(s.turn), **send_fields(w, s, rnd, time.time()),
        )
        s.submitted_to = ""  # (this round's task is not with a prefill worker yet)
        hr = w.tier.reads.get(s) if w.tier is not None else None  # on host: read from there (hostread.py)
        history = s.kv.segments(0, s.l_hist) if hr is None else hr.src
        if hr is not None:
            task.history_on_host = True
            w.tier.reads.sent(hr)
        add_segments(task.history, history)
        add_segments(task.dest, s.dest)
        # the blocks just reserved may be written by a prefill worker with this token only
        task.task_token = s.task_token = task_token(w.rt.task_key, task, history, s.dest)
        self.awaiting[(s.session_id, rnd)] = s
        self.notifs.arm()
        # its bound: the remote wait, plus what the prefill would take here (a long one is not overdue)
        wait = self.wait_s + w.core.cost.t_pre(w.core.tp, s.l_hist, s.l_incr)
        asyncio.get_running_loop().call_later(wait, self._overdue, s, rnd, wait)
        if routed:  # its remote route holds: the task goes to that prefill worker from here, now
            self._submit(s, task, s.route.prefill_worker)
        else:
            s.unrouted = task
            emit(s, decode_pb2.DecodeEvent(prefill_task=task))

    def run_here(self, s: Session, rnd: int) -> None:
        """The round's prefill runs here after all (the coordinator routed it here, or its prefill
        worker handed it back). A host copy its task named goes now unless the task was submitted
        to a prefill worker: then it stays until that worker reports or ``REMOTE_HOLD_S`` after the
        fetch (hostread.py), as held device blocks do (one fenced while it was stopped may still
        read it once it runs again)."""
        if s.round != rnd or not self.waiting(s, rnd):
            raise SessionError(f"session {s.session_id!r} round {rnd} is not waiting for a prefill")
        self.take(s.session_id, rnd)
        if not s.submitted_to:
            self._read_host(s.session_id, rnd)
        self.w.queue_local(s)

    def routed(self, s: Session, rnd: int, target: str) -> None:
        """The coordinator routed the round's prefill_task to prefill worker ``target``
        (ControlRequest.remote_prefill): it goes there from here."""
        if s.round != rnd or not self.waiting(s, rnd) or s.unrouted is None:
            raise SessionError(f"session {s.session_id!r} round {rnd} is not waiting for a route")
        task, s.unrouted = s.unrouted, None
        self._submit(s, task, target)

    def _submit(self, s: Session, task: common_pb2.PrefillTask, target: str) -> None:
        info = self.w.rt.peers.get(target)
        # sent now when the prefill worker is known here (else once its registration is read)
        reply = self._send(s, task, info) if info is not None else None
        self._spawn(self._submitted(s, task, target, reply))

    def _send(self, s: Session, task: common_pb2.PrefillTask, info):
        s.submitted_to = info.address
        return self.stubs.submit(info.address, info.nixl_agent).send(prefill_pb2.SubmitRequest(task=task))

    def _lost(self, address: str) -> None:
        """The call stream to the prefill worker at ``address`` broke (it died or restarted): the
        rounds submitted there from here and not reported run here, at once, not at their overdue
        bound (no coordinator sees this stream)."""
        w = self.w
        for (sid, rnd), s in list(self.awaiting.items()):
            if s.submitted_to == address and not s.closed:
                log.warning("prefill worker lost; running the prefill here", session=sid, round=rnd, address=address)
                self.take(sid, rnd)
                w.metrics["prefills_rerouted"] += 1
                w.queue_local(s)

    async def _submitted(self, s: Session, task: common_pb2.PrefillTask, target: str, reply) -> None:
        """The answer to a routed remote prefill's submit; one that could not be submitted goes to
        the coordinator as a plain prefill_task, which routes it again (and runs it here if its
        prefill worker is gone)."""
        try:
            if reply is None:  # registered since this worker's last peer sync, or not at all
                try:
                    await self.w.rt.ensure_peer(target)
                except Exception as exc:  # noqa: BLE001 - not registered, or Redis away: not known here
                    raise LookupError(f"prefill worker {target!r} is not known here ({exc})") from None
                if s.closed or self.awaiting.get((s.session_id, task.round)) is not s:
                    return  # ended (or run here) meanwhile: its blocks are not held for a writer
                reply = self._send(s, task, self.w.rt.peers[target])
            await reply
        except (grpc.aio.AioRpcError, LookupError) as exc:
            log.warning("routed prefill submit failed; asking the coordinator", session=s.session_id,
                        round=task.round, target=target, error=exc.details() if isinstance(exc, grpc.aio.AioRpcError)
                        else str(exc))
            if not s.closed and self.awaiting.get((s.session_id, task.round)) is s:
                s.unrouted = task
                emit(s, decode_pb2.DecodeEvent(prefill_task=task))

    def _overdue(self, s: Session, rnd: int, waited_s: float) -> None:
        """The round's remote prefill did not report within ``remote_wait_s`` plus its own compute
        time here (its prefill worker stopped, or its notification was lost): the round runs here,
        into the KV reserved for it.
        Should the prefill worker still write it (the same KV), the blocks stay held when the
        session ends until it reports, at most ``remote_wait_s`` more."""
        w = self.w
        key = (s.session_id, rnd)
        if self.awaiting.get(key) is not s or s.closed:
            return
        del self.awaiting[key]
        if s.submitted_to:  # (a prefill worker may still write its blocks)
            s.overdue = (key, s.task_token)
        log.warning("remote prefill overdue; running it locally", session=s.session_id, round=rnd,
                    waited_s=round(waited_s, 3))
        w.metrics["prefills_overdue"] += 1
        w.queue_local(s)

    def _read_host(self, session_id: str, rnd: int) -> bool:
        """No prefill worker reads the round's history from host (any more; hostread.py). True when
        the worker has a host tier."""
        tier = self.w.tier
        if tier is not None:
            tier.reads.remote_ended(session_id, rnd)
        return tier is not None

    def release_held(self, key: tuple[str, int]) -> None:
        w = self.w
        s = self.held.pop(key, None)
        if s is not None:
            s.kv.release(w.rt.pool)
            w.rt.changed()
            w.kv.admit_waiting()

    def on_done(self, msg: bytes) -> None:
        """A prefill worker's NIXL notification (its PrefillDone): the round's first token, or it
        runs here (the prefill worker could not do it), or held blocks go."""
        w = self.w
        done = prefill_pb2.PrefillDone()
        try:
            done.ParseFromString(msg)
        except Exception:
            log.warning("unparseable NIXL notification", size=len(msg))
            return
        key = (done.session_id, done.round)
        s = self.awaiting.pop(key, None)
        if s is None:
            held = self.held.get(key)
            live = w.sessions.get(done.session_id)
            if held is not None and token_matches(held.task_token, done.task_token):
                self._read_host(done.session_id, done.round)
                self.release_held(key)  # the prefill worker is done with the ended session's blocks
            elif live is not None and live.overdue is not None and live.overdue[0] == key \
                    and token_matches(live.overdue[1], done.task_token):
                live.overdue = None  # the overdue prefill reported after all: its blocks are free to go
            else:
                log.warning("prefill done for an unknown session", session=done.session_id, round=done.round)
            return
        if not token_matches(s.task_token, done.task_token):
            self.awaiting[(done.session_id, done.round)] = s  # not its task's: keep waiting
            log.warning("prefill done with a wrong task token", session=done.session_id, round=done.round)
            return
        if self._read_host(done.session_id, done.round) and w.tier.reads.after_fetch(s, lambda: self.on_done(msg)):
            self.awaiting[key] = s  # its history is still coming back from host: done once it is
            return
        if done.error:
            # The prefill worker could not do it (shutting down, a transfer failed): the reserved KV
            # is still here, so the round runs locally instead of failing the session.
            log.warning("remote prefill failed; running it locally", session=s.session_id, round=done.round,
                        prefill_worker=done.prefill_worker, error=done.error)
            w.metrics["prefills_rerouted"] += 1
            self.awaiting[(done.session_id, done.round)] = s
            w.local_prefill(done.session_id, done.round, s.secret)
            return
        if w.engine.capabilities.patterned_kv:  # the mock's KV is a function of (session, position): check it
            data = w.rt.pool.read(s.dest, copy=False)  # only compared: a view when it is one run
            bad = verify_pattern(s.session_id, s.l_hist, data, w.rt.pool.layout.bytes_per_token, s.prefix_tokens)
            w.metrics["kv_bytes_verified"] += data.size
            w.metrics["kv_bytes_mismatched"] += bad
            if bad:
                w.fail(s, f"KV written by {done.prefill_worker} has {bad} wrong bytes")
                return
        if w.tier is not None and w.tier.reads.redo(s):  # its history's fetch from host failed
            return
        w.metrics["prefills_remote"] += 1
        w.first_token(s, done.first_token, time.time(), False, done.prefill_worker)
