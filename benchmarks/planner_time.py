"""Cold planning time by cluster size, 8 to 256 GPUs, against the paper's (App. A.2, Fig. 7).

    python -m benchmarks.planner_time [--repeats 3] [--baseline PATH] [--out benchmarks/results/planner_time.json]

What a user waits for: `ampd plan --profile llama3.1-70b@h20 --trace T --gpus N --json OUT` in a
fresh Python process with no cache (no --estimates-cache), timed from the process's start to its exit
(interpreter start, imports, reading the trace, the default SLO, the estimates, the SCIP solves, the
finalists' check simulations, writing the JSON). The .pyc files exist, as after an install (one
warm-up run first writes them; PYTHONDONTWRITEBYTECODE is cleared for the runs).

Workload: a 400-session agent trace per size, the toolbench preset (a tool-use agent) at the rate
`make paper` found AMPD's knee at on 8 GPUs (results/paper/scan.json) x N / 8, seed 3.

Per size: --repeats cold runs of this tree (median, min, max of the wall time: the machine is
shared, so the spread is reported, and the process's CPU seconds beside it: on a busy 2-core machine
the wall time is mostly waiting for a core) and, with --baseline (a checkout of the planner before this change, e.g. /work/main),
--baseline-repeats cold runs of that tree on the same trace in the same benchmark run. Each run's
JSON gives the split the planner itself reports: estimates, SCIP solves (count and seconds), check
simulations (count and seconds). Import time: a fresh process importing what `ampd plan` imports.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import write_json

RESULTS = os.path.join(os.path.dirname(__file__), "results")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_S = {8: 0.54, 16: 1.93, 32: 5.06, 64: 14.50, 128: 28.88, 256: 61.67}
MODEL, PRESET, BASE_GPUS, SESSIONS = "llama3.1-70b@h20", "toolbench", 8, 400
# what a cold `ampd plan` imports before it reads the trace: the CLI and the plan command's modules
# (`ampd plan --help`), and the solver with the numpy it brings
IMPORTS = {"cli": ["-m", "ampd", "plan", "--help"], "pyscipopt": ["-c", "import pyscipopt"],
           "planner+simulator": ["-c", "import ampd.planner.plan, ampd.planner.ilp, ampd.sim"]}


def _env(tree: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _cold(tree: str, trace: str, n: int, out: str) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds, the plan's JSON) of one cold `ampd plan` process."""
    c, t = _cpu(), time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "ampd", "plan", "--profile", MODEL, "--trace", trace,
                        "--gpus", str(n), "--json", out], capture_output=True, text=True, env=_env(tree), cwd=tree)
    wall, cpu = time.perf_counter() - t, _cpu() - c
    if r.returncode != 0:
        raise RuntimeError(f"ampd plan failed in {tree}: {r.stderr[-2000:]}")
    with open(out, encoding="utf-8") as f:
        return wall, cpu, json.load(f)


def _imports(tree: str, args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, env=_env(tree), cwd=tree, capture_output=True)
    return time.perf_counter() - t


def _spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3),
            "runs": [round(x, 3) for x in xs]}


