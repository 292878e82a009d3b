"""A session taken over from its lost coordinator (coordinator.proto ReattachSession): its decode
worker and secret from its record in Redis, its state from the worker (DecodeWorker.Reattach)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
import structlog

from ampd.sessionlog import SessionLog
from ampd.state.store import REDIS_ERRORS
from ampd.trust import attach_token, reattach_token, token_matches
from ampd.v1 import common_pb2, coordinator_pb2, decode_pb2
from services.coordinator.core import turn_kv_tokens
from services.coordinator.errors import SessionEnd

if TYPE_CHECKING:
    from services.coordinator.session import SessionRun

log = structlog.get_logger()


class Reattach:
    """The client's ReattachSession (``request``) and the session's record, until the decode worker's
    state comes (``SessionRun.reattach`` is this object until then, None after)."""

    __slots__ = ("run", "request", "rec")

    def __init__(self, run: SessionRun, request: coordinator_pb2.ReattachSession) -> None:
        self.run = run
        self.request = request
        self.rec: dict = {}

    async def start(self) -> None:
        """Binds the session to its decode worker from its record, and asks the worker for its state."""
        run, r = self.run, self.request
        svc = run.svc
        try:
            rec = await asyncio.wait_for(svc.store.session_record(run.sid), svc.call_timeout_s)
        except (asyncio.TimeoutError, *REDIS_ERRORS) as exc:
            raise SessionEnd(grpc.StatusCode.UNAVAILABLE, f"reattach: the session's record is out of reach: "
                                                          f"{exc or type(exc).__name__}") from None
        self.rec = rec
        secret, wid = rec.get("secret", ""), rec.get("decode_worker", "")
        if not secret or not wid:
            raise SessionEnd(grpc.StatusCode.NOT_FOUND, f"reattach: no session {run.sid!r} to reattach")
        if not token_matches(reattach_token(secret), r.reattach_token):
            raise SessionEnd(grpc.StatusCode.PERMISSION_DENIED, "reattach.reattach_token: not the session's")
        info = svc.cluster.infos.get(wid)
        if info is None:
            raise SessionEnd(grpc.StatusCode.NOT_FOUND, f"reattach: its decode worker {wid} is gone")
        svc.counters["sessions_reattached"] += 1
        run.secret, run.decode_id, run.info = secret, wid, info
        run.control = svc.stubs.control(info.address, info.nixl_agent)
        run.attach(svc.stubs.decode(info.address, info.nixl_agent).Reattach(decode_pb2.ReattachRequest(
            session_id=run.sid, session_secret=secret, after_seq=r.after_seq,
            attach_token=attach_token(bytes.fromhex(info.task_key), run.sid, wid, secret))))
        svc.record(run.sid, {"decode_worker": wid})  # this coordinator's now
        log.info("session reattached", session=run.sid, decode_worker=wid, after_seq=r.after_seq)

    async def adopt(self, st: decode_pb2.SessionState) -> list:
        """The reattached session's state from its decode worker: this coordinator's record of it,
        its KV promised here, and what its lost coordinator may not have passed on done now."""
        run, r = self.run, self.request
        run.reattach = None
        svc = run.svc
        run.log = SessionLog.from_state(run.sid, st)
        run.o = common_pb2.OpenSession(session_id=run.sid, limits=st.limits, prefix_scope=st.prefix_scope)
        run.replayed = run.seq = st.seq
        run.logged_to = len(st.history)
        run.admitted = True
        # the promise its lost coordinator made stays (it is in the session's record), else a new one
        promised = int(self.rec.get("promised", 0) or 0)
        run.need = promised or len(st.history) + svc.block_tokens() + (
            turn_kv_tokens(st.turn, st.limits.max_output_tokens) if st.HasField("turn") else 0)
        svc.admission.add(run.decode_id, run.need, run.sid, shared=not promised)
        run.promised_on = run.decode_id
        # the client's last turn, which its lost coordinator never passed on; then what it sent after
        if r.turns > st.turns and r.HasField("turn"):
            run.held.insert(0, coordinator_pb2.ClientMessage(turn=r.turn))
        if st.HasField("unrouted"):  # its prefill_task may never have been routed: route it now
            run.log.on_prefill_task(st.unrouted)
            await run.routing.route(st.unrouted)
        return []


def cancel_stale_copy(run: SessionRun, worker: str, secret: str) -> None:
    """A copy of the new session ``run``, left on ``worker`` by a lost coordinator (its client opened
    the session again here before it learnt the reattach token), is cancelled there now: it would
    hold its KV for --reattach-grace (ampd.state.promises)."""
    svc = run.svc
    info = svc.cluster.infos.get(worker)
    if info is None:
        return  # (that worker is gone, and the copy with it)
    svc.counters["sessions_replaced"] += 1
    log.info("cancelling the copy a lost coordinator left", session=run.sid, decode_worker=worker)
    svc.stubs.control(info.address, info.nixl_agent).post(decode_pb2.ControlRequest(
        cancel=decode_pb2.CancelRequest(session_id=run.sid, reason="opened again through another coordinator",
                                        session_secret=secret)))
