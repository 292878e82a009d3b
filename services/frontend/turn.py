"""One turn on a live session: sends it, feeds the session's events into an `Answer`, records the
new history in the index when the turn ends. The HTTP handler reads `out`. A client that goes away
stops the turn's decoding (`stop_when`: StopRound, the round ends at its next token), and the turn
still runs to that end, so the front records the history the session holds: the tokens made before
the stop included, and the session stays reusable."""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Coroutine

import grpc
import structlog

from ampd.chat.conversation import answer_digest
from ampd.front.answer import Answer, Call
from ampd.front.api import ApiError
from ampd.front.index import history_entry
from ampd.v1 import common_pb2
from ampd.tasks import BackgroundTasks
from services.frontend.sessions import END, LiveSession, SessionTable

log = structlog.get_logger()

TEXT, DONE, FAILED = "text", "done", "failed"

# gRPC status -> HTTP status and OpenAI error type. Permanent errors are 4xx other than 429 (OpenAI's
# SDKs retry 408, 409, 429 and 5xx); 429 and 503 are retryable and carry Retry-After (RETRY_AFTER_S).
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.ABORTED: (502, "upstream_error"),
    grpc.StatusCode.CANCELLED: (502, "upstream_error"),
    grpc.StatusCode.UNAUTHENTICATED: (502, "upstream_error"),
    grpc.StatusCode.PERMISSION_DENIED: (502, "upstream_error"),
}
RETRY_AFTER_S = 1.0
# Admission refusals (ampd.policy.admit, "admission: REASON: ..."): kv-size can never be admitted
# (the session needs more KV than any decode worker has), the others may be once KV frees.
_PERMANENT_REFUSALS = ("kv-size",)
# session-API field paths (after "open.turn." / "turn.") -> the OpenAI request field they come from
_PARAMS = {"sampling.max_tokens": "max_tokens", "sampling.stop": "stop", "sampling.stop_token_ids": "stop_token_ids",
           "sampling.temperature": "temperature", "sampling.top_p": "top_p", "sampling.seed": "seed",
           "token_ids": "messages", "keep_tokens": "messages", "tool_call_id": "messages",
           **{f"hints.{k}": f"ampd_hints.{k}" for k in ("priority", "expected_output_tokens", "expected_tool_s")}}


def _param(details: str) -> str | None:
    """The OpenAI field a session-API error names by its path (``open.turn.sampling.stop[2]: ...``)."""
    path = details.split(":", 1)[0].strip()
    for head in ("open.", "turn."):
        path = path.removeprefix(head)
    return _PARAMS.get(path.split("[", 1)[0])


def grpc_error(exc: grpc.aio.AioRpcError | None, what: str = "the session") -> ApiError:
    if exc is None:
        return ApiError(502, f"{what} ended before its turn was answered", code="session_ended",
                        type="upstream_error")
    code = exc.code()
    details = exc.details() or code.name
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if "message larger than max" in details:  # the turn does not fit a gRPC message: too long a prompt
            return ApiError(413, f"messages: the request's tokens do not fit the session API's message limit "
                                 f"({details})", param="messages", code="context_length_exceeded")
        reason = details.removeprefix("admission: ").split(":", 1)[0]
        if details.startswith("admission: ") and reason in _PERMANENT_REFUSALS:
            return ApiError(400, details, param="messages", code="context_length_exceeded")
    status, kind = _HTTP.get(code, (500, "internal_error"))
    param = _param(details) if status == 400 else None
    retry = RETRY_AFTER_S if status in (429, 503) else None
    return ApiError(status, details, param=param, code=code.name.lower(), type=kind, retry_after=retry)


