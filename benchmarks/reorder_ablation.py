"""Does Algorithm 2 (TTFT-aware reordering) earn its keep? AMPD with and without reordering on the
simulator, per point: the pops that had a choice (>= 2 tasks queued), the pops that reordered, SLO
attainment with and without, the gain in points.

    python -m benchmarks.reorder_ablation [--regimes paper,bursty,tight,window] [--seeds 1,2]
    make bench BENCH=reorder_ablation

Regimes (each point runs ``ampd`` and its FCFS twin on the same trace, deployment and seed):

- ``paper``   the presets, models and rates of `make paper` (benchmarks/results/paper: scan.json's
              rates, slo.json's SLOs, AMPD's planned deployment from plan.json, Table 2's #1 where that
              plan is co-located, as the paper's sensitivity part does), Poisson arrivals;
- ``bursty``  the same sessions, arrivals in bursts: written as a Mooncake-style request trace (one
              JSON line per round, timestamps in ms snapped to a tick as Mooncake's traces are, the
              whole context resent each round, a session_id) and read back with ``import_mooncake``
              (what ``ampd trace import-mooncake`` runs); the tick holds BURST sessions on average;
- ``tight``   the paper regime with the TTFT SLO at TIGHT x its value;
- ``window``  the paper's literal slack rule (Alg. 1 on the windowed mean TTFT: ``ampd-window``)
              against the same router with FCFS queues.

Each regime covers every model and preset at a subset of rates (``--rates-of``, default every rate of
the paper sweep for ``paper`` and the upper three for the others, where queues form), to bound the
run to minutes on 2 cores. Writes benchmarks/results/reorder_ablation.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from multiprocessing import Pool

from benchmarks import write_json

PAPER_DIR = os.path.join("benchmarks", "results", "paper")
OUT = os.path.join("benchmarks", "results", "reorder_ablation.json")
REGIMES = ("paper", "bursty", "tight", "window")
# (result key, policy): Algorithm 2 on every queue, FCFS
VARIANTS = (("reorder", "ampd"), ("fcfs", "ampd-noreorder"))
BURST = 8          # sessions per Mooncake-style tick, on average
TIGHT = 0.5        # the tight regime's TTFT SLO, as a fraction of the paper's
NOISE_PTS = 0.5    # issue 26: reordering may never cost more than this many points
QUEUED_SHARE = 0.05  # a point where queues form: at least this share of pops had a choice under FCFS


def _load(name: str) -> dict:
    with open(os.path.join(PAPER_DIR, name)) as f:
        return json.load(f)


def deployment(plans: dict, model: str, preset: str) -> tuple[str, str]:
    """AMPD's planned deployment when it is disaggregated, else Table 2's #1 (prefill workers are
    what reordering acts on besides the decode workers' local queues)."""
    from benchmarks.paper import TABLE2
    from benchmarks.paper_plan import chosen

    pre, dec, _ = chosen(plans[f"{model}|{preset}"], "ampd")
    if pre == "none":
        pre, dec = TABLE2[(model, preset)]
    return pre, dec


def mooncake_rows(sessions, tick_s: float) -> list[dict]:
    """The sessions as Mooncake-style requests: arrivals snapped down to the tick, each later round
    ``tool_s`` after the one before (what ``import_mooncake`` reads back as the tool time), the input
    length the whole context so far (Mooncake resends the history)."""
    rows = []
    for s in sessions:
        t = math.floor(s.arrival / tick_s) * tick_s * 1000.0
        ctx = 0
        for r in s.rounds:
            rows.append({"timestamp": round(t, 3), "input_length": ctx + r.input,
                         "output_length": r.output, "session_id": s.id})
            ctx += r.input + r.output
            t += r.tool_delay_s * 1000.0
    rows.sort(key=lambda x: x["timestamp"])
    return rows


def bursty(sessions, rate: float) -> list:
    """``sessions`` through a Mooncake-style trace file with BURST sessions a tick on average."""
    from ampd.workload import import_mooncake

    tick = BURST / rate
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.jsonl")
        with open(path, "w") as f:
            for row in mooncake_rows(sessions, tick):
                f.write(json.dumps(row) + "\n")
        return import_mooncake(path)


