"""Overload: offered load from 1x to 10x what the deployment sustains, through admission control.

A local deployment (`ampd up` as a library: Redis, coordinator, a prefill and two decode workers with
their sidecars, mock engines on ``qwen3-32b@h20`` timing) whose decode workers hold little KV
(``--kv-tokens`` each), so KV is what limits how many sessions run at once. Every session has the
same shape: a prompt, a server-side tool call (``--tool-s``), a second round. A probe offers more
than the deployment can take (``--probe-rate``); the rate at which it completed sessions is the
sustainable rate (what the deployment serves when saturated: its KV, its prefill worker, this box's
CPU, whichever binds first). Then the trace replays at 0.5x, 1x, 2x, 5x and 10x of it, each for
``--window`` seconds of arrivals.

Each session either completes, is refused before it is accepted (RESOURCE_EXHAUSTED from
admission, ``--admission``: ``slo`` refuses at once a session that would miss its SLO and waits for
KV no longer than its TTFT budget, ``kv`` waits up to ``--admission-wait`` seconds for KV), or fails
after it was accepted (``lost``: must be 0). Goodput is SLO-attaining sessions per second over the
run (``slo_goodput_rps``: ``ampd.bench.report``, TTFT and ITL thresholds of the trace's SLO), with
completed sessions per second beside it; the run passes when nothing accepted is lost, every session
is accounted for, and goodput at the highest rate stays at least 80 % of its peak over the rates.

    python -m benchmarks.overload                   # results/overload.json
    python -m benchmarks.overload --window 20 --out /tmp/overload.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections import Counter
import sys
import time
from pathlib import Path

from ampd.bench.client import replay
from ampd.bench.report import build_report
from ampd.launcher import Deployment, Options
from ampd.policy import SLO
from ampd.config import add_flags
from ampd.workload.trace import Round, Session

RESULTS = Path(__file__).parent / "results"
BYTES_PER_TOKEN = 64
BLOCK_TOKENS = 32
DECODE_WORKERS = 2


def sessions(tag: str, n: int, rate: float, a: argparse.Namespace) -> list[Session]:
    """``n`` sessions of one shape arriving at ``rate`` per second (evenly spaced)."""
    return [Session(f"{tag}-{i}", i / rate, (Round(a.input, a.output, a.tool_s), Round(a.result, a.output)))
            for i in range(n)]


def need_tokens(a: argparse.Namespace) -> int:
    """The KV admission promises one session (coordinator: inputs, outputs, results, a block)."""
    return a.input + a.output + a.result + a.output + BLOCK_TOKENS


def refusal_reason(error: str) -> str:
    """The reason in a refusal's details (``RESOURCE_EXHAUSTED: admission: REASON: ...``)."""
    parts = error.split(": ")
    return parts[2] if len(parts) > 2 and parts[1] == "admission" else "other"


def classify(records, stats) -> dict:
    completed = [r for r in records if r.completed]
    refused = [r for r in records if not r.completed and r.error.startswith("RESOURCE_EXHAUSTED")]
    lost = [r for r in records if not r.completed and not r.error.startswith("RESOURCE_EXHAUSTED")]
    accepted = [r for r in records if r.session_id in stats.bound_to]
    return {
        "offered": len(records), "accepted": len(accepted), "completed": len(completed), "refused": len(refused),
        "lost": len(lost), "lost_errors": sorted({r.error for r in lost})[:5],
        "refused_after_accepting": sum(1 for r in refused if r.session_id in stats.bound_to),
        "refusal_reasons": sorted({r.error.split(";")[0][:120] for r in refused})[:3],
        "refused_by_reason": dict(Counter(refusal_reason(r.error) for r in refused)),
    }


async def run_rate(dep: Deployment, tag: str, rate: float, a: argparse.Namespace, slo: SLO) -> dict:
    trace = sessions(tag, max(1, round(rate * a.window)), rate, a)
    t0 = time.time()
    records, stats, wall, _ = await replay(dep.coordinator, trace, progress=False, timeout_s=a.window * 10 + 120)
    out = classify(records, stats)
    report = build_report("ampd", records, slo, wall)
    durations = [stats.ended_at[r.session_id] - stats.started_at[r.session_id] for r in records if r.completed]
    refused_waits = [stats.ended_at[r.session_id] - stats.started_at[r.session_id] for r in records
                     if r.error.startswith("RESOURCE_EXHAUSTED")]
    out.update(
        rate_rps=rate, wall_s=round(wall, 2), started=t0,
        goodput_rps=round(out["completed"] / wall, 3),
        slo_goodput_rps=round(report["goodput_rps"], 3), slo_attainment=round(report["slo_attainment"], 3),
        ttft_attainment=round(report["ttft_attainment"], 3), itl_attainment=round(report["itl_attainment"], 3),
        session_s_p50=round(statistics.median(durations), 3) if durations else None,
        refused_after_s_p50=round(statistics.median(refused_waits), 3) if refused_waits else None,
        ttft_p99_s=report["ttft_s"]["p99"],
    )
    return out


