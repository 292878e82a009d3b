"""Planning time by cluster size, 8 to 256 GPUs, against the paper's (App. A.2, Fig. 7).

    python -m benchmarks.planner_time [--repeats 3] [--out benchmarks/results/planner_time.json]

Workload: Llama3.1-70B on H20, the DuReader preset at a rate that grows with the cluster (the rate
`make paper` found AMPD's knee at on 16 GPUs, results/paper/scan.json, times N / 16), 300 s of
arrivals, seed 3; the paper's SLO for the case (results/paper/slo.json). Full search space (mixed TP
degrees, co-location), top 3 from 6 candidates per family (what `ampd plan --top 3` runs).

Phases, timed apart (wall and CPU seconds: the machine is shared, CPU seconds are what the work
itself costs):
- estimates: the tau simulations (kinds x degrees x simulated levels); they depend on the session mix
  only, not on N or the rate, so a cache serves every later plan of the workload. "cold" = empty cache.
- search: the 6 best deployments of each family (co-located, disaggregated: the joint 6 best are
  among them) as plan() finds them (``family_candidates``): by enumeration where the family's space
  holds at most ENUMERATE_MAX deployments, else by SCIP ("search" names which, per family).
- ilp: SCIP finding the same 6 best of each family, at every size (``solve_top``); and SCIP's solve
  for the single best deployment alone.
- checks: one whole-deployment simulation per candidate, every candidate (checks_all_s; plan()
  skips some, see candidates_skipped), on the first --check-sessions sessions.
- plan: the whole plan() call on cached estimates (search + checks + ranking), as `ampd plan` runs
  it with a warm estimate cache; plan_cold_s adds the cold estimates.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from benchmarks import write_json

RESULTS = os.path.join(os.path.dirname(__file__), "results")
PAPER_S = {8: 0.54, 16: 1.93, 32: 5.06, 64: 14.50, 128: 28.88, 256: 61.67}
MODEL, PRESET, BASE_GPUS = "llama3.1-70b@h20", "dureader", 16


def one_size(n: int, a) -> dict:
    from ampd.bench.report import SLO
    from ampd.perf import load_profile
    from ampd.planner import EstimateCache, PlanRequest, build_estimates, plan, solve_top
    from ampd.planner.ilp import ENUMERATE_MAX, space_size
    from ampd.planner.plan import check, family_candidates, search_space
    from ampd.workload import generate

    slo_d = json.load(open(os.path.join(RESULTS, "paper", "slo.json")))["slos"][f"{MODEL}|{PRESET}"]
    base = json.load(open(os.path.join(RESULTS, "paper", "scan.json")))["scale_rate"][f"{MODEL}|{PRESET}"]
    rate = base * n / BASE_GPUS
    prof = load_profile(MODEL)
    sessions = generate(PRESET, rate, a.duration, 3)
    slo = SLO(slo_d["ttft_s"], slo_d["itl_s"])
    req = PlanRequest(prof, sessions, n, slo, top=3, candidates=6, check_sessions=a.check_sessions)
    degrees, disagg, coloc = search_space(req)
    kinds = ("prefill", "decode", "colocated")
    cache = EstimateCache()
    t, c = time.perf_counter(), time.process_time()
    est = build_estimates(prof, sessions, degrees, slo, kinds=kinds, cache=cache)
    est_cold, est_cold_cpu = time.perf_counter() - t, time.process_time() - c
    t = time.perf_counter()
    est = build_estimates(prof, sessions, degrees, slo, kinds=kinds, cache=cache)
    est_warm = time.perf_counter() - t
    fams = ({"disaggregated": True, "colocated": False}, {"disaggregated": False, "colocated": True})
    search = {("disaggregated" if f["disaggregated"] else "colocated"):
              ("enumeration" if space_size(n, degrees, mixed=True, **f) <= ENUMERATE_MAX else "scip")
              + f" ({space_size(n, degrees, mixed=True, **f)} deployments)" for f in fams}
    srch, srch_cpu = [], []
    for _ in range(a.repeats):
        t, c = time.perf_counter(), time.process_time()
        cands = family_candidates(est, n, degrees, 6, disaggregated=disagg, colocated=coloc, mixed=True,
                                  all_gpus=False, form_k=3)
        srch.append(time.perf_counter() - t)
        srch_cpu.append(time.process_time() - c)
    ilp, ilp_cpu = [], []
    for _ in range(a.repeats):
        t, c = time.perf_counter(), time.process_time()
        for f in fams:
            solve_top(est, n, degrees, 6, mixed=True, all_gpus=False, **f)
        ilp.append(time.perf_counter() - t)
        ilp_cpu.append(time.process_time() - c)
    t, c = time.perf_counter(), time.process_time()
    top1 = solve_top(est, n, degrees, 1, disaggregated=disagg, colocated=coloc)
    top1_s, top1_cpu = time.perf_counter() - t, time.process_time() - c
    t, c = time.perf_counter(), time.process_time()
    checked = [(d, check(req, d)) for _, d in cands]
    checks, checks_cpu = time.perf_counter() - t, time.process_time() - c
    whole, whole_cpu = [], []
    for _ in range(a.repeats):
        t, c = time.perf_counter(), time.process_time()
        res = plan(req, cache=cache)
        whole.append(time.perf_counter() - t)
        whole_cpu.append(time.process_time() - c)
    ilp_s, ilp_c = statistics.median(ilp), statistics.median(ilp_cpu)
    srch_s, srch_c = statistics.median(srch), statistics.median(srch_cpu)
    plan_s, plan_c = statistics.median(whole), statistics.median(whole_cpu)
    best = res.top[0]
    out = {"gpus": n, "rate": round(rate, 4), "sessions": len(sessions), "degrees": list(degrees),
           "estimate_simulations": len(cache), "estimates_cold_s": round(est_cold, 3),
           "estimates_cold_cpu_s": round(est_cold_cpu, 3), "estimates_cached_s": round(est_warm, 4),
           "search": search, "search_s": round(srch_s, 4), "search_runs_s": [round(x, 4) for x in srch],
           "search_cpu_s": round(srch_c, 4),
           "ilp_candidates": len(cands), "ilp_s": round(ilp_s, 4), "ilp_runs_s": [round(x, 4) for x in ilp],
           "ilp_cpu_s": round(ilp_c, 4), "ilp_top1_s": round(top1_s, 4),
           "ilp_top1_cpu_s": round(top1_cpu, 4), "ilp_top1": f"{top1[0][1].prefill_spec}|{top1[0][1].decode_spec}",
           "checks_all_s": round(checks, 3), "checks_all_cpu_s": round(checks_cpu, 3),
           "check_sessions": a.check_sessions,
           "plan_s": round(plan_s, 3), "plan_runs_s": [round(x, 3) for x in whole], "plan_cpu_s": round(plan_c, 3),
           "plan_cold_s": round(est_cold + plan_s, 3),
           "paper_s": PAPER_S[n], "goal_s": round(PAPER_S[n] / 10, 4),
           "ilp_over_paper": round(ilp_s / PAPER_S[n], 4), "ilp_cpu_over_paper": round(ilp_c / PAPER_S[n], 4),
           "plan_over_paper": round(plan_s / PAPER_S[n], 4), "plan_cpu_over_paper": round(plan_c / PAPER_S[n], 4),
           "plan_cold_over_paper": round((est_cold + plan_s) / PAPER_S[n], 4),
           "best": {"prefill": best.deployment.prefill_spec, "decode": best.deployment.decode_spec,
                    "slo_attainment": round(best.slo_attainment, 4)},
           "candidates_checked": res.candidates, "candidates_skipped": res.skipped,
           "ilp_candidates_order": [f"{d.prefill_spec}|{d.decode_spec}" for _, d in cands],
           "check_attainment": {f"{d.prefill_spec}|{d.decode_spec}": round(r[1], 4) for d, r in checked}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "planner_time.json"))
    ap.add_argument("--sizes", default="8,16,32,64,128,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--check-sessions", type=int, default=200)
    a = ap.parse_args(argv)
    rows = []
    load0 = os.getloadavg()[0]
    for n in (int(x) for x in a.sizes.split(",")):
        r = one_size(n, a)
        rows.append(r)
        print(f"{n:>4} GPUs: search {r['search_s']:.4f} s, ilp {r['ilp_s']:.3f} s (cpu {r['ilp_cpu_s']:.3f} s), "
              f"checks (all {r['ilp_candidates']}) {r['checks_all_s']:.3f} s, plan {r['plan_s']:.3f} s "
              f"(cpu {r['plan_cpu_s']:.3f} s, {r['candidates_checked']} checked, {r['candidates_skipped']} skipped), "
              f"estimates cold {r['estimates_cold_s']:.2f} s "
              f"/ cached {r['estimates_cached_s']:.3f} s; paper {r['paper_s']} s (goal {r['goal_s']} s); "
              f"best {r['best']}; load {os.getloadavg()[0]:.1f}", flush=True)
    doc = {"command": "python -m benchmarks.planner_time " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": f"{platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} cores (shared: "
                      f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)",
           "workload": f"{MODEL}, {PRESET} preset at (knee rate on {BASE_GPUS} GPUs) x N/{BASE_GPUS}, "
                       f"{a.duration:g} s of arrivals, seed 3",
           "paper_s": PAPER_S, "sizes": rows}
    write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