def one_size(n: int, a, tmp: str) -> dict:
    from ampd.workload import dump_trace, generate

    base = json.load(open(os.path.join(RESULTS, "paper", "scan.json")))["scale_rate"][f"{MODEL}|{PRESET}"]
    rate = base * n / BASE_GPUS
    sessions = generate(PRESET, rate, SESSIONS / rate, 3)[:SESSIONS]
    trace = os.path.join(tmp, f"agent{n}.jsonl")
    dump_trace(sessions, trace)
    out = os.path.join(tmp, f"plan{n}.json")
    ours, cpus, docs = [], [], []
    for _ in range(a.repeats):
        wall, cpu, doc = _cold(ROOT, trace, n, out)
        ours.append(wall)
        cpus.append(cpu)
        docs.append(doc)
    row = {"gpus": n, "rate": round(rate, 4), "sessions": len(sessions),
           "cold_s": _spread(ours), "cold_cpu_s": _spread(cpus), "paper_s": PAPER_S[n],
           "goal_s": PAPER_S[n] if n < 64 else round(PAPER_S[n] / 10, 3),
           "cold_over_paper": round(statistics.median(ours) / PAPER_S[n], 4)}
    row["meets_goal"] = statistics.median(ours) <= row["goal_s"]
    row["cpu_meets_goal"] = statistics.median(cpus) <= row["goal_s"]
    last = docs[-1]
    row["inside"] = {"plan_s": _spread([d["seconds"] for d in docs]),
                     "estimates_s": _spread([d["timings"]["estimates_s"] for d in docs]),
                     "solve_s": _spread([d["timings"]["solve_s"] for d in docs]),
                     "simulations_s": _spread([d["timings"]["simulations_s"] for d in docs]),
                     "solver": last["solver"], "solver_calls": last["solver_calls"],
                     "solve_statuses": sorted({s["status"] for s in last["solves"]}),
                     "simulations": last["timings"]["simulations"]}
    row["best"] = {k: last["top"][0][k] for k in ("prefill", "decode", "policy", "slo_attainment")}
    if a.baseline:
        bl = [_cold(a.baseline, trace, n, out)[:2] for _ in range(a.baseline_repeats)]
        row["baseline_cold_s"] = _spread([w for w, _ in bl])
        row["baseline_cold_cpu_s"] = _spread([c for _, c in bl])
        row["speedup_median"] = round(statistics.median(w for w, _ in bl) / statistics.median(ours), 2)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "planner_time.json"))
    ap.add_argument("--sizes", default="8,16,32,64,128,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default="", help="a tree with the planner to compare with (e.g. /work/main)")
    ap.add_argument("--baseline-repeats", type=int, default=2)
    a = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sizes = [int(x) for x in a.sizes.split(",")]
        from ampd.workload import dump_trace, generate

        warm = os.path.join(tmp, "warm.jsonl")
        dump_trace(generate(PRESET, 1.0, 20.0, 1), warm)
        for tree in [ROOT] + ([a.baseline] if a.baseline else []):
            _cold(tree, warm, 8, os.path.join(tmp, "warm.json"))  # writes the .pyc files, as an install would
        imports = {name: {"this": _spread([_imports(ROOT, args) for _ in range(a.repeats)])}
                   for name, args in IMPORTS.items()}
        if a.baseline:
            for name, args in IMPORTS.items():
                imports[name]["baseline"] = _spread([_imports(a.baseline, args) for _ in range(a.baseline_repeats)])
        for n in sizes:
            r = one_size(n, a, tmp)
            rows.append(r)
            base = f", baseline {r['baseline_cold_s']['median']:.2f} s (x{r['speedup_median']})" if a.baseline else ""
            print(f"{n:>4} GPUs: cold {r['cold_s']['median']:.3f} s [{r['cold_s']['min']:.3f}, {r['cold_s']['max']:.3f}]"
                  f" cpu {r['cold_cpu_s']['median']:.3f} s"
                  f" (plan() {r['inside']['plan_s']['median']:.3f} s: estimates {r['inside']['estimates_s']['median']:.3f},"
                  f" {r['inside']['solver_calls']} SCIP solves {r['inside']['solve_s']['median']:.3f},"
                  f" {r['inside']['simulations']} checks {r['inside']['simulations_s']['median']:.3f}){base};"
                  f" goal {r['goal_s']} s; best {r['best']}", flush=True)
    doc = {"command": "python -m benchmarks.planner_time " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": f"{platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} cores (shared: "
                      f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)",
           "workload": f"{MODEL}, {SESSIONS} sessions of the {PRESET} preset at (knee rate on {BASE_GPUS} GPUs) "
                       f"x N/{BASE_GPUS}, seed 3",
           "cold": "a fresh `ampd plan` process per run, no cache; .pyc files present",
           "goal": "<= the paper's time below 64 GPUs, <= 1/10 of it from 64 GPUs up (issue 26)",
           "paper_s": PAPER_S, "import_s": imports, "sizes": rows}
    write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
