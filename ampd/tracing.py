"""OpenTelemetry spans of sessions, off by default (``--otlp-endpoint``; docs/deploy.md "Tracing").

One session is one trace, across every service it crosses. Its ids are derived from its session id,
so that every service names the same spans without being told:

- trace id: ``trace_id(sid)``;
- the session's span (the trace's root, ended by the coordinator): ``session_span_id(sid)``;
- round ``n``'s span (ended by the coordinator at the round's end): ``round_span_id(sid, n)``.

A prefill worker gets its tasks over a call stream that many sessions share (no per-task gRPC
metadata), and a second coordinator that takes a session over keeps its trace: the derived ids hold
in both cases. Every other service's span of a round is a child of the round's span. Where a call
is one request (a sidecar's tool call) or one session (``Coordinator.Session``), the W3C
``traceparent`` goes in its gRPC metadata: a sidecar's span is the child of the decode worker's tool
call span, and a client's own context is linked from the session's span.

Spans are recorded when their work is over, from the times the services already keep (a round's
``RoundTiming``, a task's queue and transfer times): the serving path opens nothing. With tracing off
(``on`` is False) every hook is one test of that flag, and nothing is imported from OpenTelemetry.
"""
from __future__ import annotations

import hashlib
import random
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["on", "setup", "shutdown", "check_endpoint", "trace_id", "session_span_id", "round_span_id",
           "session_context", "round_context", "record", "start", "traceparent", "parse_traceparent",
           "metadata", "from_metadata", "TRACEPARENT"]

on = False  # spans are recorded (setup ran with an endpoint, or an exporter)
TRACEPARENT = "traceparent"  # the W3C header, as gRPC metadata (keys are lower case)
SCHEDULE_DELAY_MS = 1000  # spans batch this long before they go to the collector
EXPORT_TIMEOUT_S = 2.0  # one export's bound: a stopping service flushes within its stop deadline

_processor: Any = None  # the SDK's span processor: batches to the exporter
_resource: Any = None  # this service's name
_scope: Any = None
_KINDS: dict[str, Any] = {}  # "server" -> SpanKind.SERVER
_rng = random.Random()  # random span ids: its own, seeded from the OS (a seeded global would repeat them)
_ENDPOINT = re.compile(r"^(?:(?P<scheme>https?)://)?(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})/?$")
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


# ---------------------------------------------------------------------------------- derived ids
def _digest(*parts: object) -> bytes:
    return hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()


def trace_id(session_id: str) -> int:
    """The trace of session ``session_id`` (128 bits, never 0)."""
    return int.from_bytes(_digest("ampd-trace", session_id)[:16], "big") or 1


def session_span_id(session_id: str) -> int:
    return int.from_bytes(_digest("ampd-session", session_id)[:8], "big") or 1


def round_span_id(session_id: str, rnd: int) -> int:
    return int.from_bytes(_digest("ampd-round", session_id, rnd)[:8], "big") or 1


