"""Planner agreement: the planner's top 3 against the top 3 by simulated SLO attainment over every
feasible deployment (brute force), for the 12 model x preset cases at the paper's GPU counts.

    python -m benchmarks.planner_agreement [--jobs 2] [--out benchmarks/results/planner_agreement.json]

Workload per case: the preset at the rate `make paper` found AMPD's knee at (results/paper/scan.json
"scale_rate"), ~300 sessions (duration as in benchmarks/paper.py), seed 7; the paper's SLO thresholds
for the case (results/paper/slo.json); policy ampd. Both sides rank with plan()'s key (SLO
attainment, then the worse of P95 TTFT and P95 mean ITL over their thresholds); the brute force
simulates every deployment on the whole trace, the planner as `ampd plan` runs (closed-form
estimates, SCIP, its finalists' short checks). "top1_in_top3" counts the cases whose chosen #1 is
among the brute force's top 3; "top1_attainment_gap" is what choosing it cost on the whole trace.

Search space (both sides, the planner's `mixed=False, colocated=False, all_gpus=True`): disaggregated
deployments with one TP degree per phase (the form of the paper's Table 2), every degree whose replica
holds the model, at least one replica per phase, all N GPUs used (as every Table 2 entry does);
--all-sizes lets both sides use fewer GPUs too (several times more brute-force simulations).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from multiprocessing import Pool

from benchmarks.paper import GPUS, MODELS, PRESETS, TABLE2, TABLE2_ALT, duration_for
from benchmarks import write_json

RESULTS = os.path.join(os.path.dirname(__file__), "results")
SEED = 7


def _case_inputs(model: str, preset: str):
    from ampd.bench.report import SLO
    from ampd.perf import load_profile
    from ampd.workload import generate

    slo = json.load(open(os.path.join(RESULTS, "paper", "slo.json")))["slos"][f"{model}|{preset}"]
    rate = json.load(open(os.path.join(RESULTS, "paper", "scan.json")))["scale_rate"][f"{model}|{preset}"]
    sessions = generate(preset, rate, duration_for(preset, rate, False), SEED)
    return load_profile(model), sessions, SLO(slo["ttft_s"], slo["itl_s"]), rate


def _check(job):
    from ampd.planner import Deployment, PlanRequest
    from ampd.planner.plan import check

    model, preset, pre, dec = job
    prof, sessions, slo, _ = _case_inputs(model, preset)
    req = PlanRequest(prof, sessions, GPUS[preset], slo, check_sessions=0)  # the whole trace
    _, att, p95, p95_itl = check(req, Deployment.of(dict([pre]), dict([dec])))
    # plan()'s key: attainment, then the worse of P95 TTFT and P95 mean ITL over their thresholds
    return job, att, max(p95 / slo.ttft_s, p95_itl / slo.itl_s)


def _label(pre, dec) -> str:
    return f"P<{pre[0]},{pre[1]}> D<{dec[0]},{dec[1]}>"


def _spec_label(pre_spec: str, dec_spec: str) -> str:
    def one(s):
        tp, _, r = s.partition("*")
        return f"<{tp[2:]},{r or 1}>"
    return f"P{one(pre_spec)} D{one(dec_spec)}"


def run_case(model, preset, pool, all_sizes: bool) -> dict:
    from ampd.planner import PlanRequest, feasible_degrees, plan, solve_top
    from ampd.planner.objective import enumerate_deployments
    from ampd.planner.plan import max_context

    prof, sessions, slo, rate = _case_inputs(model, preset)
    n = GPUS[preset]
    t0 = time.perf_counter()
    res = plan(PlanRequest(prof, sessions, n, slo, top=3, colocated=False, mixed=False, all_gpus=not all_sizes))
    plan_s = time.perf_counter() - t0
    ours = [_label(e.deployment.prefill[0], e.deployment.decode[0]) for e in res.top]
    # the ILP's own order (estimated worst P95 / SLO, before any check simulation)
    ilp = [_label(d.prefill[0], d.decode[0]) for _, d in
           solve_top(res.estimates, n, res.degrees, 3, colocated=False, mixed=False, all_gpus=not all_sizes)]
    degrees = feasible_degrees(prof, n, max_context(sessions))
    deps = [d for d in enumerate_deployments(n, degrees, colocated=False, mixed=False) if all_sizes or d.gpus == n]
    jobs = [(model, preset, d.prefill[0], d.decode[0]) for d in deps]
    t0 = time.perf_counter()
    checked = pool.map(_check, jobs, chunksize=1) if pool else [_check(j) for j in jobs]
    brute_s = time.perf_counter() - t0
    ranked = sorted(checked, key=lambda r: (-r[1], r[2]))
    best = [_label(j[2], j[3]) for j, _, _ in ranked[:3]]
    att = {_label(j[2], j[3]): round(a, 4) for j, a, _ in ranked}
    t2 = [_spec_label(*TABLE2[(model, preset)])] + [_spec_label(*x) for x in TABLE2_ALT[(model, preset)]]
    out = {"model": model, "preset": preset, "gpus": n, "rate": rate, "sessions": len(sessions),
           "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
           "planner_top3": ours, "planner_top3_attainment": [att.get(x) for x in ours],
           "brute_force_top3": best, "brute_force_top3_attainment": [att[x] for x in best],
           "matches": sorted(set(ours) & set(best)), "misses": [x for x in best if x not in ours],
           "ilp_top3": ilp, "ilp_top3_matches": sorted(set(ilp) & set(best)),
           "candidates_cover_space": res.candidates >= len(deps),
           "same_first": ours[:1] == best[:1], "same_order": ours == best,
           "top1_attainment_gap": round(att[best[0]] - (att.get(ours[0]) or 0.0), 4),
           "table2_top3": t2, "table2_top3_attainment": [att.get(x) for x in t2],
           "deployments_brute_forced": len(deps), "planner_candidates_checked": res.candidates,
           "planner_s": round(plan_s, 2), "brute_force_s": round(brute_s, 2)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "planner_agreement.json"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--all-sizes", action="store_true", help="brute force deployments using fewer GPUs too")
    a = ap.parse_args(argv)
    cases = []
    pool = Pool(a.jobs) if a.jobs > 1 else None
    try:
        for m in a.models.split(","):
            for p in a.presets.split(","):
                c = run_case(m, p, pool, a.all_sizes)
                cases.append(c)
                print(f"{m:<18} {p:<10} planner {c['planner_top3']} ilp {c['ilp_top3']} brute {c['brute_force_top3']} "
                      f"matches {len(c['matches'])}/3, ilp {len(c['ilp_top3_matches'])}/3 of "
                      f"{c['deployments_brute_forced']} ({c['planner_s']} s vs {c['brute_force_s']} s)", flush=True)
    finally:
        if pool:
            pool.close()
    summary = {"cases": len(cases), "top3_matches": sum(len(c["matches"]) for c in cases),
               "ilp_top3_matches": sum(len(c["ilp_top3_matches"]) for c in cases),
               "cases_where_candidates_cover_space": sum(c["candidates_cover_space"] for c in cases),
               "top3_matches_where_space_larger": sum(len(c["matches"]) for c in cases if not c["candidates_cover_space"]),
               "top3_slots_where_space_larger": 3 * sum(not c["candidates_cover_space"] for c in cases),
               "top3_slots": 3 * len(cases), "same_first": sum(c["same_first"] for c in cases),
               "same_order": sum(c["same_order"] for c in cases),
               "top1_in_top3": sum(c["planner_top3"][:1] != [] and c["planner_top3"][0] in c["brute_force_top3"]
                                   for c in cases),
               "max_top1_attainment_gap": max((c["top1_attainment_gap"] for c in cases), default=0.0)}
    doc = {"command": "python -m benchmarks.planner_agreement " + " ".join(argv if argv is not None else sys.argv[1:]),
           "space": "disaggregated, one TP degree per phase, degrees whose replica holds the model; brute force over "
                    + ("every size" if a.all_sizes else "deployments using all N GPUs"),
           "summary": summary, "cases": cases}
    write_json(a.out, doc)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