class TurnRun:
    def __init__(self, table: SessionTable, s: LiveSession, answer: Answer, segment_prefix: list[int],
                 on_end: Callable[["TurnRun"], None] | None = None) -> None:
        self.table = table
        self.s = s
        self.answer = answer
        self.segment_prefix = segment_prefix  # forced-call ids the answer's segment starts with
        self.out: asyncio.Queue = asyncio.Queue()
        self.calls: list[Call] = []
        self.error: ApiError | None = None
        self.first_token_at: float | None = None
        self.on_end = on_end
        self.stopped = False  # its client went away: StopRound sent
        self._gone: asyncio.Future | None = None  # completes when its client goes away (`stop_when`)
        self._over = False  # its TurnEnd (or its failure) came
        self._tasks: BackgroundTasks | None = None  # the owner of its driver and its watch (start)
        s.events = asyncio.Queue()
        if s.closed:  # the stream ended while the session idled
            s.events.put_nowait(s.error or END)

    def start(self, turn: common_pb2.Turn | None, tasks: BackgroundTasks) -> asyncio.Task:
        """Sends ``turn`` (None: the session's open carries it) and drives it in a task ``tasks`` owns."""
        self._tasks = tasks
        if turn is not None:
            self.s.send_turn(turn)
        return tasks.spawn(self._drive(), name=f"turn-{self.s.session_id}")

    def stop_when(self, gone: Coroutine) -> None:
        """Stops the turn once ``gone`` completes (its client went away); ``gone`` is cancelled at the
        turn's end. One task per turn (owned with its driver), nothing per token."""
        self._gone = self._tasks.spawn(gone)
        if self._over:  # it ended before its response was sent
            self._gone.cancel()
            return
        self._gone.add_done_callback(self._client_gone)

    def _client_gone(self, f: asyncio.Future) -> None:
        if not f.cancelled():
            f.exception()  # retrieved: a client whose connection failed is gone too
            self.stop()

    def stop(self) -> None:
        """Ends the turn's decoding at its next token (finish_reason stop_requested); a turn that
        already ended is left alone (a stop between turns does nothing anyway)."""
        if not self._over and not self.stopped and not self.s.closed:
            self.stopped = True
            self.s.stop_round()

    async def _drive(self) -> None:
        s, a = self.s, self.answer
        try:
            while True:
                ev = await s.events.get()
                if ev is END or isinstance(ev, grpc.aio.AioRpcError):
                    raise _Ended(ev if ev is not END else None)
                kind = ev.WhichOneof("event")
                if kind == "tokens":
                    ids = list(ev.tokens.token_ids)
                    s.history.extend(ids)
                    if self.first_token_at is None:
                        self.first_token_at = time.monotonic()
                    a.add(ids)
                    self.out.put_nowait((TEXT, "", ids))
                elif kind == "tool_call" and ev.tool_call.client_side:
                    a.tool_call(ev.tool_call.name, ev.tool_call.arguments, ev.tool_call.call_id)
                    s.pending_calls.add(ev.tool_call.call_id)
                elif kind == "round_end":
                    a.round_end(ev.round_end.timing)
                elif kind == "turn_end":
                    a.turn_end(ev.turn_end.finish_reason)
                    held = ev.turn_end.history_tokens
                    break
        except _Ended as e:
            self._finish()
            self.error = grpc_error(e.exc)
            s.events = None
            await self.table.drop(s)
            self.out.put_nowait((FAILED, self.error, None))
            self._ended()
            return
        except asyncio.CancelledError:
            self._finish()
            await self.table.drop(s)
            raise
        self._finish()
        s.events = None
        if held != len(s.history):  # never seen: a session the front cannot describe is not reused
            log.warning("session holds other tokens than the front recorded; closed", session=s.session_id,
                        held=held, recorded=len(s.history))
            self.calls = a.calls()
            await self.table.drop(s)
            self.out.put_nowait((DONE, None, None))
            self._ended()
            return
        self.calls = a.calls()  # every token's text decoded, whether or not a client streamed it
        msg = a.message(self.calls)
        segment = self.segment_prefix + a.tokens
        digest = answer_digest(msg["content"], msg.get("tool_calls"))
        entry, stale, s.stale_entry = history_entry(s.history, s.tenant.scope), s.stale_entry, None
        s.entry = entry.key
        self.table.local.add(s.session_id, entry)
        self.table.local.hold_answer(s.tenant.scope, digest, segment)
        s.answers.append(digest)
        s.unpublished.append((digest, segment))
        answers, s.unpublished = s.unpublished, []
        s.busy = False
        s.last_used = time.monotonic()
        try:
            await self.table.index.publish(s.session_id, s.name, self.table.me, entry, answers, stale)
        except Exception as exc:  # Redis away: this front still finds the session
            log.warning("index publish failed", session=s.session_id, error=str(exc))
        self.out.put_nowait((DONE, None, None))
        self._ended()

    def _finish(self) -> None:
        self._over = True
        if self._gone is not None:
            self._gone.cancel()

    def _ended(self) -> None:
        if self.on_end is not None:
            self.on_end(self)


class _Ended(Exception):
    def __init__(self, exc: grpc.aio.AioRpcError | None) -> None:
        self.exc = exc
