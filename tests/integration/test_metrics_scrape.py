"""Prometheus /metrics of every service, live: a deployment from the launcher, a replay of toolbench
sessions, scrapes during and after it parsed with the Prometheus text parser. The counts are checked
against what the replay saw (rounds, tokens, where each prefill ran, KV bytes)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ampd import grpcserver
from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.v1 import common_pb2, coordinator_pb2_grpc
from ampd.workload import generate

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
BYTES_PER_TOKEN = 64  # the mock engine's KV bytes per token (kv_bytes_per_token's default)


class Scrape:
    """One parsed /metrics page: every sample by name, with its labels."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for fam in text_string_to_metric_families(text):
            self.types[fam.name] = fam.type
            for s in fam.samples:
                self.samples[s.name].append((s.labels, s.value))

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        assert name in self.samples, f"{name} is not exposed (have: {sorted(self.samples)[:40]})"
        return sum(v for ls, v in self.samples[name] if all(ls.get(k) == x for k, x in labels.items()))

    def labels(self, name: str, label: str) -> set[str]:
        return {ls[label] for ls, _ in self.samples.get(name, ()) if label in ls}


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return Scrape(r.read().decode())


@pytest.fixture(scope="module")
def deployment(redis_url, tmp_path_factory):
    # threshold: long prompts go to the prefill worker, short tool results stay local, so both
    # kinds of route, both kinds of TTFT and NIXL traffic all happen.
    opts = Options(prefill="tp8*1", decode="tp8*1", profile="qwen3-32b@h20", policy="threshold",
                   threshold_tokens=1000, redis_url=redis_url, namespace="metrics", ttft_slo=2.0, itl_slo=0.1,
                   run_dir=str(tmp_path_factory.mktemp("run")))
    with Deployment(opts) as dep:
        yield dep


@pytest.fixture(scope="module")
def replayed(deployment):
    """Replays toolbench sessions while scraping every service every 0.2 s; returns the records and
    the scrapes taken during the replay."""
    sessions = generate("toolbench", rate=5.0, duration=10.0, seed=3)[:6]

    async def run():
        during: list[dict[str, Scrape]] = []
        done = asyncio.Event()

        async def poll():
            while not done.is_set():
                during.append({n: await asyncio.to_thread(scrape, u) for n, u in deployment.metrics.items()})
                await asyncio.sleep(0.2)

        poller = asyncio.create_task(poll())
        try:
            out = await replay(deployment.coordinator, sessions, verify_tokens=True, progress=False, timeout_s=180)
        finally:
            done.set()
            await poller
        return out, during

    (records, stats, _wall, _labels), during = asyncio.run(run())
    failed = [r for r in records if not r.completed]
    assert not failed, [r.error for r in failed[:3]]
    assert stats.token_mismatches == 0
    return sessions, records, during


