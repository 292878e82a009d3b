"""Prometheus metrics of every AMPD service: the names, the collectors, the ``/metrics`` server.

Names follow vLLM's where the same quantity exists, under the prefix ``ampd_``
(``ampd_time_to_first_token_seconds`` beside ``vllm:time_to_first_token_seconds``), not vLLM's
``vllm:``: prometheus_client's OpenMetrics output (what Prometheus asks for) rewrites ``:`` to ``_``.
docs/metrics.md lists every metric. Three sources feed a service's registry:

- the values its ``Metrics`` RPC returns, read at scrape time (``rpc_collector``): the RPC and
  ``/metrics`` are two views of the same numbers, and no request path is touched to count them;
- the coordinator's per-round latencies, observed once per ``RoundEnd`` (``RoundMetrics``);
- the process's own CPU, memory and GC (prometheus_client's collectors).

The HTTP side is prometheus_client's own server (a WSGI server on a daemon thread). A scrape reads
the RPC values on the service's event loop (``asyncio.run_coroutine_threadsafe``), so the state it
reads is never seen half-updated from the server's thread.
"""
from __future__ import annotations

import asyncio
import math
import threading
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ampd.policy.admit import REFUSAL_REASONS

log = structlog.get_logger()

PREFIX = "ampd_"
# vLLM's TTFT buckets, with finer ones below 10 ms (the zero-cost profile and local prefills).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0)
PLAN_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