async def measure(a: argparse.Namespace) -> dict:
    slo = SLO(a.ttft_slo, a.itl_slo)
    kv_pool_mb = max(1, a.kv_tokens * BYTES_PER_TOKEN // 2**20)
    opts = Options(prefill="tp8*1", decode=f"tp8*{DECODE_WORKERS}", profile="qwen3-32b@h20", policy="ampd",
                   kv_pool_mb=kv_pool_mb, kv_bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS,
                   admission_wait=a.admission_wait, admission_queue=a.admission_queue, admission=a.admission,
                   ttft_slo=a.ttft_slo, itl_slo=a.itl_slo, namespace="overload")
    with Deployment(opts) as dep:
        # the probe: more than it can take; what it completes per second is what it sustains
        calib = await run_rate(dep, "probe", a.probe_rate, a, slo)
        session_s = calib["session_s_p50"]
        capacity = DECODE_WORKERS * (kv_pool_mb * 2**20 // BYTES_PER_TOKEN) // need_tokens(a)
        sustainable = calib["goodput_rps"]
        runs = []
        for mult in a.multiples:
            r = await run_rate(dep, f"x{mult}", sustainable * mult, a, slo)
            r["multiple"] = mult
            runs.append(r)
            print(json.dumps({k: r[k] for k in ("multiple", "rate_rps", "offered", "accepted", "completed",
                                                "refused", "lost", "goodput_rps", "slo_goodput_rps")}),
                  file=sys.stderr, flush=True)
    peak = max(r["slo_goodput_rps"] for r in runs)
    top = runs[-1]
    return {
        "command": "python -m benchmarks.overload " + " ".join(sys.argv[1:]),
        "deployment": {"prefill": "tp8*1", "decode": f"tp8*{DECODE_WORKERS}", "profile": "qwen3-32b@h20",
                       "engine": "mock", "kv_tokens_per_decode_worker": kv_pool_mb * 2**20 // BYTES_PER_TOKEN,
                       "admission": a.admission, "admission_wait_s": a.admission_wait,
                       "admission_queue": a.admission_queue},
        "session": {"input": a.input, "output": a.output, "tool_s": a.tool_s, "result": a.result,
                    "kv_promised_tokens": need_tokens(a)},
        "slo": {"ttft_s": a.ttft_slo, "itl_s": a.itl_slo},
        "probe": calib,
        "concurrent_capacity_by_kv": capacity,
        "session_s_p50_at_probe": session_s,
        "sustainable_rps": round(sustainable, 3),
        "runs": runs,
        "peak_slo_goodput_rps": peak,
        "slo_goodput_at_max_over_peak": round(top["slo_goodput_rps"] / peak, 3) if peak else 0.0,
        "peak_completed_rps": max(r["goodput_rps"] for r in runs),
        "lost_total": sum(r["lost"] for r in runs),
        "passed": all(r["lost"] == 0 and r["refused_after_accepting"] == 0
                      and r["completed"] + r["refused"] == r["offered"] for r in runs)
        and top["slo_goodput_rps"] >= 0.8 * peak,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--multiples", type=float, nargs="+", default=[0.5, 1, 2, 5, 10])
    p.add_argument("--probe-rate", type=float, default=15.0, help="sessions/s offered by the probe")
    p.add_argument("--kv-tokens", type=int, default=32768, help="KV tokens per decode worker")
    p.add_argument("--input", type=int, default=3000)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--result", type=int, default=200)
    p.add_argument("--tool-s", type=float, default=2.0)
    add_flags(p, ("admission", "admission_wait", "admission_queue", "ttft_slo", "itl_slo"))
    p.set_defaults(admission="slo", admission_wait=2.0)  # this benchmark's: SLO admission, a shorter wait
    p.add_argument("--out", default=str(RESULTS / "overload.json"))
    a = p.parse_args()
    t0 = time.monotonic()
    result = asyncio.run(measure(a))
    result["wall_s"] = round(time.monotonic() - t0, 1)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("sustainable_rps", "peak_slo_goodput_rps",
                                             "slo_goodput_at_max_over_peak", "lost_total", "passed")}))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
