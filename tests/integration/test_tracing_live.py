"""Tracing, live: a whole deployment (Redis, coordinator, a prefill and a decode worker, a sidecar,
the front) as subprocesses, every service started with --otlp-endpoint pointing at a real OTLP/gRPC
collector that this test serves in-process (the collector service of OpenTelemetry's own proto).

One gRPC session of one turn with two scripted server-side tool calls runs three rounds; its spans
must form one tree in one trace (the trace id derived from the session id) across the coordinator,
the prefill worker, the decode worker and the sidecar: the session, its rounds, each round's route
decision with its reason, the prefill worker's queue wait, KV read, compute and KV write, the
decode, the tool calls and the sidecar's side of them. A session through the front puts the front's
spans in its session's trace too.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections import defaultdict
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from ampd import grpcserver, tracing
from ampd.coordinators import session_events
from ampd.launcher import Deployment, Options
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

pytestmark = pytest.mark.timeout(120)

CLIENT_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # a client's own trace


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector: keeps every span it is sent, with its service's name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, object]] = []

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans.extend((service, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: int) -> list[tuple[str, object]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if int.from_bytes(s.trace_id, "big") == trace_id]


@pytest.fixture(scope="module")
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    c = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    c.endpoint = f"127.0.0.1:{port}"
    yield c
    server.stop(0)


@pytest.fixture(scope="module")
def deployment(collector, redis_url, tmp_path_factory):
    # session_ttl: the front closes its idle session soon, which ends the session's span
    opts = Options(prefill="tp1*1", decode="tp1*1", profile="qwen3-32b@h20", policy="remote",
                   redis_url=redis_url, namespace="tracing", ttft_slo=2.0, itl_slo=0.1, session_ttl=2.0,
                   otlp_endpoint=collector.endpoint, run_dir=str(tmp_path_factory.mktemp("run")))
    with Deployment(opts, frontend=True) as dep:
        yield dep


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out


def _wait_for(collector: Collector, trace_id: int, want, timeout_s: float = 15.0) -> list:
    """The trace's spans once ``want(spans)`` holds (the services batch them for up to a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = collector.of_trace(trace_id)
        if want(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def _session(address: str, sid: str) -> list:
    """One turn of three rounds: two scripted replay calls run on the sidecar between them."""
    def call(n: int) -> common_pb2.ScriptedCall:
        return common_pb2.ScriptedCall(tool=common_pb2.ToolSpec(name="replay", latency_s=0.05), result_tokens=20 + n,
                                       sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))

    turn = common_pb2.Turn(token_ids=list(range(1, 81)), sampling=common_pb2.SamplingParams(max_tokens=4,
                                                                                          ignore_eos=True),
                           server_tools=["replay"], script=[call(0), call(1)])

    async def run():
        ch = grpcserver.channel(address)
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        msgs = [coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(session_id=sid, turn=turn)),
                coordinator_pb2.ClientMessage(close=coordinator_pb2.Close())]
        call_ = stub.Session(iter(msgs), timeout=30, metadata=((tracing.TRACEPARENT, CLIENT_TRACEPARENT),))
        events = [ev async for ev in session_events(call_)]
        await ch.close()
        return events

    return asyncio.run(run())