# ------------------------------------------------------------------------- RPC values as metrics
@dataclass(frozen=True)
class Family:
    """One metric made of Metrics-RPC values. ``sources`` maps value keys to the value of the one
    label ``label`` (empty: no label); with ``prefix``, every other key starting with it is a
    source, labelled by the rest of the key. A counter whose key is absent reads 0 (it has not
    counted yet); an absent gauge is left out (it has no value yet)."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    sources: tuple[tuple[str, str], ...] = ()
    label: str = ""
    prefix: str = ""
    scale: float = 1.0


def _one(name: str, kind: str, key: str, help: str, scale: float = 1.0) -> Family:
    return Family(name, kind, help, ((key, ""),), scale=scale)


# Every worker (prefill and decode): its queue, its KV pool and what crossed NIXL.
WORKER = (
    _one("num_requests_waiting", "gauge", "queue_length", "prefill tasks waiting in this worker's queue"),
    _one("queue_predicted_seconds", "gauge", "queue_predicted_s",
         "predicted seconds until this worker's queue drains (the value it publishes for routing)"),
    _one("window_mean_seconds", "gauge", "window_mean_s",
         "windowed mean the router reads: TTFT on a prefill worker, ITL on a decode worker"),
    Family("kv_cache_blocks", "gauge", "KV pool blocks by state (free: what a new round can take, cached "
           "prefix blocks nobody holds included)", (("kv_used_blocks", "used"), ("kv_free_blocks", "free")),
           label="state"),
    _one("kv_cache_usage_perc", "gauge", "kv_usage_perc", "fraction of the KV pool held by sessions (0 to 1)"),
    Family("nixl_kv_bytes", "counter", "KV bytes this worker moved over NIXL, by the direction of its transfers",
           (("nixl_bytes_read", "read"), ("nixl_bytes_written", "written")), label="direction"),
    _one("kv_bytes_verified", "counter", "kv_bytes_verified", "KV bytes received over NIXL and checked"),
    _one("kv_bytes_mismatched", "counter", "kv_bytes_mismatched", "checked KV bytes that were wrong"),
    Family("queue_pops", "counter", "tasks taken from this worker's prefill queue with others waiting: "
           "'choice' (two or more queued), 'reordered' (not the head: Algorithm 2 or Continuum's priority)",
           (("queue_pops_choice", "choice"), ("queue_pops_reordered", "reordered")), label="kind"),
)
DECODE = (
    *WORKER,
    _one("sessions_bound", "gauge", "active_sessions", "sessions open on this decode worker (any phase)"),
    Family("decode_sessions", "counter", "sessions on this decode worker by outcome",
           (("sessions_opened", "opened"), ("sessions_completed", "completed"), ("sessions_failed", "failed")),
           label="status"),
    Family("prefills_completed", "counter", "prefills whose first token reached this decode worker, by where "
           "they ran", (("prefills_local", "local"), ("prefills_remote", "remote")), label="where"),
    _one("prefill_chunks", "counter", "prefill_chunks", "chunks of chunked local prefills run"),
    _one("local_prefill_tokens", "counter", "local_prefill_tokens", "tokens computed by prefills run on this "
         "decode worker (a session's history KV is not computed again)"),
    _one("decode_steps", "counter", "decode_steps", "batched decode steps run"),
    _one("generation_tokens", "counter", "tokens", "output tokens generated (first tokens included)"),
    _one("tool_calls", "counter", "tool_calls", "tool calls issued at round ends"),
    _one("kv_waits", "counter", "kv_waits", "rounds that waited for KV to free (--kv-admission wait)"),
    _one("kv_overcommits", "counter", "kv_overcommits", "rounds admitted over KV capacity (no-deadlock rule)"),
    _one("kv_evictions", "counter", "kv_evictions", "idle sessions whose KV was evicted for a round that needed "
         "the room (--kv-evict)"),
    _one("kv_recomputed_tokens", "counter", "kv_recomputed_tokens", "history tokens prefilled again after an "
         "eviction"),
    # prefix sharing (--prefix-sharing; services/decode/prefix.py)
    _one("prefix_shared_tokens", "counter", "prefix_shared_tokens", "prompt tokens whose KV a session found "
         "in blocks shared with other sessions (not prefilled)"),
    _one("prefix_cached_tokens", "gauge", "prefix_cached_tokens", "tokens of prefix blocks nobody holds, kept "
         "cached for later sessions (free KV: taken back first when the pool is short)"),
    # the host KV tier (--kv-host-mb; services/decode/tier.py)
    Family("kv_tier_decisions", "counter", "host KV tier decisions by action:reason (ampd/policy/kvtier.py)",
           label="decision", prefix="kv_tier_decision_"),
    Family("kv_tier_moves", "counter", "host KV tier moves done and checked, by kind:reason",
           label="move", prefix="kv_tier_move_"),
    Family("kv_tier_move_failures", "counter", "host KV tier moves that failed, by kind:why (the session's next "
           "round prefills its history again)", label="move", prefix="kv_tier_failed_"),
    Family("kv_tier_bytes", "counter", "KV bytes the host KV tier moved, by direction",
           (("kv_tier_bytes_to_host", "to_host"), ("kv_tier_bytes_from_host", "from_host")), label="direction"),
    _one("kv_tier_host_reads", "counter", "kv_tier_host_reads", "rounds on host whose prefill reads the host copy "
         "while it comes back (services/decode/hostread.py)"),
    _one("kv_tier_host_read_ahead", "counter", "kv_tier_host_read_ahead", "of them, rounds whose prefill task "
         "went out before their fetch from host ended"),
    Family("kv_tier_host_blocks", "gauge", "host KV pool blocks by state",
           (("kv_tier_host_used_blocks", "used"), ("kv_tier_host_free_blocks", "free")), label="state"),
)
PREFILL = (
    *WORKER,
    Family("prefill_tasks", "counter", "remote prefill tasks by outcome",
           (("tasks_submitted", "submitted"), ("tasks_done", "done"), ("tasks_failed", "failed")), label="status"),
    Family("prefill_tokens", "counter", "tokens of remote prefills: history KV read, new KV computed and written",
           (("history_tokens_read", "history"), ("new_tokens_written", "new")), label="part"),
    _one("history_tokens_read_host", "counter", "history_tokens_read_host", "history tokens read from a decode "
         "worker's host KV tier (PrefillTask.history_on_host)"),
    _one("kv_reads_ahead", "counter", "kv_reads_ahead", "history reads started while another task computed"),
    _one("kv_read_hidden_seconds", "counter", "kv_read_hidden_s",
         "seconds of history reads that ran behind another task's compute"),
)
COORDINATOR = (
    Family("sessions", "counter", "sessions by outcome at the coordinator",
           (("sessions_opened", "opened"), ("sessions_completed", "completed"), ("sessions_failed", "failed"),
            ("sessions_rejected", "rejected"), ("sessions_refused", "refused")), label="status"),
    _one("sessions_active", "gauge", "sessions_live", "sessions open now"),
    _one("sessions_waiting", "gauge", "sessions_waiting", "new sessions waiting in admission"),
    Family("sessions_refused", "counter", "new sessions refused by admission (RESOURCE_EXHAUSTED), by reason "
           "(ampd/policy/admit.py)", tuple(("refused_" + r, r) for r in REFUSAL_REASONS), label="reason"),
    Family("session_bindings", "counter", "new sessions whose prompt was matched against the decode workers' "
           "prefix blocks (--prefix-sharing), by the reason of their binding: 'prefix' (moved to the worker "
           "holding a longer prefix), 'admission' (admission's choice kept)",
           (("bind_prefix", "prefix"), ("bind_admission", "admission")), label="reason"),
    _one("prefix_bind_tokens", "counter", "bind_prefix_tokens", "prompt tokens held on the worker of the sessions "
         "bound for a prefix (what they moved to share)"),
    Family("prefills_routed", "counter", "prefills handed over, by where they run (after fallbacks)",
           (("prefills_local", "local"), ("prefills_remote", "remote")), label="where"),
    _one("prefills_routed_with_turn", "counter", "prefills_routed_with_turn", "prefills whose route went with "
         "their turn to the decode worker and held there (no prefill_task round trip; decode.proto Route)"),
    _one("route_state_read_seconds", "counter", "route_redis_read_ms_total",
         "seconds routing decisions spent reading worker state", scale=1e-3),
    Family("worker_stats_lag_seconds", "gauge", "age of worker statistics when the coordinator received them "
           "(last 1000)", (("stats_lag_p50_ms", "0.5"), ("stats_lag_max_ms", "1")), label="quantile", scale=1e-3),
    # last: it takes the route_* keys no family above claims
    Family("route_decisions", "counter", "routing decisions by reason (docs/policies.md)", label="reason",
           prefix="route_"),
)
SIDECAR = (
    _one("sidecar_calls", "counter", "calls", "tool calls this sidecar ran"),
    _one("sidecar_call_failures", "counter", "failures", "tool calls that failed (their result is an error)"),
    _one("sidecar_calls_stopped", "counter", "stopped", "tool calls whose process was killed (deadline, CPU "
         "time, a crash)"),
)
FAMILIES = {"coordinator": COORDINATOR, "decode": DECODE, "prefill": PREFILL, "sidecar": SIDECAR}


class ValuesCollector(Collector):
    """Renders a dict of values (one read per scrape) as ``families``; ``const`` labels go on every
    sample (a worker's id). Labels the dict came with (``read`` returns values, labels) become
    ``ampd_deployment_info``."""

    def __init__(self, read: Callable[[], tuple[dict[str, float], dict[str, str]]], families: Sequence[Family],
                 const: dict[str, str] | None = None) -> None:
        self.read = read
        self.families = tuple(families)
        self.const = dict(const or {})

    def collect(self) -> Iterable[Metric]:
        values, labels = self.read()
        claimed = {k for f in self.families for k, _ in f.sources}
        names = list(self.const)
        for f in self.families:
            sources = list(f.sources)
            if f.prefix:
                sources += [(k, k[len(f.prefix):]) for k in sorted(values) if k.startswith(f.prefix) and k not in claimed]
            label_names = names + ([f.label] if f.label else [])
            cls = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
            fam = cls(PREFIX + f.name, f.help, labels=label_names)
            for key, label_value in sources:
                if key not in values and f.kind != "counter":
                    continue
                v = float(values.get(key, 0.0)) * f.scale
                fam.add_metric([*self.const.values(), *([label_value] if f.label else [])], v)
            yield fam
        if labels:
            info = GaugeMetricFamily(PREFIX + "deployment_info", "the deployment this coordinator serves (value 1)",
                                     labels=sorted(labels))
            info.add_metric([labels[k] for k in sorted(labels)], 1.0)
            yield info


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], Awaitable], timeout_s: float = 5.0):
    """``fn()`` run on ``loop`` and waited for from another thread (the HTTP server's); on a stuck or
    stopped loop it gives up after ``timeout_s`` and returns None."""

    def call():
        coro = fn()
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError as exc:  # the loop is closed: the coroutine never started
            coro.close()
            log.warning("metrics read failed", error=repr(exc))
            return None
        try:
            return fut.result(timeout_s)
        except Exception as exc:  # a scrape must not take the server thread down
            fut.cancel()
            log.warning("metrics read failed", error=repr(exc))
            return None

    return call


def worker_values(rt) -> dict[str, float]:
    """What a worker's Metrics RPC reports of its ``ampd.runtime.WorkerRuntime``: the predicted queue
    time and windowed mean it publishes for routing, its KV pool, the bytes its NIXL agent moved."""
    st = rt.snapshot()
    pool = rt.pool
    blocks = pool.layout.num_blocks
    # free: what the pool can give a new round, the cached prefix blocks it reclaims on demand
    # included (--prefix-sharing; ``prefix_cached_tokens`` counts those apart), as admission counts
    free = pool.available_tokens // pool.block_tokens
    out = {
        "queue_predicted_s": st.queue_predicted_s,
        "kv_free_tokens": free * pool.block_tokens,
        "kv_capacity_tokens": pool.capacity_tokens,
        "kv_used_blocks": blocks - free,
        "kv_free_blocks": free,
        "kv_usage_perc": (blocks - free) / blocks,
        "nixl_bytes_read": rt.transport.bytes_read,
        "nixl_bytes_written": rt.transport.bytes_written,
        "fences": rt.fences,  # times a coordinator fenced it out (docs/deploy.md "Faults")
    }
    if st.window_mean_s is not None:
        out["window_mean_s"] = st.window_mean_s
    return out


def rpc_collector(servicer, service: str, const: dict[str, str] | None = None) -> ValuesCollector:
    """The values of ``servicer.Metrics`` (its RPC handler, called in-process on the running loop)
    as the metrics of ``service`` (a key of FAMILIES). Call from the service's event loop."""
    from ampd.v1 import common_pb2

    async def reply():
        return await servicer.Metrics(common_pb2.MetricsRequest(), None)

    fetch = on_loop(asyncio.get_running_loop(), reply)

    def read() -> tuple[dict[str, float], dict[str, str]]:
        r = fetch()
        return ({}, {}) if r is None else (dict(r.values), dict(r.labels))

    return ValuesCollector(read, FAMILIES[service], const)


# ---------------------------------------------------------------------------- round latencies
class WeightedHistogram(Collector):
    """A histogram that takes ``count`` observations of one value at once (a round's mean ITL for
    each of its gaps) in O(log buckets)."""

    def __init__(self, name: str, help: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self.bounds = (*buckets, math.inf)
        self._rows: dict[tuple[str, ...], list[float]] = {}  # per bucket counts (not cumulative), then sum
        self._lock = threading.Lock()

    def observe(self, value: float, count: int, *labels: str) -> None:
        i = bisect_left(self.bounds, value)
        with self._lock:
            row = self._rows.setdefault(labels, [0.0] * (len(self.bounds) + 1))
            row[i] += count
            row[-1] += value * count

    def collect(self) -> Iterable[Metric]:
        fam = HistogramMetricFamily(self.name, self.help, labels=self.labelnames)
        with self._lock:
            rows = {k: list(v) for k, v in self._rows.items()}
        for labels, row in sorted(rows.items()):
            cum, buckets = 0.0, []
            for bound, n in zip(self.bounds, row):
                cum += n
                buckets.append((floatToGoString(bound), cum))
            fam.add_metric(list(labels), buckets, row[-1])
        yield fam


class RoundMetrics(Collector):
    """TTFT and ITL of every completed round, observed at the coordinator from its RoundEnd timing
    (input_ready, first_token, last_token, tokens). ``kind`` is ``initial`` for round 0 (the
    prompt) and ``incremental`` for later rounds (a tool result on top of the session's history)."""

    def __init__(self) -> None:
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "time to first token of a round, from its input being ready",
                              ["kind", "prefill"], buckets=TTFT_BUCKETS, registry=None)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds",
                              "mean inter-token latency of a round (the quantity the ITL SLO bounds)",
                              ["kind"], buckets=ITL_BUCKETS, registry=None)
        self.itl = WeightedHistogram(PREFIX + "inter_token_latency_seconds",
                                     "gaps between consecutive output tokens (each gap of a round counted at the "
                                     "round's mean)", ["kind"], ITL_BUCKETS)
        # Every series exists from the start (a rate over a series that appears late misses its
        # first observations), and observe() skips the label lookup.
        kinds = ("initial", "incremental")
        self._ttft = {(k, local): self.ttft.labels(k, "local" if local else "remote") for k in kinds
                      for local in (False, True)}
        self._tpot = {k: self.tpot.labels(k) for k in kinds}
        for k in kinds:
            self.itl.observe(0.0, 0, k)

    def observe(self, t) -> None:
        """One round's ``common_pb2.RoundTiming``."""
        kind = "initial" if t.round == 0 else "incremental"
        self._ttft[kind, t.local].observe(max(0.0, t.first_token - t.input_ready))
        if t.tokens > 1:
            gap = max(0.0, t.last_token - t.first_token) / (t.tokens - 1)
            self._tpot[kind].observe(gap)
            self.itl.observe(gap, t.tokens - 1, kind)

    def collect(self) -> Iterable[Metric]:
        yield from self.ttft.collect()
        yield from self.tpot.collect()
        yield from self.itl.collect()


def plan_histogram() -> Histogram:
    """The planner's time per plan request."""
    return Histogram(PREFIX + "plan_duration_seconds", "seconds a Plan request took", buckets=PLAN_BUCKETS,
                     registry=None)


# ------------------------------------------------------------------------------------ the server
def serve(host: str, port: int, collectors: Iterable[Collector]) -> int:
    """Serves ``/metrics`` of a new registry (``collectors`` and this process's own) on host:port
    (0 = a free port) from a daemon thread; returns the bound port."""
    disable_created_metrics()  # no *_created series: the process start time says the same
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    for c in collectors:
        registry.register(c)
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise RuntimeError(f"--metrics-port: cannot bind {host}:{port}: {exc.strerror or exc}") from None
    return server.server_port