def run_one(job: dict) -> dict:
    """One point: ``ampd`` (or ``ampd-window``) and its FCFS twin on the same trace."""
    from ampd.policy import SLO
    from ampd.sim import sim_report, simulate
    from benchmarks.paper import _profile, _trace, duration_for

    t0 = time.time()
    prof = _profile(job["model"])
    sess = list(_trace(job["preset"], job["rate"], duration_for(job["preset"], job["rate"], False), job["seed"]))
    if job["regime"] == "bursty":
        sess = bursty(sess, job["rate"])
    slo = SLO(ttft_s=job["ttft_s"], itl_s=job["itl_s"])
    slack = "window" if job["regime"] == "window" else "queue"
    out = {k: job[k] for k in ("regime", "model", "preset", "rate", "seed", "prefill", "decode", "ttft_s", "itl_s")}
    out["sessions"] = len(sess)
    out["rounds"] = sum(len(s.rounds) for s in sess)  # = prefills = pops
    for key, policy in VARIANTS:
        res = simulate(sess, prof, policy=policy, prefill=job["prefill"], decode=job["decode"],
                       ttft_slo_s=slo.ttft_s, itl_slo_s=slo.itl_s, seed=job["seed"], slack=slack)
        rep = sim_report(res, slo)
        pops = res.stats["pops"]
        out[key] = {"attainment": rep["slo_attainment"], "ttft_attainment": rep["ttft_attainment"],
                    "local_fraction": rep["local_fraction"],
                    "pops_choice": pops["prefill"]["choice"] + pops["local"]["choice"],
                    "pops_reordered": pops["prefill"]["reordered"] + pops["local"]["reordered"],
                    "pops_on_time": pops["prefill"]["on_time"] + pops["local"]["on_time"],
                    "pops": pops}
    out["wall_s"] = round(time.time() - t0, 2)
    return out


def jobs_for(regimes, seeds, models, presets) -> list[dict]:
    slos = _load("slo.json")["slos"]
    rates = _load("scan.json")["rates"]
    plans = _load("plan.json")["cases"]
    jobs = []
    for regime in regimes:
        for m in models:
            for p in presets:
                key = f"{m}|{p}"
                pre, dec = deployment(plans, m, p)
                rs = rates[key] if regime == "paper" else rates[key][-3:]
                ttft = slos[key]["ttft_s"] * (TIGHT if regime == "tight" else 1.0)
                for rate in rs:
                    for seed in seeds:
                        jobs.append(dict(regime=regime, model=m, preset=p, rate=rate, seed=seed, prefill=pre,
                                         decode=dec, ttft_s=round(ttft, 4), itl_s=slos[key]["itl_s"]))
    return jobs


def merge_seeds(rows: list[dict]) -> list[dict]:
    """One row per (regime, model, preset, rate): attainment means, pop counts summed over seeds."""
    agg: dict = {}
    for r in rows:
        agg.setdefault((r["regime"], r["model"], r["preset"], r["rate"]), []).append(r)
    out = []
    for (regime, m, p, rate), rs in agg.items():
        row = {"regime": regime, "model": m, "preset": p, "rate": rate, "seeds": [r["seed"] for r in rs],
               "prefill": rs[0]["prefill"], "decode": rs[0]["decode"], "ttft_s": rs[0]["ttft_s"],
               "itl_s": rs[0]["itl_s"], "sessions": sum(r["sessions"] for r in rs),
               "rounds": sum(r["rounds"] for r in rs)}
        for key, _ in VARIANTS:
            row[key] = {"attainment": sum(r[key]["attainment"] for r in rs) / len(rs),
                        "ttft_attainment": sum(r[key]["ttft_attainment"] for r in rs) / len(rs),
                        "pops_choice": sum(r[key]["pops_choice"] for r in rs),
                        "pops_reordered": sum(r[key]["pops_reordered"] for r in rs),
                        "pops_on_time": sum(r[key]["pops_on_time"] for r in rs)}
        row["gain_pts"] = round(100.0 * (row["reorder"]["attainment"] - row["fcfs"]["attainment"]), 3)
        out.append(row)
    out.sort(key=lambda r: (REGIMES.index(r["regime"]), r["model"], r["preset"], r["rate"]))
    return out