def test_one_session_of_three_rounds_is_one_span_tree(deployment, collector):
    sid = "trace-me-1"
    events = _session(deployment.coordinator, sid)
    done = [ev for ev in events if ev.HasField("done")]
    assert done and len(done[0].done.rounds) == 3
    tid = tracing.trace_id(sid)

    def complete(spans):
        names = [s.name for _, s in spans]
        return (names.count("round") == 3 and names.count("sidecar.call") == 2 and names.count("decode") == 3
                and names.count("kv_write") == 3 and "session" in names)

    spans = _wait_for(collector, tid, complete)
    by_id = {s.span_id: (svc, s) for svc, s in spans}
    names = sorted(s.name for _, s in spans)
    assert complete(spans), names

    # one root: the session, with the derived id, linked to the client's own trace
    roots = [s for _, s in spans if not s.parent_span_id]
    assert [r.name for r in roots] == ["session"]
    root = roots[0]
    assert int.from_bytes(root.span_id, "big") == tracing.session_span_id(sid)
    assert [(int.from_bytes(li.trace_id, "big"), int.from_bytes(li.span_id, "big")) for li in root.links] == [
        (int(CLIENT_TRACEPARENT[3:35], 16), int(CLIENT_TRACEPARENT[36:52], 16))]
    # every other span's parent is in the trace: one tree
    for svc, s in spans:
        if s is not root:
            assert s.parent_span_id in by_id, (svc, s.name)
            assert s.start_time_unix_nano <= s.end_time_unix_nano, s.name

    children = defaultdict(list)
    for svc, s in spans:
        if s.parent_span_id:
            children[s.parent_span_id].append((svc, s))
    rounds = sorted((s for _, s in children[root.span_id] if s.name == "round"), key=lambda s: _attrs(s)["ampd.round"])
    assert [_attrs(r)["ampd.round"] for r in rounds] == [0, 1, 2]
    services_seen = {svc for svc, _ in spans}
    assert {"ampd-coordinator", "ampd-prefill", "ampd-decode", "ampd-sidecar"} <= services_seen

    for r in rounds:
        n = _attrs(r)["ampd.round"]
        assert int.from_bytes(r.span_id, "big") == tracing.round_span_id(sid, n)
        assert _attrs(r)["ampd.route.reason"]  # why its prefill went where it did
        kids = {s.name: (svc, s) for svc, s in children[r.span_id]}
        assert {"route", "prefill", "decode"} <= set(kids), (n, sorted(kids))
        svc, route = kids["route"]
        assert svc == "ampd-coordinator" and _attrs(route)["ampd.route.reason"] and \
            _attrs(route)["ampd.route.target"] == "prefill-0"
        svc, prefill = kids["prefill"]
        assert svc == "ampd-prefill" and _attrs(prefill)["ampd.route.local"] is False
        steps = {s.name: s for _, s in children[prefill.span_id]}
        assert set(steps) == {"queue_wait", "kv_read", "compute", "kv_write"}
        assert _attrs(steps["kv_read"])["ampd.kv.tokens"] == _attrs(r)["ampd.l_hist"]
        assert (_attrs(r)["ampd.l_hist"] > 0) == (n > 0)  # rounds after the first read their history
        assert kids["decode"][0] == "ampd-decode" and _attrs(kids["decode"][1])["ampd.tokens"] == 4
        if n < 2:  # its tool call, and the sidecar's side of it under it (traceparent)
            svc, tool = kids["tool_call"]
            assert svc == "ampd-decode" and _attrs(tool)["ampd.tool.name"] == "replay"
            assert [(v, s.name) for v, s in children[tool.span_id]] == [("ampd-sidecar", "sidecar.call")]
        else:
            assert "tool_call" not in kids


def _complete(front: str, prompt: list[int], headers: dict) -> dict:
    body = json.dumps({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 3, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{front}/v1/completions", body, {"content-type": "application/json", **headers})
    return json.loads(urllib.request.urlopen(req, timeout=30).read())


def test_front_turns_are_in_their_sessions_trace(deployment, collector):
    prompt = list(range(100, 140))
    sid = ""
    for turn in range(3):  # one session: each prompt continues the last one's history
        # an HTTP client's own context (W3C traceparent) on the request that opens the session
        out = _complete(deployment.frontend, prompt, {"traceparent": CLIENT_TRACEPARENT} if turn == 0 else {})
        sid = sid or out["ampd"]["session_id"]
        assert out["ampd"]["session_id"] == sid
        prompt = prompt + out["choices"][0]["token_ids"] + [200 + turn] * 8
    tid = tracing.trace_id(sid)
    spans = _wait_for(collector, tid, lambda sp: [s.name for _, s in sp].count("front.turn") == 3
                      and [s.name for _, s in sp].count("round") == 3 and "session" in [s.name for _, s in sp])
    turns = [s for svc, s in spans if s.name == "front.turn"]
    assert len(turns) == 3 and all(svc == "ampd-frontend" for svc, s in spans if s.name == "front.turn")
    # under the session's span (derived: the coordinator ends it when the front closes the session)
    assert {int.from_bytes(s.parent_span_id, "big") for s in turns} == {tracing.session_span_id(sid)}
    rounds = {_attrs(s)["ampd.round"] for _, s in spans if s.name == "round"}
    assert rounds == {0, 1, 2}
    # closed at its TTL: the session's span, linked to the HTTP client's context through the front
    (session,) = [s for _, s in spans if s.name == "session"]
    assert [int.from_bytes(li.span_id, "big") for li in session.links] == [int(CLIENT_TRACEPARENT[36:52], 16)]