def _context(tid: int, sid: int):
    from opentelemetry.trace import SpanContext, TraceFlags

    return SpanContext(tid, sid, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def session_context(session_id: str):
    """The session span's context (a parent for the spans of the session that are no round's)."""
    return _context(trace_id(session_id), session_span_id(session_id))


def round_context(session_id: str, rnd: int):
    """Round ``rnd``'s span context: the parent of every service's span of that round."""
    return _context(trace_id(session_id), round_span_id(session_id, rnd))


# ------------------------------------------------------------------------------- W3C traceparent
def traceparent(ctx) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def parse_traceparent(text: str | bytes | None):
    """The SpanContext of a W3C traceparent value; None when absent or malformed (a bad header from
    a client never fails its call: it is not traced under it)."""
    if not text:
        return None
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    m = _TRACEPARENT.match(text.strip().lower())
    if m is None or int(m.group(1), 16) == 0 or int(m.group(2), 16) == 0:
        return None
    from opentelemetry.trace import SpanContext, TraceFlags

    return SpanContext(int(m.group(1), 16), int(m.group(2), 16), is_remote=True,
                       trace_flags=TraceFlags(int(m.group(3), 16) & 0x01))


def metadata(ctx) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying ``ctx`` (None when tracing is off or there is none)."""
    if not on or ctx is None:
        return None
    return ((TRACEPARENT, traceparent(ctx)),)


def from_metadata(md: Iterable | Mapping | None):
    """The SpanContext in a call's metadata (``context.invocation_metadata()``), or None."""
    if not md:
        return None
    items = md.items() if isinstance(md, Mapping) else md
    for item in items:
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == TRACEPARENT:
            return parse_traceparent(value)
    return None


# ------------------------------------------------------------------------------------- set-up
def check_endpoint(endpoint: str) -> None:
    """ConfigError naming the flag when ``endpoint`` is neither empty nor HOST:PORT or
    http(s)://HOST:PORT."""
    from ampd.config import ConfigError  # here: ampd.grpcserver imports this module, the config need not load

    if endpoint and (_ENDPOINT.match(endpoint) is None or not 0 < int(_ENDPOINT.match(endpoint)["port"]) < 65536):
        raise ConfigError(f"--otlp-endpoint (AMPD_OTLP_ENDPOINT): expected HOST:PORT or http(s)://HOST:PORT of an "
                          f"OTLP/gRPC collector, got {endpoint!r}")


def setup(service: str, endpoint: str = "", *, exporter=None, instance: str = "",
          schedule_delay_ms: int = SCHEDULE_DELAY_MS, batch: bool | None = None) -> None:
    """Turns tracing on for this process when ``endpoint`` (an OTLP/gRPC collector) or ``exporter``
    (an SDK SpanExporter, for tests) is given; otherwise leaves it off and imports nothing. Spans go
    out in batches from a thread of their own (``batch``; a test's exporter gets each span at once
    unless it asks for batches)."""
    global on, _processor, _resource, _scope
    check_endpoint(endpoint)
    if not endpoint and exporter is None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        m = _ENDPOINT.match(endpoint)
        exporter = OTLPSpanExporter(endpoint=f"{m['host']}:{m['port']}", insecure=m["scheme"] != "https",
                                    timeout=EXPORT_TIMEOUT_S)
    if batch or (batch is None and endpoint):
        processor = BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay_ms,
                                       export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000))
    else:
        processor = SimpleSpanProcessor(exporter)
    attrs = {"service.name": f"ampd-{service}"}
    if instance:
        attrs["service.instance.id"] = instance
    shutdown()
    _resource, _scope = Resource.create(attrs), InstrumentationScope("ampd")
    _processor = processor
    on = True


def shutdown() -> None:
    """Sends the spans still batched and turns tracing off (a stopping service)."""
    global on, _processor
    processor, _processor, on = _processor, None, False
    if processor is not None:
        processor.shutdown()


# ------------------------------------------------------------------------------------- spans
def _ns(t: float) -> int:
    return int(t * 1e9)


def record(name: str, start_s: float, end_s: float, parent=None, attrs: Mapping[str, Any] | None = None, *,
           span_id: int | None = None, trace: int | None = None, links: Sequence = (), kind: str = "internal",
           error: str = ""):
    """Records a span that is over: from ``start_s`` to ``end_s`` (unix seconds), under ``parent``
    (a SpanContext; None: a root, of trace ``trace``). ``span_id`` fixes its id (a derived one).
    Returns its SpanContext (the parent of its own children), or None when tracing is off.

    The span goes to the processor as finished: the SDK's tracer (its sampler, context, attribute
    checks and live-span bookkeeping) would cost several times as much per span, for nothing a
    finished span needs."""
    if not on:
        return None
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

    if not _KINDS:
        _KINDS.update((k.name.lower(), k) for k in SpanKind)
    ctx = SpanContext(parent.trace_id if parent is not None else (trace or _rng.getrandbits(128) or 1),
                      span_id or _rng.getrandbits(64) or 1, is_remote=False,
                      trace_flags=TraceFlags(TraceFlags.SAMPLED))
    span = ReadableSpan(name, ctx, parent, _resource, {k: v for k, v in (attrs or {}).items() if v is not None},
                        links=[Link(c) for c in links if c is not None], kind=_KINDS[kind],
                        status=Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET),
                        start_time=_ns(start_s), end_time=_ns(max(end_s, start_s)), instrumentation_scope=_scope)
    _processor.on_end(span)
    return ctx


