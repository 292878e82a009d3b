"""Simulator fidelity on a real engine: `ampd profile --engine torch`, then the simulator run with that
profile against a live `ampd up --engine torch` on a short trace the profile never saw.

1. Computes with cores/2 torch threads, as each of the deployment's two workers (OMP_NUM_THREADS
   for them), in a session of its own as every worker (autogroup scheduling). Profiles the torch
   engine (SmolLM2-135M) with ``ampd.profiler`` on the ``full`` CPU grid.
2. Starts a live deployment with that profile: torch engines, 1 prefill + 1 decode worker, policy
   ``remote``; replays a calibration trace (another seed), then the compared trace ``--runs`` times.
3. Profiles again and merges the two profile runs (``merge_runs``: drift cancels to first order);
   writes the merged profile to benchmarks/results/torch_profile.json with the path latency (per
   round and per decode step) calibrated on the calibration replay (``calibrate_path``).
4. Simulates the compared trace with the merged profile, with and without that path latency, and
   compares median TTFT and ITL with the median of the live runs (goal: within 20 %); diagnostics:
   ``live_vs_model``, ``contention_split``, ``engine_step_probe``.

The trace: ToolBench-shaped sessions (``toolbench`` preset, its arrivals and tool times) with the
inputs divided by 4 and the outputs capped at 32 tokens, at most 4 rounds, so that a 135M model on
2 cores serves it in about a minute.

``make bench BENCH=torch_fidelity``; writes benchmarks/results/torch_fidelity.json. Results on a
shared 2-core box are noisy: the JSON records the load average before and after each phase.
"""
from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from ampd.bench.client import replay
from ampd.bench.report import SLO, build_report
from ampd.launcher import Deployment, Options
from ampd.perf import profile_from_dict
from ampd.profiler import profile_engine
from ampd.sim import PathLatency, sim_report, simulate
from ampd.workload import Session, generate

RESULTS = Path(__file__).parent / "results"
PROFILE_OUT = RESULTS / "torch_profile.json"
OUT = RESULTS / "torch_fidelity.json"

MODEL = "smollm2-135m-instruct"
GRID = "full"
POLICY = "remote"
PREFILL = "tp1*1"
DECODE = "tp1*1"
TTFT_SLO_S = 5.0        # the report's attainment only; medians do not depend on it
ITL_SLO_S = 0.3
WINDOW_S = 4.0
SEED = 0
TOL_REL = 0.20          # the issue's goal: median TTFT and ITL within 20 %

RATE = 0.12             # sessions per second
DURATION_S = 50.0
TRACE_SEED = 25
INPUT_DIV = 4
MAX_OUTPUT = 32
MAX_ROUNDS = 4


def trace(seed: int = TRACE_SEED, duration: float = DURATION_S) -> list[Session]:
    out = []
    for s in generate("toolbench", rate=RATE, duration=duration, seed=seed):
        rounds = s.rounds[:MAX_ROUNDS]
        rounds = tuple(replace(r, input=max(8, r.input // INPUT_DIV), output=min(r.output, MAX_OUTPUT),
                               tool_s=r.tool_s if i < len(rounds) - 1 else None)
                       for i, r in enumerate(rounds))
        out.append(Session(id=s.id, arrival=s.arrival, rounds=rounds))
    return out


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _progress():
    last = [0.0]

    def tick(done: int, total: int) -> None:
        if done == total or time.monotonic() - last[0] > 15:
            last[0] = time.monotonic()
            _log(f"profile: {done}/{total} timed runs")
    return tick


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _rel(live: float | None, sim: float | None) -> float | None:
    return None if not live or sim is None else round((sim - live) / live, 4)


def _medians(rep: dict) -> dict:
    return {"ttft_p50_s": rep["ttft_s"]["p50"], "itl_p50_s": rep["itl_s"]["p50"],
            "ttft_p90_s": rep["ttft_s"]["p90"], "itl_p90_s": rep["itl_s"]["p90"]}


def _rounds(records) -> dict[tuple[str, int], dict]:
    """(session, round) -> its TTFT and mean token gap (what the live-vs-sim table pairs up)."""
    out = {}
    for s in records:
        for i, r in enumerate(s.rounds):
            gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:])] if r.token_times else []
            out[(s.session_id, i)] = {"ttft_s": r.first_token - r.input_ready if r.first_token else None,
                                      "gap_s": statistics.mean(gaps) if gaps else None,
                                      # the gaps of the decode steps alone: the first gap also holds
                                      # the hand-off from the prefill worker
                                      "step_gap_s": statistics.mean(gaps[1:]) if len(gaps) > 1 else None,
                                      "l_hist": r.l_hist, "l_incr": r.l_incr}
    return out


