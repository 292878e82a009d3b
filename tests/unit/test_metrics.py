"""ampd/metrics.py without a network: how RPC values become metrics, the weighted ITL histogram
against prometheus_client's own, the round observations, and that docs/metrics.md and the Grafana
dashboard name exactly the metrics the services export."""
from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ampd import metrics
from ampd.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[2]
_SUFFIX = re.compile(r"_(bucket|count|sum)$")


def render(*collectors) -> dict[str, list[tuple[dict, float]]]:
    reg = CollectorRegistry()
    for c in collectors:
        reg.register(c)
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            if s.name.endswith("_created"):  # the services turn these off (metrics.serve)
                continue
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def fixed(values: dict, labels: dict | None = None):
    return lambda: (values, labels or {})


def test_rpc_values_become_labelled_counters_and_gauges():
    values = {"sessions_completed": 4, "sessions_live": 2, "route_decode-slack": 3, "route_prefill-slack": 5,
              "route_redis_read_ms_total": 1500.0, "route_fallback-local": 1, "route_cost-model+kv-host": 2}
    got = render(metrics.ValuesCollector(fixed(values, {"policy": "ampd"}), metrics.COORDINATOR))
    assert ({"status": "completed"}, 4.0) in got["ampd_sessions_total"]
    assert ({"status": "failed"}, 0.0) in got["ampd_sessions_total"]  # a counter not yet counted reads 0
    assert got["ampd_sessions_active"] == [({}, 2.0)]
    # route_* keys become reasons, except the one another family claims
    assert {ls["reason"]: v for ls, v in got["ampd_route_decisions_total"]} == {
        "decode-slack": 3.0, "prefill-slack": 5.0, "fallback-local": 1.0,
        "cost-model+kv-host": 2.0}  # the KV's location rides on the reason (docs/policies.md)
    assert got["ampd_route_state_read_seconds_total"] == [({}, 1.5)]
    assert "ampd_worker_stats_lag_seconds" not in got  # a gauge without a value is left out
    assert got["ampd_deployment_info"] == [({"policy": "ampd"}, 1.0)]


def test_worker_metrics_carry_the_worker_id():
    got = render(metrics.ValuesCollector(fixed({"queue_length": 3, "kv_used_blocks": 7, "kv_free_blocks": 9}),
                                         metrics.PREFILL, {"worker": "prefill-1"}))
    assert got["ampd_num_requests_waiting"] == [({"worker": "prefill-1"}, 3.0)]
    assert sorted(got["ampd_kv_cache_blocks"], key=lambda x: x[1]) == [
        ({"worker": "prefill-1", "state": "used"}, 7.0), ({"worker": "prefill-1", "state": "free"}, 9.0)]


def test_prefix_sharing_metrics_of_a_decode_worker():
    got = render(metrics.ValuesCollector(fixed({"prefix_shared_tokens": 2048, "prefix_cached_tokens": 512}),
                                         metrics.DECODE, {"worker": "decode-0"}))
    assert got["ampd_prefix_shared_tokens_total"] == [({"worker": "decode-0"}, 2048.0)]
    assert got["ampd_prefix_cached_tokens"] == [({"worker": "decode-0"}, 512.0)]


def test_weighted_histogram_equals_observing_one_by_one():
    ours = metrics.WeightedHistogram("ampd_x_seconds", "x", ["kind"], metrics.ITL_BUCKETS)
    ref = Histogram("ampd_x_seconds", "x", ["kind"], buckets=metrics.ITL_BUCKETS, registry=None)
    for value, n in ((0.02, 5), (0.1, 3), (0.0, 1), (7.0, 2), (99.0, 4)):
        ours.observe(value, n, "initial")
        for _ in range(n):
            ref.labels("initial").observe(value)
    def flat(got):
        return {(name, tuple(sorted(ls.items()))): v for name, samples in got.items() for ls, v in samples}

    a, b = flat(render(ours)), flat(render(ref))
    assert a.keys() == b.keys() and len(a) == len(metrics.ITL_BUCKETS) + 1 + 2
    assert a == pytest.approx(b)


