"""The OpenAI-compatible HTTP front (Starlette on uvicorn): chat and text completions as session turns
on the coordinator, continuing a live session when a request resends its history (docs/frontend.md)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
import uuid
from collections import deque
from typing import Any, Sequence

import grpc
import httpx2
import orjson
import redis.exceptions
import structlog
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ampd import grpcserver, logs, tracing
from ampd.agenthints import hints_to_turn
from ampd.chat.template import ChatFormat
from ampd.chat.tokenizer import tokenizer_for
from ampd.config import SERVICE_SETTINGS, ConfigError, add_flags, require
from ampd.front.answer import Answer
from ampd.front.api import (ApiError, ChatRequest, CompletionRequest, error_body,
                            parse_completion)
from ampd.front.evict import Held, grace_ends, kv_victims, tenant_victims
from ampd.front.index import Match, SessionIndex
from ampd.front.tenants import Tenant, load_api_keys
from ampd.metrics import TTFT_BUCKETS
from ampd.policy.hints import Hints
from ampd.state import connect
from ampd.coordinators import Coordinators, parse_addresses
from ampd.tasks import BackgroundTasks
from ampd.v1 import common_pb2
from services.frontend.reading import MAX_BODY as MAX_BODY  # (the hostile-input tests import it from here)
from services.frontend.reading import RequestReader
from services.frontend.sessions import LiveSession, SessionTable
from services.frontend.turn import DONE, FAILED, RETRY_AFTER_S, TEXT, TurnRun

log = structlog.get_logger()

FORWARDED = "x-ampd-forwarded"  # set on a request one front passes to the front that holds its session
# An agent's connection idles through its tool calls: keep it open longer than uvicorn's 5 s, so a
# client does not send its next turn on a connection the server is closing.
KEEP_ALIVE_S = 75


class JSONResponse(Response):
    """Starlette's JSONResponse (compact, UTF-8) encoded with orjson."""
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class EventStream(StreamingResponse):
    """Server-sent events, streamed without Starlette's second task that waits for the client to
    disconnect (what it does for servers of ASGI spec < 2.4; uvicorn says 2.3): the turn already
    watches for it (`_client_gone`, which stops its decoding), the turn then runs to its end, and a
    gone client's chunks are dropped by the server, so the task would only cost a task group per
    response."""

    def __init__(self, content, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            raise ClientDisconnect() from None


class FrontMetrics:
    def __init__(self, table: SessionTable) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ampd_frontend_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.sessions = Counter("ampd_frontend_session_turns", "turns by how their session was found: header, "
                                "prefix (the request resent a live session's history), new, or forwarded (to the "
                                "front that holds the session)", ["how"], registry=r)
        self.prompt_tokens = Counter("ampd_frontend_prompt_tokens", "prompt tokens of answered turns", registry=r)
        self.cached_tokens = Counter("ampd_frontend_cached_prompt_tokens", "prompt tokens whose KV the session "
                                     "already held (not prefilled again)", registry=r)
        self.generation_tokens = Counter("ampd_frontend_generation_tokens", "output tokens sent", registry=r)
        self.turns_stopped = Counter("ampd_frontend_turns_stopped", "turns whose client went away before their "
                                     "end: their decoding was stopped (StopRound), the session kept", registry=r)
        self.ttft = Histogram("ampd_frontend_time_to_first_token_seconds", "from a request's arrival at the front "
                              "to its first output token", buckets=TTFT_BUCKETS, registry=r)
        live = Gauge("ampd_frontend_sessions_active", "sessions this front holds", ["state"], registry=r)
        live.labels("busy").set_function(lambda: sum(s.busy for s in table.live.values()))
        live.labels("idle").set_function(lambda: sum(not s.busy for s in table.live.values()))
        Gauge("ampd_frontend_sessions_expired", "sessions closed for idling past the TTL (a counter)",
              registry=r).set_function(lambda: table.closed_by_ttl)
        self.inflight = Gauge("ampd_frontend_requests_inflight", "API requests being answered (limited by "
                              "--max-inflight-requests)", registry=r)
        evicted = Gauge("ampd_frontend_sessions_evicted", "idle sessions closed to make room (a counter), by why: "
                        "kv-full (the deployment refused a new session for lack of KV), max-sessions, "
                        "tenant-sessions, tenant-kv (a tenant's caps)", ["reason"], registry=r)
        for reason in table.evictions:
            evicted.labels(reason).set_function(lambda reason=reason: table.evictions[reason])


def _continues(history: Sequence[int], ids: Sequence[int]) -> bool:
    """Whether ``ids`` is the history and more (a turn needs at least one new token)."""
    return len(ids) > len(history) and ids[:len(history)] == history


def _kv_full(e: ApiError) -> bool:
    return e.status == 429 and "kv-full" in e.message


TENANT_RETRY_AFTER_S = 1  # a tenant at its caps with every session busy: a turn ends soon
# After a new session was refused for lack of KV, the next new sessions at least as big for this
# long first evict what they need (of the idle sessions past the grace), instead of each waiting out
# the admission wait: a smaller one may fit in what is left.
KV_SHORT_S = 10.0


class Front:
    """The front's requests: each placed as a turn of a live session (continued, new, or forwarded to
    the front that holds it) and answered from its events; ``read`` turns a request into the turn."""

    def __init__(self, args: argparse.Namespace, fmt: ChatFormat, coordinator, index: SessionIndex, me: str) -> None:
        self.read = RequestReader(args, fmt)
        self.model = args.model
        self.idle_grace = args.idle_grace
        self.tenant_sessions, self.tenant_kv_tokens = args.tenant_sessions, args.tenant_kv_tokens
        self.kv_short_until, self.kv_short_need = 0.0, 0  # KV was short lately for this need (KV_SHORT_S)
        self.coordinator = coordinator  # the coordinator's Session API (a gRPC client)
        self.index = index
        self.table = SessionTable(index, me, args.session_ttl, args.max_sessions)
        self.metrics = FrontMetrics(self.table)
        self.created = int(time.time())
        self.http = httpx2.AsyncClient(timeout=None)  # to the other fronts (forwarding)
        self.max_inflight = args.max_inflight_requests
        self.turns = BackgroundTasks()  # the turns' drivers (services/frontend/turn.py)

    # ------------------------------------------------------------------------------ placing a turn
    async def _place(self, tenant: Tenant, ids: list[int], header: str, how: list[str], forwarded: bool
                     ) -> LiveSession | None:
        """The tenant's live session this request continues (its history, then more); None: a new
        one. Another tenant's sessions never match. A request that diverges from the session its
        header names forks: a new session, and the named one keeps its KV for its own client."""
        if header:
            s = self.table.get(tenant, header)
            if s is None:
                how.append("new")
                return None
            if s.busy and forwarded:  # another front matched its entry while its turn runs
                how.append("new")
                return None
            if s.busy:
                raise ApiError(409, f"x-session-id: session {header!r} is answering another request",
                               code="session_busy")
            how.append("header" if _continues(s.history, ids) else "fork")
            return s if how[0] == "header" else None
        m = self.table.local.find(tenant.scope, ids)
        if m is None and not forwarded:  # none of this front's sessions: perhaps another front's
            m = await self.index.find(tenant.scope, ids, (await self.index.prefetch(tenant.scope, ()))[0])
            if m is not None and m.front != self.table.me:
                raise _Forward(m)
        if m is not None:
            s = self.table.live.get(m.session_id)
            if (s is not None and not s.busy and not s.closed and s.tenant.scope == tenant.scope
                    and s.history == ids[:m.length]):
                how.append("prefix")
                return s
        how.append("new")
        return None

    def _tenant_room(self, request: Request, tenant: Tenant, s: LiveSession | None, ids: list[int]) -> None:
        """Holds the tenant to its caps: its own least recently used idle sessions go, else 429."""
        if not (self.tenant_sessions or self.tenant_kv_tokens):
            return
        if self.tenant_kv_tokens and len(ids) > self.tenant_kv_tokens:
            param = "messages" if request.url.path.endswith("chat/completions") else "prompt"
            raise ApiError(400, f"{param}: {len(ids)} tokens, over this tenant's {self.tenant_kv_tokens} KV tokens "
                                "(--tenant-kv-tokens)", param=param, code="tenant_kv_limit")
        mine = self.table.of_tenant(tenant)
        sessions = len(mine) + (s is None)
        tokens = sum(len(x.history) for x in mine if x is not s) + len(ids)
        idle = [Held(x.session_id, x.last_used, tokens=len(x.history)) for x in mine if not x.busy and x is not s]
        victims = tenant_victims(idle, sessions, tokens, self.tenant_sessions, self.tenant_kv_tokens)
        if victims is None:
            raise ApiError(429, f"this tenant holds its most sessions ({self.tenant_sessions}, --tenant-sessions) or "
                                f"KV tokens ({self.tenant_kv_tokens}, --tenant-kv-tokens), all busy; retry later",
                           code="tenant_limit", type="rate_limit_error", retry_after=TENANT_RETRY_AFTER_S)
        over_sessions = bool(self.tenant_sessions) and sessions > self.tenant_sessions
        for sid in victims:
            self.table.evict(self.table.live[sid], "tenant-sessions" if over_sessions else "tenant-kv")

    async def _begin(self, request: Request, ids: list[int], header: str, p: common_pb2.SamplingParams,
                     answered: Sequence[str], hints: Hints | None = None
                     ) -> tuple[LiveSession, common_pb2.Turn | None]:
        how: list[str] = []
        tenant: Tenant = request.state.tenant
        forwarded = bool(request.headers.get(FORWARDED)) or getattr(request.state, "no_forward", False)
        s = await self._place(tenant, ids, header, how, forwarded)
        self.metrics.sessions.labels(how[0]).inc()
        self._tenant_room(request, tenant, s, ids)
        if s is None:
            if not self.table.room():
                raise ApiError(429, "the front holds its most sessions, all busy; retry later",
                               code="too_many_sessions", type="rate_limit_error")
            name = header if header and self.table.get(tenant, header) is None else ""
            s = LiveSession(self.table.new_id(), history=list(ids), busy=True, name=name, tenant=tenant,
                            promised=len(ids) + p.max_tokens)
            if time.monotonic() < self.kv_short_until and s.promised >= self.kv_short_need:
                # its admission is woken when their KV frees
                self._evict_for_kv(s, enough_only=True)
            self.table.add(s)
            s.opened_with = getattr(request.state, "known", {})
            self.table.hold(s, s.opened_with)
            s.open_msg = common_pb2.OpenSession(session_id=s.session_id, turn=common_pb2.Turn(token_ids=ids, sampling=p),
                                                prefix_scope=tenant.prefix_scope)
            if hints is not None:
                hints_to_turn(hints, s.open_msg.turn)
            if tracing.on:
                s.caller = tracing.parse_traceparent(request.headers.get(tracing.TRACEPARENT))
            s.start(self.coordinator)
            return s, None
        self.table.take(s)
        turn = common_pb2.Turn(token_ids=ids[len(s.history):], sampling=p)
        if hints is not None:
            hints_to_turn(hints, turn)
        s.promised += len(turn.token_ids) + p.max_tokens
        answers = [c for c in answered if c in s.pending_calls]
        if answers:
            turn.tool_call_id = answers[0]
        s.pending_calls.clear()
        s.history = list(ids)
        return s, turn

    def _evict_for_kv(self, s: LiveSession, enough_only: bool = False) -> list[asyncio.Task]:
        """Evicts idle sessions past the grace, least recently used first, until one decode worker
        got back what the new session ``s`` needs (``enough_only``: none if that is not possible);
        the evictions' tasks."""
        held = [Held(x.session_id, x.last_used, x.busy, x.worker, x.promised, len(x.history))
                for x in self.table.live.values() if x is not s]
        victims, enough = kv_victims(held, time.monotonic(), self.idle_grace, s.promised)
        if enough_only and not enough:
            return []
        return [t for t in (self.table.evict(self.table.live[v], "kv-full") for v in victims) if t is not None]

    async def _kv_room(self, s: LiveSession) -> bool:
        """The deployment refused the new session ``s`` for lack of KV: evicts for it (waiting for
        an idle session to pass its grace if none has). False: no idle session to close."""
        now = time.monotonic()
        self.kv_short_need = s.promised if now >= self.kv_short_until else min(self.kv_short_need, s.promised)
        self.kv_short_until = now + KV_SHORT_S
        deadline = now + self.idle_grace + 1.0  # sessions that keep turning busy are not idle
        while True:
            evictions = self._evict_for_kv(s)
            if evictions:
                await asyncio.gather(*evictions)
                return True
            now = time.monotonic()
            held = [Held(x.session_id, x.last_used, x.busy) for x in self.table.live.values() if x is not s]
            wake = grace_ends(held, now, self.idle_grace)
            if wake is None or wake > deadline:
                return False
            await asyncio.sleep(wake - now)

    async def forward(self, request: Request, m: Match) -> Response:
        """Passes the request to the front that holds its session (named by the header there); a
        front that does not answer leaves the conversation to a new session here."""
        headers = {"content-type": "application/json", "x-session-id": m.name, FORWARDED: "1"}
        if request.headers.get("authorization"):
            headers["authorization"] = request.headers["authorization"]
        req = self.http.build_request("POST", m.front + request.url.path, content=request.state.raw, headers=headers)
        try:
            resp = await self.http.send(req, stream=True)
        except httpx2.TransportError as exc:
            log.warning("the session's front does not answer; a new session here", front=m.front,
                        session=m.session_id, error=str(exc))
            request.state.no_forward = True
            return await (self.chat if request.url.path.endswith("chat/completions") else self.completions)(request)
        self.metrics.sessions.labels("forwarded").inc()
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"),
                                 headers={"x-session-id": resp.headers.get("x-session-id", m.name)},
                                 background=BackgroundTask(resp.aclose))

    def _ended(self, run: TurnRun) -> None:
        a = run.answer
        if tracing.on:  # the turn's span, in its session's trace (ampd.tracing)
            tracing.record("front.turn", getattr(run, "traced_at", time.time()), time.time(),
                           tracing.session_context(run.s.session_id), {
                               "ampd.session_id": run.s.session_id, "ampd.l_hist": a.l_hist, "ampd.l_incr": a.l_incr,
                               "ampd.tokens": len(a.tokens), "ampd.stopped": run.stopped}, kind="server",
                           error=run.error.message if run.error is not None else "")
        if run.stopped:
            self.metrics.turns_stopped.inc()
        if run.error is None:
            self.metrics.prompt_tokens.inc(a.l_hist + a.l_incr)
            self.metrics.cached_tokens.inc(a.l_hist)
            self.metrics.generation_tokens.inc(len(a.tokens))

    async def _run(self, s: LiveSession, turn, answer: Answer, prefix: list[int], t0: float) -> tuple[TurnRun, Any]:
        while True:
            run = TurnRun(self.table, s, answer, prefix, self._ended)
            if tracing.on:
                run.traced_at = time.time()
            run.start(turn, self.turns)
            first = await run.out.get()
            if first[0] != FAILED:
                s.open_msg, s.opened_with = None, {}  # opened: nothing to open again
                break
            # a new session refused for lack of KV: idle sessions make room, and it opens again
            if turn is None and _kv_full(first[1]) and await self._kv_room(s):
                s.reopen(self.coordinator, self.table.new_id())
                self.table.add(s)
                self.table.hold(s, s.opened_with)
                continue
            raise first[1]
        if run.first_token_at is not None:
            self.metrics.ttft.observe(run.first_token_at - t0)
        return run, first

    # ------------------------------------------------------------------------------- endpoints
    async def chat(self, request: Request) -> Response:
        t0 = time.monotonic()
        self.read.tenant(request)
        req, digests = await self.read.off_loop(self.read.parse_chat, await self.read.body(request))
        self.read.check_model(req.model)
        header = self.read.session_header(request)
        scope = request.state.tenant.scope
        local = self.table.local.answers
        known = {d: local[(scope, d)] for d in digests if (scope, d) in local}
        if len(known) < len(digests):  # answers another front gave
            known.update((await self.index.prefetch(scope, [d for d in digests if d not in known]))[1])
        request.state.known = known  # a new session's history holds them
        ids, prefix = await self.read.off_loop(self.read.render, req, known)
        p = self.read.sampling(req.sampling, req.forced_tool is not None)
        answered = [m.get("tool_call_id") for m in req.messages[_last_answer(req.messages) + 1:]
                    if m.get("role") == "tool"]
        s, turn = await self._begin(request, ids, header, p, answered, req.hints)
        answer = self.read.answer(p, req.forced_tool, bool(req.tools) and req.forced_tool is None)
        run, first = await self._run(s, turn, answer, prefix, t0)
        run.stop_when(_client_gone(request))
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        headers = {"x-session-id": run.s.name}
        if req.stream:
            return EventStream(self._chat_stream(cid, req, run, first), headers)
        await _until_end(run)
        a = run.answer
        body = {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": self.model,
                "choices": [{"index": 0, "message": a.message(run.calls), "finish_reason": a.openai_finish(),
                             "logprobs": None}],
                "usage": a.usage(), "ampd": _ext(run.s, a)}
        return JSONResponse(body, headers=headers)

    async def _chat_stream(self, cid: str, req: ChatRequest, run: TurnRun, first):
        """The turn's events as SSE. The events ready at one moment go out in one write (the role
        with the first text; the end's chunks with [DONE]): what a client reads per event is the
        same, the front and the client wake once instead of several times."""
        base = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model}

        def chunk(delta: dict, finish: str | None = None, **extra) -> bytes:
            return _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                              "logprobs": None}], **extra})

        out = [chunk({"role": "assistant", "content": ""})]
        async for item in _events(run, first):
            if item[0] == FAILED:
                out.append(_sse(error_body(item[1])))
                break
            if item[0] == DONE:
                a = run.answer
                rest = a.rest()
                if rest:
                    out.append(chunk({"content": rest}))
                if run.calls:
                    out.append(chunk({"tool_calls": [c.openai(i) for i, c in enumerate(run.calls)]}))
                out.append(chunk({}, a.openai_finish(), ampd=_ext(run.s, a)))
                if req.include_usage:
                    out.append(_sse({**base, "choices": [], "usage": a.usage()}))
                break
            text = run.answer.text_delta()
            if text:
                out.append(chunk({"content": text}))
            if out:
                yield b"".join(out)
                out = []
        out.append(DONE_EVENT)
        yield b"".join(out)

    async def completions(self, request: Request) -> Response:
        t0 = time.monotonic()
        self.read.tenant(request)
        req: CompletionRequest = await self.read.off_loop(self.read.parse, await self.read.body(request), parse_completion)
        self.read.check_model(req.model)
        header = self.read.session_header(request)
        ids = list(req.prompt) if isinstance(req.prompt, list) else await self.read.off_loop(self.read.fmt.encode, req.prompt)
        p = self.read.sampling(req.sampling, False)
        s, turn = await self._begin(request, ids, header, p, (), req.hints)
        try:
            run, first = await self._run(s, turn, self.read.answer(p, None, False), [], t0)
        except ApiError as e:
            if e.param == "messages":  # the session API's input is this endpoint's prompt
                e.param = "prompt"
            raise
        run.stop_when(_client_gone(request))
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        headers = {"x-session-id": run.s.name}
        if req.stream:
            return EventStream(self._completion_stream(cid, req, run, first), headers)
        await _until_end(run)
        a = run.answer
        a.text_delta()
        choice = {"index": 0, "text": a.stops.text, "finish_reason": a.openai_finish(), "logprobs": None}
        if req.return_token_ids:
            choice.update(prompt_token_ids=ids, token_ids=a.tokens)
        body = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [choice], "usage": a.usage(), "ampd": _ext(run.s, a)}
        return JSONResponse(body, headers=headers)

    async def _completion_stream(self, cid: str, req: CompletionRequest, run: TurnRun, first):
        """As `_chat_stream`: the end's chunks go out with [DONE] in one write."""
        base = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": self.model}

        def chunk(text: str, ids: list[int] | None, finish: str | None = None, **extra) -> bytes:
            c: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            if req.return_token_ids and ids is not None:
                c["token_ids"] = ids
            return _sse({**base, "choices": [c], **extra})

        out = []
        async for item in _events(run, first):
            if item[0] == FAILED:
                out.append(_sse(error_body(item[1])))
                break
            if item[0] == DONE:
                a = run.answer
                out.append(chunk(a.rest(), [] if req.return_token_ids else None, a.openai_finish(),
                                 ampd=_ext(run.s, a)))
                if req.include_usage:
                    out.append(_sse({**base, "choices": [], "usage": a.usage()}))
                break
            yield chunk(run.answer.text_delta(), item[2])
        out.append(DONE_EVENT)
        yield b"".join(out)

    async def models(self, request: Request) -> Response:
        self.read.tenant(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.created, "owned_by": "ampd"}]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "sessions": len(self.table.live)})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class _Forward(Exception):
    def __init__(self, match: Match) -> None:
        self.match = match


