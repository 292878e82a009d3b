"""Never lose to a baseline (issue 26, item 6): AMPD on the deployment its planner chooses against the
best hand-tuned deployment of each baseline, on held-out agent traces, 16 GPUs.

    python -m benchmarks.never_lose [--out benchmarks/results/never_lose.json]   (make bench BENCH=never_lose)

Points: 2 agent presets (toolbench: short tool-call sessions; gaia: long research-agent sessions)
x 2 rates x 2 ITL SLOs (the default rule's threshold, docs/planner.md "Default SLO", and twice
it: lenient) = 8 points, Llama3.1-70B on H20. Per point:
- AMPD: `ampd plan --policy ampd` (defaults: closed-form estimates, SCIP, short checks) on the plan
  trace (seed 1); its #1 deployment is simulated, under the policy the plan names (a co-located #1
  runs `colocated`), on a held-out trace of the same preset and rate (seed 2).
- Each baseline (remote: Dynamo-style; colocated: vLLM-style; continuum: vLLM-Continuum): every
  deployment of its family with one TP degree and all 16 GPUs is simulated on the held-out trace and
  the best is kept (the paper's "tuned by hand, best reported"; generous to the baselines: they are
  tuned on the evaluation trace itself, AMPD is not).
The claim holds at a point when AMPD's attainment >= the best baseline's - 1 pt.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks import write_json

RESULTS = os.path.join(os.path.dirname(__file__), "results")
MODEL, GPUS, TOLERANCE = "llama3.1-70b@h20", 16, 0.01
# sessions/s on 16 GPUs: around and past where the best deployment starts missing the SLO
RATES = {"toolbench": (1.6, 2.4), "gaia": (0.05, 0.08)}
SESSIONS = 300  # per trace (the arrival window is SESSIONS / rate)
BASELINES = ("remote", "colocated", "continuum")


def _deployments(policy: str, degrees) -> list:
    from ampd.planner import Deployment

    half = GPUS
    if policy == "remote":
        return [Deployment.of({p: a // p}, {d: (half - a) // d}) for p in degrees for d in degrees
                for a in range(p, half, p) if (half - a) % d == 0 and a % p == 0 and half - a >= d]
    return [Deployment.of({}, {n: half // n}) for n in degrees if half % n == 0]


def _simulate(prof, sessions, policy: str, dep, slo) -> dict:
    from ampd.planner.estimates import outcome
    from ampd.sim import simulate

    res = simulate(sessions, prof, policy=policy, prefill=dep.prefill_spec, decode=dep.decode_spec,
                   ttft_slo_s=slo.ttft_s, itl_slo_s=slo.itl_s, seed=0)
    att, p95, p95_itl, _ = outcome(res, slo)
    return {"prefill": dep.prefill_spec, "decode": dep.decode_spec, "policy": policy,
            "slo_attainment": round(att, 4), "p95_ttft_s": round(p95, 4), "p95_itl_s": round(p95_itl, 5)}


def point(preset: str, rate: float, itl_factor: float) -> dict:
    from ampd.perf import load_profile
    from ampd.planner import PlanRequest, feasible_degrees, plan
    from ampd.planner.plan import max_context, resolve_slo
    from ampd.slo import SLO
    from ampd.workload import generate

    prof = load_profile(MODEL)
    train = generate(preset, rate, SESSIONS / rate, 1)
    held = generate(preset, rate, SESSIONS / rate, 2)
    base = resolve_slo(prof, train, GPUS, None, None)
    slo = SLO(ttft_s=base.ttft_s, itl_s=round(base.itl_s * itl_factor, 4))
    t0 = time.perf_counter()
    res = plan(PlanRequest(prof, train, GPUS, slo, top=1, policy="ampd"))
    plan_s = time.perf_counter() - t0
    best = res.top[0]
    ampd = _simulate(prof, held, best.policy, best.deployment, slo)
    degrees = feasible_degrees(prof, GPUS, max(max_context(train), max_context(held)))
    baselines = {}
    for pol in BASELINES:
        runs = [_simulate(prof, held, pol, d, slo) for d in _deployments(pol, degrees)]
        runs.sort(key=lambda r: (-r["slo_attainment"], r["p95_ttft_s"]))
        baselines[pol] = {"best": runs[0], "deployments_tried": len(runs)}
    best_base = max(baselines.values(), key=lambda b: b["best"]["slo_attainment"])["best"]
    margin = ampd["slo_attainment"] - best_base["slo_attainment"]
    return {"preset": preset, "rate": rate, "itl_slo": "strict" if itl_factor == 1 else "lenient",
            "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s}, "sessions": [len(train), len(held)],
            "ampd_plan": {"prefill": best.deployment.prefill_spec, "decode": best.deployment.decode_spec,
                          "policy": best.policy, "plan_trace_attainment": round(best.slo_attainment, 4),
                          "plan_s": round(plan_s, 3)},
            "ampd": ampd, "baselines": baselines, "best_baseline": best_base,
            "margin_pts": round(100 * margin, 2), "holds": margin >= -TOLERANCE - 1e-9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "never_lose.json"))
    ap.add_argument("--presets", default=",".join(RATES))
    a = ap.parse_args(argv)
    rows = []
    for preset in a.presets.split(","):
        for rate in RATES[preset]:
            for f in (1.0, 2.0):
                r = point(preset, rate, f)
                rows.append(r)
                b = r["best_baseline"]
                print(f"{preset:<9} rate {rate:<5} ITL {r['itl_slo']:<8} ampd {r['ampd']['slo_attainment']:.3f} "
                      f"({r['ampd']['prefill']}|{r['ampd']['decode']} {r['ampd']['policy']}) best baseline "
                      f"{b['slo_attainment']:.3f} ({b['policy']} {b['prefill']}|{b['decode']}) "
                      f"margin {r['margin_pts']:+.2f} pts {'ok' if r['holds'] else 'LOSES'}", flush=True)
    doc = {"command": "python -m benchmarks.never_lose " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": MODEL, "gpus": GPUS, "tolerance_pts": 100 * TOLERANCE,
           "summary": {"points": len(rows), "holds": sum(r["holds"] for r in rows),
                       "worst_margin_pts": min(r["margin_pts"] for r in rows)},
           "points": rows}
    write_json(a.out, doc)
    print(json.dumps(doc["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
