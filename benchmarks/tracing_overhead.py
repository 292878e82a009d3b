"""What tracing costs a round, off and on (ampd/tracing.py).

- ``off``: with no ``--otlp-endpoint`` every tracing hook on the serving path is one test of
  ``tracing.on`` (or of a span being None). A round passes at most ``HOOKS_PER_ROUND`` of them over
  all its services (the coordinator's route (twice when a route sent ahead does not hold) and round
  end, the decode worker's round start, local prefill, round end and tool call (three), the prefill
  worker's submit and task end, the sidecar's call, the front's session open, turn start and end).
  Measured: the cost of one such test, times that count.
- ``on``: the spans one round records, over all its services (the ``round`` and ``route`` spans,
  the prefill worker's five, the decode worker's three, a tool call and the sidecar's side of it:
  ``SPANS_PER_ROUND``), recorded into the real SDK pipeline (a BatchSpanProcessor) whose exporter
  drops them: the CPU a round's spans take on the serving processes, before any network.

For scale, the live path of one round costs milliseconds (benchmarks/results/live_overhead.json).
Writes benchmarks/results/tracing_overhead.json. ``make bench BENCH=tracing_overhead``.
"""
from __future__ import annotations

import json
import os
import platform
import time
import timeit
from pathlib import Path
from types import SimpleNamespace

from ampd import tracing
from ampd.v1 import common_pb2

OUT = Path(__file__).parent / "results" / "tracing_overhead.json"
HOOKS_PER_ROUND = 15
SPANS_PER_ROUND = 14
ROUNDS = 3000


def _guard_ns(n: int = 2_000_000) -> float:
    """One ``if tracing.on:`` test as the services write it (a module attribute), off."""
    assert not tracing.on
    body = "if tracing.on:\n    x = 1"
    t = min(timeit.repeat(body, globals={"tracing": tracing}, number=n, repeat=5))
    empty = min(timeit.repeat("pass", number=n, repeat=5))
    return max(0.0, (t - empty) / n * 1e9)


class _Drop:
    """A SpanExporter that drops what it is given (the collector's network is not measured)."""

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis: int = 0):
        return True


def _round_spans(sid: str, rnd: int, now: float) -> None:
    """The spans of one remote round with a tool call, as the services record them."""
    t = common_pb2.RoundTiming(round=rnd, input_ready=now, first_token=now + 0.03, last_token=now + 0.1,
                               tokens=4, prefill_worker="prefill-0", route_reason="policy-remote", l_hist=80,
                               l_incr=20, finish_reason="tool_calls")
    decision = SimpleNamespace(reason="policy-remote", target="prefill-0", local=False,
                               estimates={"ttft_remote": 0.03, "ttft_local": 0.05})
    tracing.route_span(sid, rnd, decision, now, now + 1e-4, 80, 20)
    parent = tracing.round_context(sid, rnd)
    base = {"ampd.session_id": sid, "ampd.round": rnd, "ampd.worker": "prefill-0"}
    p = tracing.record("prefill", now, now + 0.03, parent, {**base, "ampd.l_hist": 80, "ampd.l_incr": 20})
    for name in ("queue_wait", "kv_read", "compute", "kv_write"):
        tracing.record(name, now, now + 0.01, p, base)
    tracing.record("kv_admit", now, now + 1e-4, parent, base)
    tracing.record("remote_prefill_wait", now, now + 0.03, parent, base)
    tracing.record("decode", now + 0.03, now + 0.1, parent, {**base, "ampd.tokens": 4})
    live = tracing.start("tool_call", parent, base, kind="client")
    tracing.record("sidecar.call", now, now + 0.05, tracing.from_metadata(tracing.metadata(live.context)), base)
    live.end()
    tracing.round_span(sid, t)


def _on_us_per_round() -> float:
    tracing.setup("bench", exporter=_Drop(), batch=True)  # the services' pipeline: batched
    try:
        now = time.time()
        for i in range(200):  # warm
            _round_spans(f"w{i}", 0, now)
        t0 = time.perf_counter()
        for i in range(ROUNDS):
            _round_spans(f"s{i // 3}", i % 3, now)
        return (time.perf_counter() - t0) / ROUNDS * 1e6
    finally:
        tracing.shutdown()


def main() -> None:
    guard = _guard_ns()
    on_us = _on_us_per_round()
    out = {
        "benchmark": "tracing_overhead",
        "off": {"guard_ns": round(guard, 2), "hooks_per_round": HOOKS_PER_ROUND,
                "ns_per_round": round(guard * HOOKS_PER_ROUND, 1)},
        "on": {"spans_per_round": SPANS_PER_ROUND, "us_per_round": round(on_us, 1),
               "us_per_span": round(on_us / SPANS_PER_ROUND, 2)},
        "loadavg": os.getloadavg()[0], "cpus": os.cpu_count(), "python": platform.python_version(),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