def test_round_metrics_split_initial_and_incremental():
    rm = metrics.RoundMetrics()
    rm.observe(common_pb2.RoundTiming(round=0, input_ready=10.0, first_token=10.5, last_token=11.5, tokens=11))
    rm.observe(common_pb2.RoundTiming(round=1, input_ready=20.0, first_token=20.1, last_token=20.1, tokens=1,
                                      local=True))
    got = render(rm)
    count = {tuple(sorted(ls.items())): v for ls, v in got["ampd_time_to_first_token_seconds_count"]}
    # every series is there from the start, at 0 until observed
    assert count == {(("kind", "initial"), ("prefill", "remote")): 1.0,
                     (("kind", "incremental"), ("prefill", "local")): 1.0,
                     (("kind", "initial"), ("prefill", "local")): 0.0,
                     (("kind", "incremental"), ("prefill", "remote")): 0.0}
    ttft_sum = {(ls["kind"], ls["prefill"]): v for ls, v in got["ampd_time_to_first_token_seconds_sum"]}
    assert ttft_sum[("initial", "remote")] == pytest.approx(0.5)
    assert ttft_sum[("incremental", "local")] == pytest.approx(0.1)
    # 10 gaps of 0.1 s in round 0; round 1 has one token, so no gap
    itl_count = {ls["kind"]: v for ls, v in got["ampd_inter_token_latency_seconds_count"]}
    assert itl_count == {"initial": 10.0, "incremental": 0.0}
    itl_sum = {ls["kind"]: v for ls, v in got["ampd_inter_token_latency_seconds_sum"]}
    assert itl_sum == pytest.approx({"initial": 1.0, "incremental": 0.0})
    assert ({"kind": "initial", "le": "0.1"}, 10.0) in got["ampd_inter_token_latency_seconds_bucket"]
    assert ({"kind": "initial", "le": "0.075"}, 0.0) in got["ampd_inter_token_latency_seconds_bucket"]
    tpot = {ls["kind"]: v for ls, v in got["ampd_request_time_per_output_token_seconds_count"]}
    assert tpot == {"initial": 1.0, "incremental": 0.0}


def test_on_loop_reads_on_the_loop_thread():
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        async def where():
            return threading.get_ident()

        assert metrics.on_loop(loop, where)() == runner.ident
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()
    assert metrics.on_loop(loop, where, timeout_s=0.1)() is None  # a stopped loop: no value, no exception


def exported() -> set[str]:
    """Every metric family name the services export (counters with _total)."""
    values = {k: 1.0 for fams in metrics.FAMILIES.values() for f in fams for k, _ in f.sources}
    for f in (f for fams in metrics.FAMILIES.values() for f in fams if f.prefix):  # one key each
        values[f.prefix + "x"] = 1.0
    collectors = [metrics.ValuesCollector(fixed(values, {"policy": "p"}), fams) for fams in metrics.FAMILIES.values()]
    rm = metrics.RoundMetrics()
    rm.observe(common_pb2.RoundTiming(round=0, input_ready=1.0, first_token=2.0, last_token=3.0, tokens=3))
    plan = metrics.plan_histogram()
    plan.observe(1.0)
    names = set()
    for c in (*collectors, rm, plan):
        names |= {_SUFFIX.sub("", n) for n in render(c)}
    return names


def test_docs_list_exactly_the_exported_metrics():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    rows = set(re.findall(r"^\| `(ampd_[a-z_]+)` \|", doc, re.M))
    assert rows == exported()


def test_the_dashboard_queries_only_exported_metrics():
    dash = json.loads((ROOT / "deploy" / "grafana" / "ampd-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    used = {_SUFFIX.sub("", n) for e in exprs for n in re.findall(r"ampd_[a-z_]+", e)}
    assert used and used <= exported(), used - exported()
    # the panels the issue asks for
    for name in ("ampd_time_to_first_token_seconds", "ampd_inter_token_latency_seconds", "ampd_route_decisions_total",
                 "ampd_num_requests_waiting", "ampd_queue_predicted_seconds", "ampd_kv_cache_blocks",
                 "ampd_nixl_kv_bytes_total", "ampd_sessions_active"):
        assert name in used, name
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