def _listening(port: int) -> set[str]:
    """The local addresses a TCP socket listens on ``port`` at (IPv4, from /proc/net/tcp)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, _remote, state = line.split()[1:4]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
            out.add(".".join(str(b) for b in reversed(bytes.fromhex(addr))))
    return out


def test_the_launcher_knows_every_metrics_url_and_each_binds_loopback(deployment):
    assert set(deployment.metrics) == {"coordinator", "decode-0", "prefill-0", "sidecar-0"}
    for url in deployment.metrics.values():
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        assert _listening(int(url.rsplit(":", 1)[1].split("/")[0])) == {"127.0.0.1"}, url


def test_gauges_move_during_the_replay(replayed):
    _sessions, _records, during = replayed
    assert len(during) >= 3
    assert max(s["coordinator"].total("ampd_sessions_active") for s in during) >= 1
    assert max(s["decode-0"].total("ampd_sessions_bound") for s in during) >= 1
    assert max(s["decode-0"].total("ampd_kv_cache_blocks", state="used") for s in during) >= 1
    assert max(s["decode-0"].total("ampd_kv_cache_usage_perc") for s in during) > 0
    for s in during:  # the pool's blocks are all accounted for, whatever the moment
        blocks = s["decode-0"].total("ampd_kv_cache_blocks")
        assert blocks == during[0]["decode-0"].total("ampd_kv_cache_blocks") and blocks > 0


def test_coordinator_histograms_and_counters_match_the_replay(deployment, replayed):
    sessions, records, _ = replayed
    m = scrape(deployment.metrics["coordinator"])
    rounds = [rr for r in records for rr in r.rounds]
    remote = [rr for rr in rounds if rr.local is False]
    local = [rr for rr in rounds if rr.local is True]
    assert remote and local and len(remote) + len(local) == len(rounds)

    assert m.types["ampd_time_to_first_token_seconds"] == "histogram"
    ttft = "ampd_time_to_first_token_seconds_count"
    assert m.total(ttft, kind="initial") == len(sessions)
    assert m.total(ttft, kind="incremental") == len(rounds) - len(sessions)
    assert m.total(ttft, prefill="remote") == len(remote) and m.total(ttft, prefill="local") == len(local)
    assert m.total("ampd_time_to_first_token_seconds_sum") > 0
    # the +Inf bucket holds every observation
    assert m.total("ampd_time_to_first_token_seconds_bucket", le="+Inf") == len(rounds)

    tokens = sum(len(rr.token_times) for rr in rounds)
    gaps = sum(len(rr.token_times) - 1 for rr in rounds)
    assert m.types["ampd_inter_token_latency_seconds"] == "histogram"
    assert m.total("ampd_inter_token_latency_seconds_count") == gaps
    assert m.total("ampd_inter_token_latency_seconds_bucket", le="+Inf") == gaps
    # exact sum: a round's gaps add up to last token - first token, measured where the tokens were made
    want = sum(rr.token_times[-1] - rr.token_times[0] for rr in rounds)
    assert m.total("ampd_inter_token_latency_seconds_sum") == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert m.total("ampd_request_time_per_output_token_seconds_count") == sum(
        1 for rr in rounds if len(rr.token_times) > 1)

    assert m.types["ampd_route_decisions"] == "counter"
    assert m.labels("ampd_route_decisions_total", "reason") == {"threshold-local", "threshold-remote"}
    assert m.total("ampd_route_decisions_total", reason="threshold-remote") == len(remote)
    assert m.total("ampd_route_decisions_total", reason="threshold-local") == len(local)
    assert m.total("ampd_prefills_routed_total", where="remote") == len(remote)
    # round 0s are routed with their open (decode.proto Route); the rounds after server-side tool
    # calls ask with a PrefillTask. A session opened before the coordinator has its decode worker's
    # first statistics (the deployment just started) asks too: its route cannot be decided yet.
    assert 0 < m.total("ampd_prefills_routed_with_turn_total") <= len(sessions)

    assert m.total("ampd_sessions_total", status="opened") == len(sessions)
    assert m.total("ampd_sessions_total", status="completed") == len(sessions)
    assert m.total("ampd_sessions_total", status="failed") == 0
    assert m.total("ampd_sessions_active") == 0
    assert m.total("ampd_deployment_info", policy="threshold", profile="qwen3-32b@h20") == 1
    assert tokens == sum(r.output for s in sessions for r in s.rounds)


def test_the_metrics_rpc_is_the_same_numbers(deployment, replayed):
    async def rpc():
        ch = grpcserver.channel(deployment.coordinator)
        reply = await coordinator_pb2_grpc.CoordinatorStub(ch).Metrics(common_pb2.MetricsRequest(), timeout=10)
        await ch.close()
        return dict(reply.values)

    values = asyncio.run(rpc())
    m = scrape(deployment.metrics["coordinator"])
    assert m.total("ampd_sessions_total", status="completed") == values["sessions_completed"] > 0
    assert m.total("ampd_route_decisions_total", reason="threshold-local") == values["route_threshold-local"]


def test_workers_count_queue_kv_and_nixl_bytes(deployment, replayed):
    sessions, records, _ = replayed
    rounds = [rr for r in records for rr in r.rounds]
    remote = [rr for rr in rounds if rr.local is False]
    p = scrape(deployment.metrics["prefill-0"])
    d = scrape(deployment.metrics["decode-0"])
    for m, wid in ((p, "prefill-0"), (d, "decode-0")):
        assert m.labels("ampd_num_requests_waiting", "worker") == {wid}
        assert m.total("ampd_num_requests_waiting") == 0  # drained
        assert m.total("ampd_queue_predicted_seconds") == 0
        assert m.total("ampd_kv_cache_blocks", state="used") == 0  # every session closed
        assert m.total("ampd_kv_cache_blocks", state="free") > 0
        assert m.total("ampd_kv_bytes_mismatched_total") == 0
        assert m.total("process_cpu_seconds_total") > 0
        assert m.types["ampd_queue_pops"] == "counter"
        assert m.total("ampd_queue_pops_total", kind="reordered") == 0  # threshold: FCFS queues
        assert 0 <= m.total("ampd_queue_pops_total", kind="choice") <= len(rounds)
    # The prefill worker read the history and wrote the new KV of every remote prefill over NIXL.
    new_bytes = BYTES_PER_TOKEN * sum(rr.l_incr for rr in remote)
    assert p.types["ampd_nixl_kv_bytes"] == "counter"
    assert p.total("ampd_nixl_kv_bytes_total", direction="written") == new_bytes > 0
    assert p.total("ampd_nixl_kv_bytes_total", direction="read") == BYTES_PER_TOKEN * sum(rr.l_hist for rr in remote)
    assert p.total("ampd_prefill_tasks_total", status="done") == len(remote)
    assert p.total("ampd_prefill_tokens_total", part="new") == sum(rr.l_incr for rr in remote)
    assert p.total("ampd_window_mean_seconds") > 0  # windowed TTFT of its prefills
    # ... and the decode worker checked every byte that landed.
    assert d.total("ampd_kv_bytes_verified_total") == new_bytes
    assert d.total("ampd_prefills_completed_total", where="remote") == len(remote)
    assert d.total("ampd_prefills_completed_total", where="local") == len(rounds) - len(remote)
    assert d.total("ampd_generation_tokens_total") == sum(len(rr.token_times) for rr in rounds)
    assert d.total("ampd_decode_steps_total") > 0
    assert d.total("ampd_decode_sessions_total", status="completed") == len(sessions)
    assert d.total("ampd_tool_calls_total") == len(rounds) - len(sessions)


def test_prometheus_sees_the_same_names_in_openmetrics(deployment, replayed):
    """Prometheus asks for OpenMetrics first; its names must be the ones the text format shows
    (prometheus_client would rewrite a ':' in a name there)."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    for name, url in deployment.metrics.items():
        req = urllib.request.Request(url, headers={"Accept": accept})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text"), name
            om = {s.name for fam in parse_openmetrics(r.read().decode()) for s in fam.samples}
        ours = {n for n in scrape(url).samples if n.startswith("ampd")}
        assert ours and ours <= om, (name, ours - om)


