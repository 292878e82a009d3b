"""What a client's message does to its session on the coordinator: validated, then sent to the
session's decode worker as a Control request (a turn, with its first round routed ahead; a close, a
stop, a cancel), or held until the worker has opened the session."""
from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from ampd.sessionlog import CannotResume
from ampd.v1 import common_pb2, decode_pb2
from ampd.validate import stream_message_error, validate_reason
from services.coordinator.core import InvalidArgument, turn_kv_tokens, validate_turn
from services.coordinator.errors import SessionEnd

if TYPE_CHECKING:
    from services.coordinator.session import SessionRun


class ClientMessages:
    """The client side of one ``SessionRun``."""

    __slots__ = ("run",)

    def __init__(self, run: SessionRun) -> None:
        self.run = run

    async def handle(self, msg) -> list:
        """What the client's message ``msg`` (None: its stream half-closed) does; the events for it."""
        run = self.run
        if (run.bound and not run.opened) or run.reattach is not None:  # (its state first)
            run.held.append(msg)
            return []
        kind = "close" if msg is None else msg.WhichOneof("msg")
        if msg is not None:
            try:
                error = stream_message_error(kind, run.closing)
                if error:
                    raise InvalidArgument(error)
                if kind == "turn":
                    validate_turn(msg.turn, "turn", run.svc.script_tools)
                elif kind == "cancel":
                    validate_reason(msg.cancel.reason, "cancel.reason")
            except InvalidArgument as exc:
                code = grpc.StatusCode.FAILED_PRECONDITION if run.closing else grpc.StatusCode.INVALID_ARGUMENT
                raise SessionEnd(code, str(exc)) from None
        if run.cancelled:  # (a Close or Stop after it would find the session gone there and move it)
            return []
        if kind == "turn":
            more = turn_kv_tokens(msg.turn, run.o.limits.max_output_tokens)
            run.need += more  # accepted sessions are not refused: their later turns are promised too
            if run.promised_on:
                run.svc.admission.add(run.promised_on, more, run.sid)
            if not run.bound:
                return await self._resume_with(msg.turn)
            r = await run.routing.route_ahead(run.log.next_round, *run.log.expected_sizes(msg.turn))
            ok = await self._control(decode_pb2.ControlRequest(turn=decode_pb2.TurnRequest(
                session_id=run.sid, turn=msg.turn, session_secret=run.secret, route=r)))
            run.log.on_turn(msg.turn)  # accepted, or the worker is gone with it (the move runs it)
            return [] if ok else await run.move("its control stream failed")
        if kind == "close":
            run.closing = True
            if not run.bound:
                return [run.session_done(common_pb2.SessionDone())]
            ok = await self._control(decode_pb2.ControlRequest(close=decode_pb2.CloseRequest(
                session_id=run.sid, session_secret=run.secret)), ignore=grpc.StatusCode.FAILED_PRECONDITION)
            if ok:
                return []
            outs = await run.move("its control stream failed")
            if not run.bound and not run.finished:  # it was between turns: nothing more comes
                outs.append(run.session_done(common_pb2.SessionDone()))
            return outs
        if kind == "stop":  # the current turn's decoding ends at its next token; nothing between turns
            if run.bound:
                await self._control(decode_pb2.ControlRequest(stop=decode_pb2.StopRoundRequest(
                    session_id=run.sid, session_secret=run.secret)), ignore=grpc.StatusCode.FAILED_PRECONDITION)
            return []
        if kind == "cancel":
            if not run.bound:
                raise SessionEnd(grpc.StatusCode.CANCELLED, f"cancelled: {msg.cancel.reason}" if msg.cancel.reason
                                 else "cancelled")
            run.cancelled = True
            await self._control(decode_pb2.ControlRequest(cancel=decode_pb2.CancelRequest(
                session_id=run.sid, reason=msg.cancel.reason, session_secret=run.secret)))
            return []
        raise AssertionError(kind)  # stream_message_error refused every other kind

    async def _resume_with(self, turn: common_pb2.Turn) -> list:
        """A turn for a session bound nowhere (its worker was lost between turns): it binds again."""
        run = self.run
        try:
            req = run.log.resume(turn)
        except CannotResume as exc:
            raise SessionEnd(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        await run.bind(req)
        return []

    async def _control(self, req, ignore: grpc.StatusCode | None = None) -> bool:
        """Sends ``req`` on the bound worker's control stream. False: the worker is unreachable, or
        stopped (no answer within the fence bound, or fenced: its stream closed, CANCELLED)."""
        run = self.run
        try:
            await run.control.call(req, timeout_s=run.svc.call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND):
                # NOT_FOUND: the session is not open on the worker (it restarted, or dropped it when
                # fenced): the session moves, as when the worker is unreachable
                return False
            if exc.code() != ignore:
                raise SessionEnd(exc.code(), exc.details()) from None
        return True
