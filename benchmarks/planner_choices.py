"""Does the planner still choose what `make paper` recorded? Reruns every planner call of the paper
benchmark with the current code and compares its choices with the stored results.

    python -m benchmarks.planner_choices [--jobs 2] [--stored-commit C] [--out benchmarks/results/planner_choices.json]

--stored-commit reads the stored results as commit C has them (git show), e.g. the commit before a
planner change, after `make paper` was rerun on the new one.

- plan.json: for each of the 12 model x preset cases, the five planner runs of
  ``benchmarks.paper_plan.plan_case`` (ampd, remote, colocated, continuum, table2-form; top 3 each),
  on the stored job (rate, SLO, trace seed 0, whole trace).
- tightness.json: the planning half of ``benchmarks.paper_plan.tight_point`` (four runs, top 1, on the
  plan trace of every point); the evaluation simulations are not rerun.

A choice is (prefill SPEC, decode SPEC, policy); the check simulations are deterministic, so the same
deployment has the same simulated attainment. Reports every plan whose first choice or top list
differs, with both lists.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from multiprocessing import Pool
from benchmarks import write_json

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def _choices(top: list) -> list:
    return [[e["prefill"], e["decode"], e["policy"], round(e["slo_attainment"], 4)] for e in top]


def _plan_job(case: dict) -> dict:
    from benchmarks.paper import TABLE2, TABLE2_ALT, duration_for
    from benchmarks.paper_plan import plan_case

    key = (case["model"], case["preset"])
    job = dict(model=case["model"], preset=case["preset"], gpus=case["gpus"], rate=case["rate"],
               duration=duration_for(case["preset"], case["rate"], False), slo=case["slo"],
               table2=[TABLE2[key], *TABLE2_ALT[key]])
    t0 = time.perf_counter()
    new = plan_case(job)
    return {"source": "plan.json", "case": f"{case['model']}|{case['preset']}", "wall_s": round(time.perf_counter() - t0, 1),
            "plans": {name: _compare(case["plans"][name], p) for name, p in new["plans"].items()}}


def _tight_job(point: dict) -> dict:
    from ampd.bench.report import SLO
    from ampd.perf import load_profile
    from ampd.planner import EstimateCache
    from benchmarks import paper_plan as pp

    prof = load_profile(pp.TIGHT_MODEL)
    slo = SLO(ttft_s=point["ttft_s"], itl_s=point["itl_s"])
    trace = pp.tight_trace(point["kind"], pp.PLAN_SEED, point["quick"], point.get("load", 1.0))
    t0 = time.perf_counter()
    new = pp.run_plans(prof, trace, pp.TIGHT_GPUS, slo, EstimateCache(), pp.PLANS, top=1)
    return {"source": "tightness.json", "case": f"{point['kind']}|itl={point['itl_s']}",
            "wall_s": round(time.perf_counter() - t0, 1),
            "plans": {name: _compare(point["plans"][name], p) for name, p in new.items()}}


def _compare(old: dict, new: dict) -> dict:
    a, b = _choices(old["top"]), _choices(new["top"])
    return {"same_first": a[:1] == b[:1], "same_top": a == b, "stored": a, "now": b,
            "candidates_stored": old.get("candidates"), "candidates_now": new.get("candidates"),
            "skipped_now": new.get("skipped", 0), "seconds_stored": old.get("seconds"), "seconds_now": new.get("seconds")}


def _run(job):
    kind, payload = job
    return _plan_job(payload) if kind == "plan" else _tight_job(payload)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "planner_choices.json"))
    ap.add_argument("--paper", default=os.path.join(RESULTS, "paper"), help="the stored make-paper results")
    ap.add_argument("--stored-commit", default="", help="read --paper's files as this git commit has them")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)

    def stored(name):
        path = os.path.join(a.paper, name)
        if not a.stored_commit:
            return json.load(open(path))
        rel = os.path.relpath(path, os.path.dirname(os.path.dirname(RESULTS)))
        out = subprocess.run(["git", "show", f"{a.stored_commit}:{rel}"], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)
    plans = stored("plan.json")["cases"]
    tight = stored("tightness.json")
    quick = tight["duration_s"] < 2400.0
    jobs = [("plan", c) for c in plans.values()] + [("tight", dict(p, quick=quick)) for p in tight["points"]]
    load0 = os.getloadavg()[0]
    t0 = time.time()
    if a.jobs > 1:
        with Pool(a.jobs) as pool:
            rows = pool.map(_run, jobs, chunksize=1)
    else:
        rows = [_run(j) for j in jobs]
    for r in rows:
        diff = [n for n, p in r["plans"].items() if not p["same_top"]]
        print(f"{r['source']:<15} {r['case']:<32} first choices same: "
              f"{sum(p['same_first'] for p in r['plans'].values())}/{len(r['plans'])}"
              + (f"; top differs: {diff}" if diff else ""), flush=True)
    every = [p for r in rows for p in r["plans"].values()]
    summary = {"plans": len(every), "same_first": sum(p["same_first"] for p in every),
               "same_top": sum(p["same_top"] for p in every),
               "candidates_stored": sum(p["candidates_stored"] or 0 for p in every),
               "candidates_now": sum(p["candidates_now"] or 0 for p in every),
               "skipped_now": sum(p["skipped_now"] for p in every),
               "differing": [f"{r['source']} {r['case']} {n}" for r in rows for n, p in r["plans"].items()
                             if not p["same_top"]]}
    doc = {"command": "python -m benchmarks.planner_choices " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": f"{os.cpu_count()} cores (shared: load average {load0:.1f} at the start, "
                      f"{os.getloadavg()[0]:.1f} at the end), {round(time.time() - t0)} s",
           "stored": os.path.relpath(a.paper, os.path.dirname(RESULTS)) + (f" at {a.stored_commit}" if a.stored_commit else ""),
           "summary": summary, "rows": rows}
    write_json(a.out, doc)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