def error_response(e: ApiError) -> Response:
    """An error in OpenAI's shape; a retryable one (429/503) says when to retry, a 413 closes the
    connection (the rest of an oversized body is not read)."""
    headers = {}
    retry = e.retry_after if e.retry_after is not None else RETRY_AFTER_S if e.status in (429, 503) else None
    if retry is not None:
        headers["retry-after"] = f"{max(1, round(retry))}"
    if e.status == 413:
        headers["connection"] = "close"
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


def _where(exc: BaseException) -> str:
    """Where an exception was raised (file:line of its last frame): what a log names instead of its
    message, which may quote the request."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"


class InflightLimit:
    """ASGI middleware: at most ``limit`` API requests (/v1/chat/completions, /v1/completions) in
    flight, a streamed answer counted until its last chunk; one more is refused at once with 429 and
    Retry-After, before its body is read (issue 24: a burst of 300 new chats got 500s and stalled
    the front). /health (/healthz), /metrics and /v1/models are never limited."""

    PATHS = ("/v1/chat/completions", "/v1/completions")

    def __init__(self, app, limit: int, metrics: "FrontMetrics") -> None:
        self.app, self.limit, self.metrics = app, limit, metrics
        self.inflight = 0
        metrics.inflight.set_function(lambda: self.inflight)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.PATHS:
            return await self.app(scope, receive, send)
        if self.inflight >= self.limit:
            e = ApiError(429, f"the front answers {self.limit} requests at once (--max-inflight-requests); "
                              "retry later", code="too_many_requests", type="rate_limit_error",
                         retry_after=RETRY_AFTER_S)
            self.metrics.requests.labels(scope["path"], "429").inc()
            return await error_response(e)(scope, receive, send)
        self.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1


def _last_answer(messages: list[dict]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)


async def _events(run: TurnRun, first):
    """The turn's events from ``first`` on, the text events that queued up behind one merged into it:
    a client (or a front) that falls behind gets fewer, larger chunks instead of a growing backlog."""
    pending = deque([first])
    while True:
        while not run.out.empty():
            pending.append(run.out.get_nowait())
        if not pending:
            pending.append(await run.out.get())
            continue
        kind, text, ids = pending.popleft()
        if kind == TEXT:
            ids = list(ids)
            while pending and pending[0][0] == TEXT:
                _, more_text, more = pending.popleft()
                text, ids = text + more_text, ids + list(more)
        yield kind, text, ids
        if kind != TEXT:
            return


async def _client_gone(request: Request) -> None:
    """Returns once the client has gone away. Its body was read whole, so the server's next message
    is http.disconnect: uvicorn sends it when the connection is lost (or once the response is
    complete, after the turn's end, when nothing waits for it any more). Costs one waiting task
    per turn, nothing per token."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_end(run: TurnRun) -> None:
    while True:
        kind, err, _ = await run.out.get()
        if kind == FAILED:
            raise err
        if kind == DONE:
            return


def _ext(s: LiveSession, a: Answer) -> dict:
    """The `ampd` extension of an answer: its session and where its prefill ran."""
    t = a.timing
    out: dict[str, Any] = {"session_id": s.name, "l_hist": a.l_hist, "l_incr": a.l_incr}
    if t is not None:
        out.update(round=t.round, local=t.local, prefill_worker=t.prefill_worker, route_reason=t.route_reason)
    return out


DONE_EVENT = b"data: [DONE]\n\n"


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def build_app(front: Front) -> Starlette:
    endpoints = {"/v1/chat/completions": ("POST", front.chat), "/v1/completions": ("POST", front.completions),
                 "/v1/models": ("GET", front.models), "/health": ("GET", front.health),
                 # the Kubernetes spelling, which deploy/k8s probes
                 "/healthz": ("GET", front.health),
                 "/metrics": ("GET", front.metrics_endpoint)}

    def wrap(path: str, fn):
        async def handler(request: Request) -> Response:
            try:
                try:
                    resp = await fn(request)
                except _Forward as f:
                    resp = await front.forward(request, f.match)
            except ApiError as e:
                resp = error_response(e)
            except grpc.aio.AioRpcError as exc:  # pragma: no cover - turned into ApiError in TurnRun
                from services.frontend.turn import grpc_error

                resp = error_response(grpc_error(exc))
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                # Redis away or its pool busy past its wait (ampd.state.connect): retryable
                log.warning("state store unavailable", path=path, error=type(exc).__name__)
                resp = error_response(ApiError(503, "the front's state store is unavailable; retry later",
                                               code="store_unavailable", type="service_unavailable",
                                               retry_after=RETRY_AFTER_S))
            except ClientDisconnect:
                resp = error_response(ApiError(400, "body: the client closed the connection while sending it",
                                               code="client_disconnected"))
            except Exception as exc:  # never a traceback to the client, nor the request in the log
                log.error("request failed", path=path, error=type(exc).__name__, at=_where(exc))
                e = ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error", type="internal_error")
                resp = error_response(e)
            front.metrics.requests.labels(path, str(resp.status_code)).inc()
            return resp
        return handler

    routes = [Route(path, wrap(path, fn), methods=[method]) for path, (method, fn) in endpoints.items()]

    async def not_found(request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 404)
        msg = "method not allowed" if status == 405 else f"no endpoint {request.url.path}"
        return JSONResponse(error_body(ApiError(status, msg, code="not_found" if status == 404 else
                                                "method_not_allowed")), status_code=status)

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    return InflightLimit(app, front.max_inflight, front.metrics)


async def amain(args: argparse.Namespace) -> None:
    logs.configure("frontend")
    fmt = ChatFormat(tokenizer_for(args.engine, args.model))
    # the deployment's shared token goes to the coordinators with every call (ampd.grpcserver)
    coordinator = Coordinators(parse_addresses(args.coordinator_address, "--coordinator-address"),
                               token=args.auth_token, max_message=grpcserver.CLIENT_MAX_MESSAGE)
    await _reach(coordinator)
    redis = await connect(args.redis_url)
    index = SessionIndex(redis, args.namespace, args.session_ttl)
    front = Front(args, fmt, coordinator, index, "")
    config = uvicorn.Config(build_app(front), host=args.host, port=args.port, loop="none", lifespan="off", http="httptools",
                            log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = _Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.exit)
    background = BackgroundTasks()  # uvicorn's serve()
    serving = background.spawn(server.serve())
    try:
        await _started(server, serving, args)
    except BaseException:
        await background.close()
        raise
    port = server.servers[0].sockets[0].getsockname()[1]
    front.table.me = f"http://{args.host}:{port}"
    front.table.start()
    grpcserver.write_ready_file(args.ready_file, port, port)
    log.info("frontend serving", url=front.table.me, coordinator=args.coordinator_address, model=args.model)
    try:
        await serving
    finally:
        await background.close()  # (serve() has ended, unless this task was cancelled)
        await front.turns.close()  # a turn still running drops its session
        await front.table.stop()
        await front.http.aclose()
        front.read.work.shutdown(wait=False, cancel_futures=True)
        await coordinator.close()
        await redis.aclose()
        tracing.shutdown()  # the spans still batched go before the process ends


async def _started(server: uvicorn.Server, serving: asyncio.Task, args: argparse.Namespace) -> None:
    """Until uvicorn listens; its bind error (or a RuntimeError) if it ends first."""
    while not server.started:
        if serving.done():
            await serving  # raises the bind error
            raise RuntimeError(f"cannot bind {args.host}:{args.port}")
        await asyncio.sleep(0.01)


COORDINATOR_WAIT_S = 30.0  # at start-up, for the coordinators to answer (one may still be starting)


async def _reach(coordinators: Coordinators) -> None:
    """Every coordinator answers, or the front exits naming the first that does not."""
    deadline = time.monotonic() + COORDINATOR_WAIT_S
    while True:
        try:
            await coordinators.check(timeout_s=2.0)
            return
        except ConnectionError as exc:
            if time.monotonic() > deadline:
                sys.exit(f"ampd-frontend: error: --coordinator-address: {exc}")
        await asyncio.sleep(0.5)


class _Server(uvicorn.Server):
    """uvicorn's server, stopped by this process's own signal handlers: uvicorn's own re-raise the
    signal once it stops, which would end the process before it closes its sessions."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def exit(self) -> None:
        self.should_exit = True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampd-frontend", description="AMPD OpenAI-compatible front")
    add_flags(parser, SERVICE_SETTINGS["frontend"], env=True)
    return parser


def main(argv: list[str] | None = None) -> None:
    try:
        args = build_parser().parse_args(argv)
        require(args, "redis_url", "coordinator_address")
        parse_addresses(args.coordinator_address, "--coordinator-address")
        tokenizer_for(args.engine, args.model)
        if args.api_keys:
            load_api_keys(args.api_keys)
        tracing.setup("frontend", args.otlp_endpoint)
    except (ConfigError, ValueError) as exc:
        sys.exit(f"ampd-frontend: error: {exc}")
    grpcserver.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
