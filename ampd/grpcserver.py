"""What every AMPD gRPC server shares: health checking, reflection, signal-driven shutdown, call
streams (unary-like calls as messages on one long-lived stream)."""
from __future__ import annotations

import asyncio
import gc
import hmac
import inspect
import json
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ampd import tracing
from ampd.v1 import common_pb2

log = structlog.get_logger()

# Token streams are small messages; keep keepalives modest so a dead peer is noticed.
KEEPALIVE_MS = 20_000  # how often a server and a channel (CHANNEL_OPTIONS) ping a quiet connection
# A server accepts its clients' keepalive pings: by gRPC's defaults it takes a ping closer than 5 min
# to the last one while it sends no data as a strike, and closes the connection after two (GOAWAY
# too_many_pings), dropping every session on it (issue 24: a front's idle sessions, while its loop
# stalled). Half our clients' interval, and pings on a connection without calls are allowed.
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]
# Message limits. A client reaches the coordinator with gRPC's default 4 MiB; between services the
# limit is larger, so that whatever the coordinator accepted (a turn just under 4 MiB, plus the
# fields a worker adds) never fails on a later hop.
CLIENT_MAX_MESSAGE = 4 << 20
INTERNAL_MAX_MESSAGE = 64 << 20
# The deadline of a request/reply call between services (call streams, sidecar calls add the tool's
# own latency to it).
RPC_TIMEOUT_S = 30.0

_auth_token = ""  # the client-facing API's token (set_auth_token)
_internal_token = ""  # the internal surface's secret (set_internal_token); "": _auth_token guards it too


def set_auth_token(token: str) -> None:
    """The client-facing API's token (ampd.config ``auth_token``; "" = open): the public methods of
    every server this process starts require it (the coordinator's Session and Metrics), and, when no
    internal token is set, everything else too and every channel sends it."""
    global _auth_token
    _auth_token = token


def set_internal_token(token: str) -> None:
    """The deployment's internal secret (ampd.config ``internal_token``): every method but the public
    ones requires it, and every channel this process opens sends it."""
    global _internal_token
    _internal_token = token


def set_tokens(auth_token: str, internal_token: str) -> None:
    set_auth_token(auth_token)
    set_internal_token(internal_token)


def internal_token() -> str:
    """The internal secret this process holds (set_internal_token; "" = none)."""
    return _internal_token


def _internal() -> str:
    """What this process's channels send and its servers' internal methods require ("" = nothing)."""
    return _internal_token or _auth_token