class _Live:
    """A span that runs now (``start``): ``end()`` records it with what it learnt."""

    def __init__(self, name: str, parent, attrs: Mapping[str, Any] | None, kind: str) -> None:
        from opentelemetry.trace import SpanContext, TraceFlags

        self.name, self.parent, self.kind = name, parent, kind
        self.attrs = dict(attrs or {})
        self.t0 = time.time()
        self.span_id = _rng.getrandbits(64) or 1
        # known before it ends: what its callee's spans name as their parent (traceparent)
        self.context = SpanContext(parent.trace_id, self.span_id, is_remote=False,
                                   trace_flags=TraceFlags(TraceFlags.SAMPLED))

    def end(self, error: str = "", **attrs: Any) -> None:
        self.attrs.update(attrs)
        record(self.name, self.t0, time.time(), self.parent, self.attrs, span_id=self.span_id, kind=self.kind,
               error=error)


def start(name: str, parent, attrs: Mapping[str, Any] | None = None, kind: str = "internal") -> _Live | None:
    """A span that starts now under ``parent`` (None when tracing is off)."""
    if not on or parent is None:
        return None
    return _Live(name, parent, attrs, kind)


# ----------------------------------------------------------------------- the coordinator's spans
def session_span(session_id: str, start_s: float, end_s: float, attrs: Mapping[str, Any] | None = None,
                 caller=None, error: str = "") -> None:
    """The session's span: the trace's root. ``caller``, the context a client sent with the session
    (its traceparent), is linked: the client's own trace points into the session's."""
    record("session", start_s, end_s, None, {"ampd.session_id": session_id, **(attrs or {})},
           span_id=session_span_id(session_id), trace=trace_id(session_id), links=(caller,), kind="server",
           error=error)


def round_span(session_id: str, t) -> None:
    """Round ``t.round``'s span from its RoundTiming: from its input being ready to its last token,
    with where its prefill ran and why."""
    record("round", t.input_ready, t.last_token or time.time(), session_context(session_id), {
        "ampd.session_id": session_id, "ampd.round": t.round, "ampd.route.reason": t.route_reason,
        "ampd.route.local": t.local, "ampd.prefill_worker": t.prefill_worker, "ampd.l_hist": t.l_hist,
        "ampd.l_incr": t.l_incr, "ampd.tokens": t.tokens, "ampd.finish_reason": t.finish_reason,
        "ampd.recovered": t.recovered, "ampd.ttft_s": max(0.0, t.first_token - t.input_ready)},
        span_id=round_span_id(session_id, t.round))


def route_span(session_id: str, rnd: int, decision, start_s: float, end_s: float, l_hist: int, l_incr: int) -> None:
    """Algorithm 1's decision for round ``rnd``: where its prefill goes, why, and the estimates."""
    attrs = {"ampd.session_id": session_id, "ampd.round": rnd, "ampd.route.reason": decision.reason,
             "ampd.route.target": decision.target, "ampd.route.local": decision.local, "ampd.l_hist": l_hist,
             "ampd.l_incr": l_incr}
    attrs.update((f"ampd.estimate.{k}", float(v)) for k, v in decision.estimates.items())
    record("route", start_s, end_s, round_context(session_id, rnd), attrs)