def test_the_sidecar_counts_its_tool_calls(deployment, replayed):
    sessions, records, _ = replayed
    m = scrape(deployment.metrics["sidecar-0"])
    calls = sum(len(r.rounds) - 1 for r in records)
    assert m.total("ampd_sidecar_calls_total") == calls > 0
    assert m.total("ampd_sidecar_call_failures_total") == 0


def test_the_planner_serves_metrics(tmp_path):
    """The planner is not part of `ampd up`: started alone, its plan histogram moves with a plan."""
    from ampd.v1 import planner_pb2, planner_pb2_grpc
    from ampd.workload import dump_trace

    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "services.planner", "--port", "0", "--ready-file", str(ready)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, AMPD_LOG_LEVEL="WARNING"))
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.05)
        ports = json.loads(ready.read_text())
        url = f"http://127.0.0.1:{ports['metrics_port']}/metrics"
        assert scrape(url).total("ampd_plan_duration_seconds_count") == 0
        trace = tmp_path / "t.jsonl"
        dump_trace(generate("toolbench", 1.0, 20.0, 5)[:5], trace)

        async def plan():
            ch = grpcserver.channel(f"127.0.0.1:{ports['port']}")
            await planner_pb2_grpc.PlannerStub(ch).Plan(planner_pb2.PlanRequest(
                profile="qwen3-32b@h20", trace_jsonl=trace.read_text(), gpus=2, top=1, candidates=1), timeout=120)
            await ch.close()

        asyncio.run(plan())
        m = scrape(url)
        assert m.types["ampd_plan_duration_seconds"] == "histogram"
        assert m.total("ampd_plan_duration_seconds_count") == 1
        assert m.total("ampd_plan_duration_seconds_sum") > 0
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_taken_metrics_port_is_a_clear_error():
    import socket

    from ampd import metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"--metrics-port: cannot bind 127.0.0.1:{port}"):
            metrics.serve("127.0.0.1", port, [])


def test_client_turns_are_routed_with_the_turn(deployment, replayed):
    """Last in this module (it adds rounds to the counters the tests above compare): with the tools on
    the client, every round begins with a client's turn, so every route goes with it and holds, both
    local and remote ones (the threshold policy makes both), and every token is still right."""
    # ids of their own: a replayed prompt begins with ids of its session's (ampd.workload.ids.round_ids),
    # and the replay above had these ids; with --prefix-sharing (the default) their first prompts would
    # share the blocks the decode worker still caches from it and, prefilling a block or two, all stay local
    sessions = [dataclasses.replace(s, id=f"client-{s.id}")
                for s in generate("toolbench", rate=5.0, duration=10.0, seed=5)[:4]]
    before = scrape(deployment.metrics["coordinator"])
    records, stats, _, _ = asyncio.run(replay(deployment.coordinator, sessions, client_tools=True,
                                              verify_tokens=True, progress=False, timeout_s=180))
    assert all(r.completed for r in records), [r.error for r in records if not r.completed][:3]
    assert stats.token_mismatches == 0
    after = scrape(deployment.metrics["coordinator"])
    rounds = [rr for r in records for rr in r.rounds]
    assert {rr.local for rr in rounds} == {True, False}

    def delta(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    assert delta("ampd_prefills_routed_with_turn_total") == len(rounds)
    assert delta("ampd_prefills_routed_total", where="remote") == sum(1 for rr in rounds if not rr.local)
    assert delta("ampd_prefills_routed_total", where="local") == sum(1 for rr in rounds if rr.local)
