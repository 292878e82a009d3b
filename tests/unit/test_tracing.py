"""ampd.tracing: derived ids, W3C traceparent, the endpoint check, off by default, and the spans it
records (on the SDK's in-memory exporter)."""
from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ampd import config, tracing
from ampd.config import ConfigError
from ampd.v1 import common_pb2


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    tracing.setup("test", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()
    assert not tracing.on


def test_derived_ids_are_stable_distinct_and_valid():
    assert tracing.trace_id("s1") == tracing.trace_id("s1") != tracing.trace_id("s2")
    assert 0 < tracing.trace_id("s1") < 2**128
    ids = {tracing.session_span_id("s1"), *(tracing.round_span_id("s1", n) for n in range(50)),
           tracing.round_span_id("s2", 0)}
    assert len(ids) == 52 and all(0 < i < 2**64 for i in ids)
    ctx = tracing.round_context("s1", 3)
    assert (ctx.trace_id, ctx.span_id) == (tracing.trace_id("s1"), tracing.round_span_id("s1", 3))
    assert ctx.trace_flags.sampled


def test_traceparent_round_trip_and_bad_values():
    ctx = tracing.session_context("abc")
    text = tracing.traceparent(ctx)
    assert text == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"
    back = tracing.parse_traceparent(text)
    assert (back.trace_id, back.span_id, back.is_remote) == (ctx.trace_id, ctx.span_id, True)
    assert tracing.parse_traceparent(text.upper().encode()).span_id == ctx.span_id
    for bad in ("", None, "00-xyz", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "00-" + "1" * 32 + "-" + "0" * 16 + "-01",
                text + "-extra", "zz" + text[2:]):
        assert tracing.parse_traceparent(bad) is None, bad
    # gRPC metadata: tuples, or the aio objects with key/value
    assert tracing.from_metadata((("authorization", "x"), ("traceparent", text))).span_id == ctx.span_id
    assert tracing.from_metadata([SimpleNamespace(key="traceparent", value=text)]).span_id == ctx.span_id
    assert tracing.from_metadata({"traceparent": text}).span_id == ctx.span_id
    assert tracing.from_metadata(None) is None and tracing.from_metadata((("a", "b"),)) is None


@pytest.mark.parametrize("good", ["", "collector:4317", "127.0.0.1:4317", "http://otel.example:4317",
                                  "https://otel.example:4317/", "[::1]:4317"])
def test_endpoint_accepted(good):
    tracing.check_endpoint(good)


@pytest.mark.parametrize("bad", ["collector", "http://collector", "ftp://x:1", "x:0", "x:99999", "x:43a17", " x:1"])
def test_bad_endpoint_names_the_flag(bad):
    with pytest.raises(ConfigError, match=r"--otlp-endpoint \(AMPD_OTLP_ENDPOINT\)"):
        tracing.check_endpoint(bad)


def test_a_service_given_a_bad_endpoint_says_so_without_a_traceback(capsys):
    from services.sidecar.server import main

    with pytest.raises(SystemExit) as exc:
        main(["--otlp-endpoint", "nowhere"])
    assert "ampd-sidecar: error: --otlp-endpoint" in str(exc.value.code)


def test_every_service_and_ampd_up_take_the_setting_off_by_default():
    assert config.Config().get("otlp_endpoint") == ""
    for service, names in config.SERVICE_SETTINGS.items():
        assert "otlp_endpoint" in names, service
        assert "AMPD_OTLP_ENDPOINT" in config.env_names(service), service
    assert "otlp_endpoint" in config.UP_SETTINGS


def test_off_records_nothing_and_loads_no_tracing_sdk():
    """Off (no endpoint): every hook is a test of ``tracing.on``; neither the tracing SDK nor the
    exporter is imported (redis-py imports the OTel API and its metrics SDK itself when installed)."""
    code = ("import sys; from ampd import tracing; tracing.setup('x', ''); "
            "assert not tracing.on; "
            "assert tracing.record('a', 0, 1) is None and tracing.start('a', None) is None; "
            "assert tracing.metadata(None) is None; "
            "import services.coordinator.session, services.decode.worker, services.prefill.worker; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace', "
            "'opentelemetry.exporter'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_session_round_and_route_spans_form_one_tree(spans):
    sid = "sess-7"
    t = common_pb2.RoundTiming(round=1, input_ready=100.0, first_token=100.25, last_token=101.0, tokens=9,
                               local=False, prefill_worker="prefill-0", route_reason="slack-remote", l_hist=40,
                               l_incr=12, finish_reason="tool_calls")
    tracing.round_span(sid, t)
    decision = SimpleNamespace(reason="slack-remote", target="prefill-0", local=False, estimates={"ttft_remote": 0.2})
    tracing.route_span(sid, 1, decision, 100.001, 100.002, 40, 12)
    client = tracing.parse_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    tracing.session_span(sid, 99.0, 102.0, {"ampd.decode_worker": "decode-0"}, caller=client)
    got = {s.name: s for s in spans.get_finished_spans()}
    assert set(got) == {"round", "route", "session"}
    session, rnd, route = got["session"], got["round"], got["route"]
    tid = tracing.trace_id(sid)
    assert {s.context.trace_id for s in got.values()} == {tid}
    assert session.parent is None and session.context.span_id == tracing.session_span_id(sid)
    assert [link.context.span_id for link in session.links] == [client.span_id]
    assert rnd.parent.span_id == session.context.span_id and rnd.context.span_id == tracing.round_span_id(sid, 1)
    assert route.parent.span_id == rnd.context.span_id
    assert (rnd.start_time, rnd.end_time) == (100_000_000_000, 101_000_000_000)
    assert rnd.attributes["ampd.route.reason"] == "slack-remote" and rnd.attributes["ampd.ttft_s"] == pytest.approx(0.25)
    assert route.attributes["ampd.estimate.ttft_remote"] == 0.2 and route.attributes["ampd.route.local"] is False
    assert session.resource.attributes["service.name"] == "ampd-test"


def test_a_live_span_is_the_parent_its_callee_is_told(spans):
    parent = tracing.round_context("s", 0)
    live = tracing.start("tool_call", parent, {"ampd.tool.name": "replay"}, kind="client")
    md = tracing.metadata(live.context)
    time.sleep(0.001)
    callee = tracing.from_metadata(md)
    tracing.record("sidecar.call", time.time(), time.time(), callee, kind="server")
    live.end(error="boom", **{"ampd.tool.result_tokens": 3})
    got = {s.name: s for s in spans.get_finished_spans()}
    assert got["tool_call"].context.span_id == live.context.span_id == callee.span_id
    assert got["sidecar.call"].parent.span_id == got["tool_call"].context.span_id
    assert got["tool_call"].parent.span_id == parent.span_id
    assert not got["tool_call"].status.is_ok and got["tool_call"].attributes["ampd.tool.result_tokens"] == 3
    assert got["tool_call"].end_time > got["tool_call"].start_time


def test_an_end_before_its_start_is_clamped_and_none_attributes_dropped(spans):
    ctx = tracing.record("x", 10.0, 9.0, tracing.session_context("s"), {"a": 1, "b": None})
    (s,) = spans.get_finished_spans()
    assert s.context.span_id == ctx.span_id and s.end_time == s.start_time
    assert dict(s.attributes) == {"a": 1}


def test_ampd_up_refuses_a_bad_endpoint_before_starting_anything(tmp_path):
    from ampd.cli import CliError
    from ampd.launcher import Deployment, Options

    with pytest.raises(CliError, match="--otlp-endpoint"):
        Deployment(Options(otlp_endpoint="collector", run_dir=str(tmp_path)))
    assert not any(tmp_path.iterdir())  # nothing was started


def test_a_local_rounds_spans_on_the_decode_worker(spans):
    from services.decode.session import round_spans

    t = common_pb2.RoundTiming(round=2, input_ready=10.0, first_token=10.5, last_token=11.0, tokens=7, local=True,
                               l_hist=64, l_incr=8, finish_reason="stop")
    round_spans(SimpleNamespace(session_id="s", timing=t, admitted_at=10.1, prefill_at=10.2), "decode-3")
    got = {s.name: s for s in spans.get_finished_spans()}
    assert set(got) == {"kv_admit", "prefill", "queue_wait", "compute", "decode"}
    rnd = tracing.round_span_id("s", 2)
    assert {got[n].parent.span_id for n in ("kv_admit", "prefill", "decode")} == {rnd}
    assert got["queue_wait"].parent.span_id == got["compute"].parent.span_id == got["prefill"].context.span_id
    assert (got["compute"].start_time, got["compute"].end_time) == (10_200_000_000, 10_500_000_000)
    assert got["prefill"].attributes["ampd.route.local"] is True and got["decode"].attributes["ampd.tokens"] == 7