def summary(points: list[dict]) -> dict:
    """Per regime: points, the worst and mean gain, pops with a choice and reordered, the points
    where queues formed (under FCFS, a QUEUED_SHARE of the pops had a choice) and those where a TTFT
    was at stake (a QUEUED_SHARE of the pops had a choice and FCFS would miss a window task), and
    how many of each reordering helped."""
    out = {}
    for regime in REGIMES:
        ps = [p for p in points if p["regime"] == regime]
        if not ps:
            continue
        queued = [p for p in ps if p["fcfs"]["pops_choice"] >= QUEUED_SHARE * p["rounds"]]
        contested = [p for p in ps if p["reorder"]["pops_choice"] - p["reorder"]["pops_on_time"]
                     >= QUEUED_SHARE * p["rounds"]]
        out[regime] = {
            "points": len(ps),
            "mean_gain_pts": round(sum(p["gain_pts"] for p in ps) / len(ps), 3),
            "min_gain_pts": min(p["gain_pts"] for p in ps),
            "max_gain_pts": max(p["gain_pts"] for p in ps),
            "points_losing_over_noise": sum(p["gain_pts"] < -NOISE_PTS for p in ps),
            "pops_choice": sum(p["reorder"]["pops_choice"] for p in ps),
            "pops_reordered": sum(p["reorder"]["pops_reordered"] for p in ps),
            "pops_on_time": sum(p["reorder"]["pops_on_time"] for p in ps),
            # the rest of the pops with a choice: FCFS misses a window task and no ordering the
            # caps allow meets more (all late, or only one of them can make it)
            "pops_unavoidable": sum(p["reorder"]["pops_choice"] - p["reorder"]["pops_on_time"]
                                    - p["reorder"]["pops_reordered"] for p in ps),
            "points_with_reorders": sum(p["reorder"]["pops_reordered"] > 0 for p in ps),
            "points_with_queues": len(queued),
            "points_with_queues_gaining": sum(p["gain_pts"] > 0 for p in queued),
            "points_contested": len(contested),
            "points_contested_gaining": sum(p["gain_pts"] > 0 for p in contested),
            "points_contested_mean_gain_pts": round(sum(p["gain_pts"] for p in contested) / len(contested), 3)
            if contested else None,
        }
    return out


def main(argv=None) -> int:
    from benchmarks.paper import MODELS, PRESETS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--seeds", default="1,2", help="trace/router seeds (the paper sweep's)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (at most 2)")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args(argv if argv is not None else sys.argv[1:] if __name__ == "__main__" else [])
    regimes = a.regimes.split(",")
    bad = [r for r in regimes if r not in REGIMES]
    if bad:
        print(f"reorder_ablation: unknown regime {bad[0]!r}; valid: {', '.join(REGIMES)}", file=sys.stderr)
        return 2
    jobs = jobs_for(regimes, [int(s) for s in a.seeds.split(",")], a.models.split(","), a.presets.split(","))
    t0 = time.time()
    # the longest first, so the two workers end together
    jobs.sort(key=lambda j: -(j["rate"] * (10 if j["preset"] == "gaia" else 1)))
    if a.jobs > 1:
        with Pool(min(a.jobs, 2)) as pool:
            rows = pool.map(run_one, jobs, chunksize=1)
    else:
        rows = [run_one(j) for j in jobs]
    points = merge_seeds(rows)
    doc = {"command": "python -m benchmarks.reorder_ablation " + " ".join(sys.argv[1:] if argv is None else argv),
           "note": "per point: ampd (Alg. 2 on every queue) vs ampd-noreorder (FCFS), same trace, deployment and "
                   "seeds; pops_choice = pops with >= 2 tasks queued, pops_reordered = pops that did not take "
                   "the head (prefill workers and decode workers' local queues together); gain_pts = 100 x "
                   "(attainment with - without); 'window' runs the paper's windowed-mean slack rule for both",
           "burst_sessions_per_tick": BURST, "tight_ttft_fraction": TIGHT, "noise_pts": NOISE_PTS,
           "wall_s": round(time.time() - t0, 1), "simulations": len(VARIANTS) * len(jobs),
           "summary": summary(points), "points": points}
    write_json(a.out, doc)
    print(json.dumps(doc["summary"], indent=1))
    print(f"{len(VARIANTS) * len(jobs)} simulations in {doc['wall_s']} s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