def _message_options(limit: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


# Open to anyone: an orchestrator probes health without credentials; reflection shows only the schema.
_OPEN_PREFIX = "/grpc.health.v1.Health/"
_REFLECTION_PREFIX = "/grpc.reflection."


class _TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses a call without ``authorization: Bearer <token>`` (UNAUTHENTICATED): the client token
    for the server's public methods (the internal secret passes there too), the internal secret for
    every other method. An empty token leaves its methods open."""

    def __init__(self, client: str, internal: str, public: frozenset[str]) -> None:
        self._client = f"Bearer {client}".encode() if client else b""
        self._internal = f"Bearer {internal}".encode() if internal else b""
        self._public = public

    def _allowed(self, method: str, got: bytes) -> bool:
        if method in self._public or method.startswith(_REFLECTION_PREFIX):
            return (not self._client or hmac.compare_digest(got, self._client)
                    or (bool(self._internal) and hmac.compare_digest(got, self._internal)))
        return not self._internal or hmac.compare_digest(got, self._internal)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIX):
            return handler
        got = str(dict(details.invocation_metadata or ()).get("authorization", "")).encode()
        return handler if self._allowed(details.method, got) else _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    code, details = grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong token"

    async def unary(request, context):
        await context.abort(code, details)

    async def streaming(request, context):
        await context.abort(code, details)
        yield  # pragma: no cover - abort raises

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(streaming, **kw)


async def start_server(
    bind: str,
    add_servicers: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    max_message: int = INTERNAL_MAX_MESSAGE,
    public: Iterable[str] = (),
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Starts a grpc.aio server on `bind` (host:port, port 0 = free) with health and reflection,
    messages up to ``max_message`` bytes, the client token required of the ``public`` methods
    (``/package.Service/Method``) and the internal secret of every other one, where they are set.

    Returns the server, the bound port and the health servicer (set SERVING when ready).
    """
    internal = _internal()
    interceptors = [_TokenCheck(_auth_token, internal, frozenset(public))] if _auth_token or internal else []
    server = grpc.aio.server(options=SERVER_OPTIONS + _message_options(max_message), interceptors=interceptors)
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(bind)
    if port == 0:
        raise RuntimeError(f"cannot bind {bind}")
    await server.start()
    _started.append(server)
    for name in names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


async def serve_until_signal(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 2.0,
    exit_after_s: float = 10.0,
) -> None:
    """Runs until SIGINT/SIGTERM, then reports NOT_SERVING, runs on_stop and stops the server. A stop
    that takes longer than ``exit_after_s`` (a wedged engine or peer) ends the process anyway: a
    service told to stop never lingers (nor outlives the `ampd up` that started it)."""
    # What start-up allocated (modules, the engine, pools: ~200k objects) stays for the process's
    # life: moved out of the collector's sight, a full collection scans only what serving allocates
    # (one took ~60 ms here before, a pause in every stream of the process).
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(server.wait_for_termination())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    watchdog = threading.Timer(exit_after_s, os._exit, args=(1,))
    watchdog.daemon = True
    watchdog.start()
    await health_servicer.enter_graceful_shutdown()
    if on_stop is not None:
        await on_stop()
    await server.stop(grace_s)
    stopper.cancel()
    await asyncio.gather(waiter, stopper, return_exceptions=True)
    tracing.shutdown()  # the spans still batched go before the process ends (bounded: tracing.EXPORT_TIMEOUT_S)


# The servers this process started: a start-up that fails after its server is up stops them while
# the loop still runs (else grpc.aio's Server.__del__ meets a closed loop and prints a traceback
# under the one-line error).
_started: list[grpc.aio.Server] = []


async def _stopping_servers_on_error(main: Awaitable[None]) -> None:
    try:
        await main
    except BaseException:
        for server in _started:
            await server.stop(None)
        raise


def run(main: Awaitable[None]) -> None:
    """Runs a service's async main on uvloop. A ConfigError from start-up (e.g. --redis-url that
    nothing answers at) ends the process with its one-line message, not a traceback."""
    import uvloop

    from ampd.config import ConfigError

    try:
        uvloop.run(_stopping_servers_on_error(main))
    except ConfigError as exc:
        raise SystemExit(f"{_prog()}: error: {exc}") from None


def _prog() -> str:
    """ampd-<service> for `python -m services.<service>` (what the services' flag errors say)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    parts = (spec.name if spec else "").split(".")
    return f"ampd-{parts[1]}" if len(parts) > 1 and parts[0] == "services" else "ampd"


# A peer named by host name (compose: `decode-0:50061`) may come back at a new address when its
# container is replaced. By gRPC's defaults a channel to it stays down long after: it re-resolves the
# name at most every 30 s, and its reconnect back-off grows to 120 s (make test-compose: 16 of 16
# sessions right after a decode-worker swap failed on the old address). Peers here are few and near:
# re-resolve within 1 s, retry a connection at least every 2 s (measured: back within ~1 s of the new
# container serving).
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.enable_http_proxy", 0),
    ("grpc.dns_min_time_between_resolutions_ms", 1_000),
    ("grpc.min_reconnect_backoff_ms", 1_000),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def _with_token(d: grpc.aio.ClientCallDetails, md: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(d.method, d.timeout, grpc.aio.Metadata(*(d.metadata or ()), md),
                                      d.credentials, d.wait_for_ready)


# Adds ``authorization: Bearer <token>`` to every call of a channel: one class per call shape, since
# grpc.aio files an interceptor under the first shape it implements only.
class _TokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, md: tuple[str, str]) -> None:
        self.md = md

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details, self.md), request)


class _TokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, md: tuple[str, str]) -> None:
        self.md = md

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details, self.md), request)


class _TokenStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, md: tuple[str, str]) -> None:
        self.md = md

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_token(details, self.md), request_iterator)


class _TokenStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, md: tuple[str, str]) -> None:
        self.md = md

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_token(details, self.md), request_iterator)


def _token_interceptors(token: str) -> list:
    md = ("authorization", f"Bearer {token}")
    return [_TokenUnaryUnary(md), _TokenUnaryStream(md), _TokenStreamUnary(md), _TokenStreamStream(md)]


def channel(address: str, token: str | None = None, max_message: int = INTERNAL_MAX_MESSAGE) -> grpc.aio.Channel:
    """A channel to an AMPD service; it sends ``token`` (default: this process's internal secret, else
    its auth token)."""
    token = _internal() if token is None else token
    return grpc.aio.insecure_channel(
        address,
        options=[*CHANNEL_OPTIONS, *_message_options(max_message)],
        interceptors=_token_interceptors(token) if token else None,
    )


def write_ready_file(path: str, port: int, metrics_port: int = 0) -> None:
    """Tells whoever started this server (`ampd up`) its bound ports, once serving: a JSON object
    ``{"port": gRPC port, "metrics_port": /metrics port (0: none)}``, written atomically."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"port": port, "metrics_port": metrics_port}, f)
        os.replace(tmp, path)


def read_ready_file(path: str | os.PathLike) -> dict[str, int]:
    """What write_ready_file wrote: ``{"port": ..., "metrics_port": ...}``."""
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- call streams
class RpcFailure(Exception):
    """A request refused with a gRPC status: a unary handler aborts with it, a call stream replies
    with it (see CallStream)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


async def abort_on_failure(context: grpc.aio.ServicerContext, handle: Callable[[], object]) -> None:
    """Runs ``handle()`` (awaited if it returns an awaitable) for a unary handler: an RpcFailure
    ends the call with its status."""
    try:
        res = handle()
        if inspect.isawaitable(res):
            await res
    except RpcFailure as f:
        await context.abort(f.code, f.details)


async def serve_calls(request_iterator, handle: Callable[[object], object]):
    """The server half of a call stream: ``handle(request)`` (awaited if it returns an awaitable)
    for every request, in order, each answered by a CallReply with its id (code 0, or the
    RpcFailure's status); one with id 0 (``CallStream.post``) is not answered, its failure logged."""
    async for req in request_iterator:
        try:
            res = handle(req)
            if inspect.isawaitable(res):
                await res
        except RpcFailure as f:
            if req.id:
                yield common_pb2.CallReply(id=req.id, code=f.code.value[0], error=f.details)
            else:
                log.warning("unanswered request refused", request=type(req).__name__, code=f.code.name,
                            error=f.details)
        else:
            if not req.id:
                continue
            # The work the request woke (a prefill to start, a task to submit) runs before the reply
            # is written: the caller is not waiting on the reply to go on with that work.
            await asyncio.sleep(0)
            yield common_pb2.CallReply(id=req.id)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


# The initial metadata of DecodeWorker.Attach once the session is open on the worker (a failed open
# sends none): the coordinator holds the session's Control requests (a turn, a cancel) until it comes.
SESSION_OPEN = ("ampd-session", "open")
# The coordinator's session headers also carry the client's reattach token (ampd.coordinators)
REATTACH_HEADER = "ampd-reattach"


def _expire(fut: asyncio.Future, timeout_s: float) -> None:
    """A CallStream call's reply did not come in ``timeout_s``."""
    if not fut.done():
        fut.set_exception(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply in {timeout_s:g} s"))


class CallStream:
    """The client half of a call stream: unary-like calls as messages on one long-lived bidi
    stream. A message costs ~0.1 ms where a unary call costs ~0.65 ms (between processes on this
    2-core box), and the callee sees a request as soon as it arrives. ``await call(request)``
    (``request.id`` is set here) returns when the reply comes and raises grpc.aio.AioRpcError with
    the reply's status, as the unary call would. A broken stream fails the calls in flight with
    its status; the next call opens a new stream."""

    def __init__(self, open_stream: Callable[[object], grpc.aio.StreamStreamCall],
                 on_broken: Callable[[grpc.aio.AioRpcError], None] | None = None) -> None:
        self._open = open_stream
        self._on_broken = on_broken  # called when the stream fails (not when it is closed here)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._outbox: asyncio.Queue | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._reader: asyncio.Task | None = None  # reads the current stream's replies

    async def call(self, request, timeout_s: float = RPC_TIMEOUT_S) -> None:
        await self.send(request, timeout_s)

    def post(self, request) -> None:
        """Puts ``request`` on the stream with id 0: not answered (CallReply), its failure the
        callee's to log. For a request whose caller learns its outcome otherwise: a message less."""
        if self._call is None:
            self._start()
        request.id = 0
        self._outbox.put_nowait(request)

    def send(self, request, timeout_s: float = RPC_TIMEOUT_S) -> Coroutine[None, None, None]:
        """Puts ``request`` on the stream now and returns what ``call`` awaits: its reply, with the
        same errors. For a caller that must not wait, but whose request must leave before the
        work it does next (a task's first step would run only at the loop's next turn)."""
        if self._call is None:
            self._start()
        self._next_id += 1
        request.id = self._next_id
        fut = asyncio.get_running_loop().create_future()
        self._pending[request.id] = fut
        self._outbox.put_nowait(request)
        return self._reply(request, fut, timeout_s)

    async def _reply(self, request, fut: asyncio.Future, timeout_s: float) -> None:
        # A timer that fails the future, not asyncio.wait_for: its timeout context and task
        # bookkeeping cost several times more (a coordinator awaits a few of these a round).
        timer = asyncio.get_running_loop().call_later(timeout_s, _expire, fut, timeout_s)
        try:
            reply = await fut
        finally:
            timer.cancel()
            self._pending.pop(request.id, None)
        if reply.code:
            raise _rpc_error(_CODES.get(reply.code, grpc.StatusCode.UNKNOWN), reply.error)

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()

    def _start(self) -> None:
        outbox: asyncio.Queue = asyncio.Queue()

        async def requests():
            while True:
                yield await outbox.get()

        call = self._open(requests())
        self._call, self._outbox = call, outbox
        self._reader = asyncio.get_running_loop().create_task(self._read(call))

    async def wait_closed(self) -> None:
        """After ``close()``: until its reader has failed the calls still in flight and ended."""
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        err = _rpc_error(grpc.StatusCode.UNAVAILABLE, "call stream ended")
        try:
            async for reply in call:
                fut = self._pending.get(reply.id)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except grpc.aio.AioRpcError as exc:
            err = exc
            if self._on_broken is not None and exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._on_broken(exc)
        except asyncio.CancelledError:
            err = _rpc_error(grpc.StatusCode.CANCELLED, "call stream closed")
        if self._call is call:
            self._call = self._outbox = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