def live_vs_model(live_records, sim_records, profile) -> dict:
    """Round by round, live against simulated: how much longer live TTFTs and token gaps are, as
    medians of ratios, and the prefill-only share (the profile's t_pre of the round against the live
    TTFT), so that a gap is placed in the prefill, the transfer or the decode steps."""
    live, sim = _rounds(live_records), _rounds(sim_records)
    ttft_ratio, gap_ratio, pre_share = [], [], []
    for key, lv in live.items():
        sv = sim.get(key)
        if not sv:
            continue
        if lv["ttft_s"] and sv["ttft_s"]:
            ttft_ratio.append(lv["ttft_s"] / sv["ttft_s"])
            pre_share.append(profile.t_pre(1, lv["l_hist"], lv["l_incr"]) / lv["ttft_s"] if lv["l_incr"] else None)
        if lv["gap_s"] and sv["gap_s"]:
            gap_ratio.append(lv["gap_s"] / sv["gap_s"])

    def med(xs):
        return round(statistics.median(xs), 4) if xs else None
    return {"rounds_paired": len(ttft_ratio),
            "ttft_live_over_sim_median": med(ttft_ratio),
            "token_gap_live_over_sim_median": med(gap_ratio),
            "modelled_prefill_over_live_ttft_median": med([x for x in pre_share if x is not None])}


def _overlaps(a: float, b: float, spans) -> bool:
    return any(x < b and a < y for x, y in spans)


def contention_split(live_records, sim_records) -> dict:
    """Whether the live deployment's two torch processes slow each other down on the shared cores:
    live token gaps while the prefill worker was computing another session's prefill (a round between
    its input and its first token, every prefill is remote) against gaps while it was idle; and each
    round's live TTFT over its simulated twin's, while the decode worker was decoding another session
    or not. The simulator's engines never share cores."""
    sim = _rounds(sim_records)
    prefill, decode = {}, {}
    for s in live_records:
        for i, r in enumerate(s.rounds):
            if r.first_token:
                prefill[(s.session_id, i)] = (r.input_ready, r.first_token)
            if len(r.token_times) > 1:
                decode[(s.session_id, i)] = (r.token_times[0], r.token_times[-1])
    gaps = {True: [], False: []}
    ttft = {True: [], False: []}
    for s in live_records:
        for i, r in enumerate(s.rounds):
            key = (s.session_id, i)
            others_pre = [v for k, v in prefill.items() if k[0] != s.session_id]
            others_dec = [v for k, v in decode.items() if k[0] != s.session_id]
            for a, b in zip(r.token_times, r.token_times[1:]):
                gaps[_overlaps(a, b, others_pre)].append(b - a)
            sv = sim.get(key)
            if key in prefill and sv and sv["ttft_s"]:
                a, b = prefill[key]
                ttft[_overlaps(a, b, others_dec)].append((b - a) / sv["ttft_s"])

    def stat(xs, scale=1.0):
        return {"n": len(xs), "median": round(statistics.median(xs) * scale, 4) if xs else None}
    return {"token_gap_ms_while_prefill_worker_computes": stat(gaps[True], 1e3),
            "token_gap_ms_while_prefill_worker_idle": stat(gaps[False], 1e3),
            "ttft_live_over_sim_while_decode_worker_decodes": stat(ttft[True]),
            "ttft_live_over_sim_while_decode_worker_idle": stat(ttft[False])}


PROBE_CONTEXT = 256


def probe_step(engine, reps: int = 9) -> float:
    """Median seconds of one decode step at batch 1 over a ``PROBE_CONTEXT``-token history, timed in this
    process with no deployment computing: what the machine gives the engine at this moment, to set
    beside the profile's t_dec(1, context) (measured earlier) and the live token gap."""
    from ampd.engine.base import DecodeSeq
    from ampd.kv import Segment

    bt = 32
    pool = engine.make_pool(PROBE_CONTEXT + bt, bt)
    hist = [Segment(b, 0, bt) for b in range(PROBE_CONTEXT // bt)]
    seq = DecodeSeq("probe", PROBE_CONTEXT, 1, [Segment(PROBE_CONTEXT // bt, 0, 1)], PROBE_CONTEXT + 1,
                    history_kv=hist)
    engine.decode_sync(pool, [seq])
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        engine.decode_sync(pool, [seq])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


KEPT_RUNS = 8


def headline(run: dict) -> dict:
    """What one run says, in a line: when, the load, the profile's held-out error, live and simulated
    medians (the simulation the goal is judged on)."""
    key = run.get("judged_on", "no_path_latency")
    sim = run["sim"][key]
    return {"when": run["when"], "loadavg_1m": run["loadavg_1m"],
            "compute_threads": run.get("compute_threads"),
            "profile_accepted": run["profile"]["accepted"],
            "held_out_max": {q: e["max_rel"] for q, e in run["profile"]["held_out_error"].items()},
            "live": {k: round(run["live"][k], 4) for k in ("ttft_p50_s", "itl_p50_s")},
            "sim": {k: round(sim["sim"][k], 4) for k in ("ttft_p50_s", "itl_p50_s")},
            "judged_on": key, "rel_diff": {k: sim["rel_diff"][k] for k in ("ttft_p50_s", "itl_p50_s")},
            "engine_step_probe": run.get("engine_step_probe")}


def _earlier(run: dict) -> list[dict]:
    """The headlines of the runs before this one (newest first, at most ``KEPT_RUNS``): on a shared
    machine one run says little about the next, so the file keeps how they differed."""
    try:
        last = json.loads(OUT.read_text())
    except (OSError, ValueError):
        return []
    return ([headline(last)] + last.get("earlier_runs", []))[:KEPT_RUNS]


CAL_SEED = 8            # the calibration trace: another draw of the same shape, never the compared one
CAL_DURATION_S = 60.0


def _renamed(sessions: list[Session], prefix: str) -> list[Session]:
    """Session ids of their own: several replays share one deployment."""
    return [replace(s, id=f"{prefix}{s.id}") for s in sessions]


def calibrate_path(live_records, sim_records) -> PathLatency:
    """What the live path adds beyond the profile, from the calibration replay (never the compared
    one), each the median over rounds paired with their simulated twins (no path latency), >= 0:
    - ``dispatch``: the excess of live TTFT (the coordinator's routing, the queue and KV-written
      notifications, the gRPC hops, and the decode worker computing beside the prefill worker on the
      shared cores, which the simulator's engines never do);
    - ``step``: the excess of a live decode step's token gap (a round's gaps after its first): the
      worker's loop around each step and the token's way out through the coordinator and the front,
      on cores the other services share. The profile times the step alone (fastest of its runs; on a
      quiet box within 2 % of the median). Without it the simulated ITL P50 was 16-21 % low in every
      run on 2026-12-07 (live later gaps 66-77 ms against 61-65 simulated; a step alone at batch 1, 2
      and 3: 49, 60 and 65 ms). On a busy box this residual also carries the moment's load (a run
      under load 7-13 with the profile's old median timing read 67 ms)."""
    live, sim = _rounds(live_records), _rounds(sim_records)

    def excess(field: str) -> list[float]:
        return [lv[field] - sim[key][field] for key, lv in live.items() if key in sim and lv[field] and sim[key][field]]

    def median_excess(xs: list[float]) -> float:
        return round(max(0.0, statistics.median(xs)), 5) if xs else 0.0

    ttft = excess("ttft_s")
    if not ttft:
        raise RuntimeError("calibration: no round was paired with its simulated twin")
    return PathLatency(dispatch_s=median_excess(ttft), step_s=median_excess(excess("step_gap_s")))


def compute_threads() -> int:
    """Intra-op threads per torch process: the deployment's two workers share the cores, so each gets
    its share (what a worker computes with is what its profile must be measured with)."""
    return max(1, (os.cpu_count() or 1) // 2)


def _sim(sessions, profile, path):
    res = simulate(sessions, profile, policy=POLICY, prefill=PREFILL, decode=DECODE, ttft_slo_s=TTFT_SLO_S,
                   itl_slo_s=ITL_SLO_S, seed=SEED, window_s=WINDOW_S, path=path)
    return sim_report(res, SLO(TTFT_SLO_S, ITL_SLO_S), max_full_tokens=10**12), res


def _profile(label: str, reps: int, loads: dict):
    loads[f"{label}_start"] = _load()
    _log(f"profiling the torch engine ({MODEL}, grid {GRID}, {reps} reps, {compute_threads()} threads), "
         f"{label}; load {loads[f'{label}_start']}")
    run = profile_engine("torch", model=MODEL, grid=GRID, reps=reps, progress=_progress())
    loads[f"{label}_end"] = _load()
    _log(f"{label}: {run.seconds:.0f} s, " + ", ".join(f"{q} held-out max {e.max_rel:.1%}"
                                                      for q, e in run.held_out.items()))
    return run


def main(runs: int = 1, reps: int = 3) -> dict:
    import torch

    from ampd.engine import make_engine
    from ampd.profiler import merge_runs
    from ampd.sim import to_session_records
    from benchmarks.fidelity import warm_up

    t0 = time.monotonic()
    # A session of its own, as every worker `ampd up` starts (start_new_session): with the kernel's
    # autogroup scheduling a session is one scheduling group, so the profiler then competes for the
    # cores with other work as a live worker does, not as one process of a busy shell's session.
    try:
        os.setsid()
    except OSError:
        pass  # already a process group leader (started by `setsid`, or a shell's job): as it is
    threads = compute_threads()
    torch.set_num_threads(threads)                 # the profiling process computes as a worker does
    os.environ["OMP_NUM_THREADS"] = str(threads)   # and the deployment's workers inherit it
    loads = {}
    before = _profile("profile_before", reps, loads)
    RESULTS.mkdir(exist_ok=True)
    PROFILE_OUT.write_text(json.dumps(before.document, indent=1) + "\n")  # what the deployment routes with
    sessions = trace()
    cal = _renamed(trace(seed=CAL_SEED, duration=CAL_DURATION_S), "cal-")
    slo = SLO(TTFT_SLO_S, ITL_SLO_S)
    opts = Options(engine="torch", model=MODEL, profile=str(PROFILE_OUT), prefill=PREFILL, decode=DECODE,
                   policy=POLICY, ttft_slo=TTFT_SLO_S, itl_slo=ITL_SLO_S, stats_window=WINDOW_S, seed=SEED,
                   namespace="torch-fidelity")
    engine = make_engine("torch", None, 1, MODEL)
    probe = {}
    lives = []
    with Deployment(opts) as dep:
        warm_up(dep.coordinator)
        time.sleep(WINDOW_S + 0.5)
        _log(f"calibration: {len(cal)} sessions, {sum(len(s.rounds) for s in cal)} rounds")
        cal_records, cal_stats, _, _ = asyncio.run(replay(dep.coordinator, cal, progress=False, timeout_s=600))
        probe["before_live_s"] = round(probe_step(engine), 5)
        for k in range(runs):
            time.sleep(WINDOW_S + 0.5)
            loads[f"live{k}_start"] = _load()
            _log(f"live {k + 1}/{runs}: {len(sessions)} sessions, {sum(len(s.rounds) for s in sessions)} rounds; "
                 f"load {loads[f'live{k}_start']}")
            got = asyncio.run(replay(dep.coordinator, _renamed(sessions, f"r{k}-"), progress=False, timeout_s=600))
            loads[f"live{k}_end"] = _load()
            lives.append(got)
        probe["after_live_s"] = round(probe_step(engine), 5)
    del engine
    after = _profile("profile_after", reps, loads)
    run = merge_runs([before, after])
    for p in run.problems:
        _log(f"profile check: {p}")
    profile = profile_from_dict(run.document, str(PROFILE_OUT))
    probe["profile_t_dec_s"] = round(profile.t_dec(1, 1, PROBE_CONTEXT + 1), 5)
    # the live path's own per-round and per-step cost, from the calibration replay against the profile
    cal_sim = _sim(cal, profile, PathLatency())[1]
    path = calibrate_path(cal_records, to_session_records(cal_sim))
    run.document["profiling"]["path_latency"] = {
        "value": path.format(), "measured_on": f"calibration replay (toolbench seed {CAL_SEED}, {CAL_DURATION_S:g} s "
                                               "of arrivals), live vs simulated without path latency, medians"}
    PROFILE_OUT.write_text(json.dumps(run.document, indent=1) + "\n")
    _log(f"merged profile: problems {len(run.problems)}; path latency {path.format()}")
    rows = {}
    per_run = []
    for label, pl in (("no_path_latency", PathLatency()), ("calibrated_path_latency", path)):
        rep, res = _sim(_renamed(sessions, "r0-"), profile, pl)
        sm = _medians(rep)
        rels = []
        for records, stats, wall, _ in lives:
            lm = _medians(build_report(POLICY, records, slo, wall))
            rels.append({k: _rel(lm[k], sm[k]) for k in lm})
        rel = {k: _rel(statistics.median(_medians(build_report(POLICY, r, slo, w))[k] for r, _, w, _ in lives),
                       sm[k]) for k in sm}
        sim_records = to_session_records(res)
        rows[label] = {"sim": sm, "rel_diff": rel, "rel_diff_per_live_run": rels,
                       "within_tolerance": all(rel[k] is not None and abs(rel[k]) <= TOL_REL
                                               for k in ("ttft_p50_s", "itl_p50_s")),
                       "round_by_round": live_vs_model(lives[0][0], sim_records, profile),
                       "contention": contention_split(lives[0][0], sim_records)}
    for records, stats, wall, _ in lives:
        rep = build_report(POLICY, records, slo, wall)
        per_run.append({**_medians(rep), "completed": rep["completed"], "failed": rep["failed"],
                        "errors_sample": stats.errors[:3], "wall_s": round(wall, 1)})
    live = {k: statistics.median(r[k] for r in per_run) for k in ("ttft_p50_s", "itl_p50_s", "ttft_p90_s",
                                                                  "itl_p90_s")}
    out = {
        "command": f"make bench BENCH=torch_fidelity (benchmarks/torch_fidelity.py --runs {runs} --reps {reps})",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "compute_threads": threads,
        "own_session": os.getsid(0) == os.getpid(),
        "profile": {"file": str(PROFILE_OUT.relative_to(RESULTS.parent.parent)), "grid": GRID, "reps": reps,
                    "merged": "mean of a run before the live replays and one after",
                    "seconds": round(run.seconds, 1), "accepted": not run.problems, "problems": run.problems,
                    "held_out_error": {q: e.to_json() for q, e in run.held_out.items()},
                    "runs_held_out_max": {lbl: {q: round(e.max_rel, 4) for q, e in r.held_out.items()}
                                          for lbl, r in (("before", before), ("after", after))},
                    "path_latency": path.format()},
        "deployment": {"engine": "torch", "model": MODEL, "prefill": PREFILL, "decode": DECODE, "policy": POLICY,
                       "window_s": WINDOW_S, "omp_num_threads": threads},
        "trace": {"preset": "toolbench", "rate": RATE, "duration_s": DURATION_S, "seed": TRACE_SEED,
                  "input_div": INPUT_DIV, "max_output": MAX_OUTPUT, "max_rounds": MAX_ROUNDS,
                  "sessions": len(sessions), "rounds": sum(len(s.rounds) for s in sessions)},
        "calibration": {"seed": CAL_SEED, "duration_s": CAL_DURATION_S, "sessions": len(cal),
                        "rounds": sum(len(s.rounds) for s in cal), "failed": len(cal_stats.errors)},
        "tolerance_rel": TOL_REL,
        "judged_on": "calibrated_path_latency",
        "live": {**live, "runs": per_run},
        "sim": rows,
        # the same decode step, timed alone in this process around the live replays: how the machine
        # itself changed, apart from anything the live path adds
        "engine_step_probe": probe,
        "loadavg_1m": loads,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    out["earlier_runs"] = _earlier(out)
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    for label, row in rows.items():
        _log(f"{label}: TTFT p50 live {live['ttft_p50_s']:.3f} sim {row['sim']['ttft_p50_s']:.3f} "
             f"({row['rel_diff']['ttft_p50_s']}); ITL p50 live {live['itl_p50_s']:.4f} sim "
             f"{row['sim']['itl_p50_s']:.4f} ({row['rel_diff']['itl_p50_s']}); {row['round_by_round']}")
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="The torch profile against a live torch deployment (docs/fidelity.md).")
    ap.add_argument("--runs", type=int, default=1, help="live replays of the trace on one deployment; the live "
                                                        "medians compared are the median over them (default 1)")
    ap.add_argument("--reps", type=int, default=3, help="runs per profiled point in each profile run (default 3)")
    a = ap.parse_args()
    if a.runs < 1 or a.reps < 1:
        ap.error("--runs and --reps must be >= 1")
    main(a.runs, a.reps)
