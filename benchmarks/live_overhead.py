"""What the live path itself adds per round, and the simulator's PathLatency measured from it.

Two measurements, each on a small live deployment (mock engines, 1 prefill + 1 decode worker of TP 1).

1. **Client latency** (``paths``): a profile whose costs are all zero (``zero@none``); sessions one at
   a time, tools on the client; from the client sending a round's input (the session open or the
   tool result) to it receiving that round's first token. This is the whole round trip as a client
   sees it; the client runs on uvloop, as ``ampd bench`` does. ``by_round`` splits the sessions'
   first rounds (the open: admission, binding, a new stream to the coordinator and one to the
   decode worker) from the later ones.

2. **Path latency** (``path_latency``): the four fields of ``ampd.sim.PathLatency``, read from the
   timestamps the live system records for every round (``RoundTiming``, written by the decode
   worker: ``input_ready`` = the coordinator accepting the session for round 0, the sidecar's tool
   result for later rounds; ``first_token``; token times), with server-side tools as ``ampd bench``
   replays them. The same trace is simulated with no path latency; per round,
   ``residual = live TTFT - simulated TTFT`` is what the live path adds to what the simulator
   models (prefill, KV transfer, waiting for a decode step boundary, queueing). Sessions are spaced
   so that rounds do not queue behind each other; tool times are random. Two policies: ``local``
   (every prefill on the decode worker) and ``remote`` (every prefill on the prefill worker).

   Scenarios:

   - ``zero_idle``: profile ``zero@none``, nothing else running: the bare path, for reference. It
     overstates ``handoff`` for the fidelity runs: with zero modelled transfer time the real NIXL
     history read shows up whole, while at real costs the mock engine paces the read from its start
     (``pace_transfer``), so the modelled ``T_kv`` covers it.
   - ``fidelity_idle``: the fidelity deployment's profile (qwen3-32b@h20, TP 1), nothing else
     running. The decode worker is idle when a round's input is ready (its session left the batch),
     so a local prefill starts as soon as it is queued. From it:
     ``dispatch`` = median later-round residual under ``local`` (input ready -> event to the
     coordinator -> route -> LocalPrefill -> the decode worker's queue -> its loop starts it);
     ``handoff`` = median later-round residual under ``remote`` minus ``dispatch`` (Submit instead
     of LocalPrefill, the prefill worker's loop, the NIXL write-back, the notification the decode
     worker polls every 0.2 ms while it waits, the KV check); ``open`` = median round-0 residual minus median
     later-round residual, mean of both policies (bind view, session record, Attach, the decode
     worker opening the session).
   - ``fidelity_busy``: the same with ``BACKGROUND`` sessions decoding throughout, so the decode
     worker's loop and the box's CPU carry a busy batch's per-token work (every token goes to the
     coordinator and on to the client) as in benchmarks/fidelity.py. A local prefill now waits for
     the running step to end, live and simulated, so a local round's residual is quantised by the
     step grid (mostly 0 or about one step: its median says nothing, its mean over random phases
     is noisy); a remote round's first token is not tied to the grid. So the busy batch's extra
     cost is read from ``remote``: ``busy_extra`` = median later-round residual (busy) minus
     (idle), added to ``dispatch``; the local mean is recorded as a cross-check. ``tool`` = median
     of ``next input_ready - last token - tool_s`` here (the tool-call event, the sidecar RPC, the
     result back on the busy decode worker's loop). ``step`` = median over the background sessions
     under ``remote`` (no local prefill stops their batch) of their mean token gap, live minus
     simulated: how much longer than modelled a busy decode worker's step takes (the local run's
     value is recorded as a cross-check).

Writes benchmarks/results/live_overhead.json. ``make bench`` (or ``make bench BENCH=live_overhead``).
"""
from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import uvloop

from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.perf import load_profile
from ampd.sim import simulate
from ampd.workload import Round, Session

RESULTS = Path(__file__).parent / "results"
FIDELITY_PROFILE = "qwen3-32b@h20"  # benchmarks/fidelity.py's deployment (TP 1)
BACKGROUND = 4  # sessions decoding in the background in the loaded scenario


def sessions(n: int, rounds: int, l_hist_growth: int = 512) -> list[Session]:
    rs = tuple(Round(input=l_hist_growth, output=4, tool_s=0.0) for _ in range(rounds - 1)) + (
        Round(input=l_hist_growth, output=4),)
    return [Session(id=f"lat-{i:04d}", arrival=0.0, rounds=rs) for i in range(n)]


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far, from /proc."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def measure(address: str, n: int, rounds: int) -> list[float]:
    lat: list[float] = []
    for s in sessions(n, rounds):  # one at a time: latency, not queueing
        _, stats, _, _ = await replay(address, [s], client_tools=True, progress=False)
        assert not stats.errors, stats.errors
        assert len(stats.client_latency) == rounds, stats.client_latency
        lat.extend(stats.client_latency)
    return lat


def summary(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e3
    return {"samples": len(xs), "p50_ms": round(float(np.percentile(a, 50)), 3),
            "p90_ms": round(float(np.percentile(a, 90)), 3), "p99_ms": round(float(np.percentile(a, 99)), 3),
            "mean_ms": round(float(a.mean()), 3)}


# ------------------------------------------------------------------------------- path latency
def path_trace(n: int, rounds: int, *, spacing: float, l_incr: int, output: int, tool_s: tuple[float, float],
               start: float = 0.0, background: int = 0, background_output: int = 0,
               seed: int = 7) -> list[Session]:
    """``n`` measured sessions ``spacing`` s apart (each over before the next arrives), tool times
    uniform in ``tool_s``; plus ``background`` one-round sessions at t=0 decoding
    ``background_output`` tokens."""
    rng = random.Random(seed)
    out = [Session(id=f"bg-{i}", arrival=0.0, rounds=(Round(input=64, output=background_output),))
           for i in range(background)]
    for i in range(n):
        rs = tuple(Round(input=l_incr, output=output, tool_s=round(rng.uniform(*tool_s), 4))
                   for _ in range(rounds - 1)) + (Round(input=l_incr, output=output),)
        out.append(Session(id=f"path-{i:03d}", arrival=start + i * spacing, rounds=rs))
    return out


def residuals(trace: list[Session], live_records, sim) -> dict[str, list[float]]:
    """Per measured round: live TTFT - simulated TTFT (round 0 and later rounds apart), and the
    live tool gap (next input ready - last token - tool_s)."""
    sim_rounds = {(s.session_id, r.round): r for s in sim.sessions for r in s.rounds}
    by_id = {s.id: s for s in trace}
    out: dict[str, list[float]] = {"round0": [], "later": [], "tool": [], "step": []}
    for rec in live_records:
        if rec.session_id.startswith("bg-"):  # one long round decoding throughout: its mean step, live - sim
            (r,) = rec.rounds
            s = sim_rounds[(rec.session_id, 0)]
            if s.n_tokens > 1:
                out["step"].append((r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
                                   - (s.last_token - s.first_token) / (s.n_tokens - 1))
            continue
        if not rec.session_id.startswith("path-"):
            continue
        assert rec.completed, rec.error
        sess = by_id[rec.session_id]
        for i, r in enumerate(rec.rounds):
            s = sim_rounds[(rec.session_id, r.round)]
            assert bool(r.local) == bool(s.local), (rec.session_id, r.round, r.local, s.local)
            res = (r.first_token - r.input_ready) - (s.first_token - s.input_ready)
            out["round0" if r.round == 0 else "later"].append(res)
            if i + 1 < len(rec.rounds):
                out["tool"].append(rec.rounds[i + 1].input_ready - r.token_times[-1]
                                   - (sess.rounds[r.round].tool_s or 0.0))
    return out


def live_and_sim(profile: str, policy: str, trace: list[Session], namespace: str):
    """(live records, SimResult, 1-minute load before/after) of ``trace`` on 1P+1D at TP 1: replayed
    on a fresh live deployment (after warming NIXL connections and channels) and simulated without
    a path latency."""
    opts = Options(prefill="tp1*1", decode="tp1*1", profile=profile, policy=policy, namespace=namespace)
    load_before = os.getloadavg()[0]
    with Deployment(opts) as dep:
        asyncio.run(measure(dep.coordinator, 3, 2))
        records, stats, _, _ = asyncio.run(replay(dep.coordinator, trace, progress=False, timeout_s=600))
    assert not stats.errors, stats.errors[:3]
    sim = simulate(trace, load_profile(profile), policy=policy, prefill="tp1*1", decode="tp1*1", ttft_slo_s=1.0)
    return records, sim, {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}


def run_path_scenario(profile: str, policy: str, trace: list[Session], log) -> dict:
    records, sim, load = live_and_sim(profile, policy, trace, f"overhead-{policy}")
    res = residuals(trace, records, sim)
    out = {k: summary(v) for k, v in res.items() if v}
    out["loadavg_1m"] = load
    out["_raw"] = res
    log(f"  {profile} {policy}: " + "; ".join(f"{k} p50 {out[k]['p50_ms']:.1f} mean {out[k]['mean_ms']:.1f} "
                                              f"p90 {out[k]['p90_ms']:.1f} ms"
                                              for k in ("round0", "later", "tool", "step") if k in out)
        + f"; load {out['loadavg_1m']}")
    return out


SCENARIOS = {
    "zero_idle": dict(profile="zero@none", n=40, rounds=5, spacing=0.6, l_incr=512, output=4,
                      tool_s=(0.02, 0.06), background=0),
    "fidelity_idle": dict(profile=FIDELITY_PROFILE, n=30, rounds=4, spacing=2.5, l_incr=256, output=8,
                          tool_s=(0.05, 0.3), background=0),
    "fidelity_busy": dict(profile=FIDELITY_PROFILE, n=30, rounds=4, spacing=2.5, l_incr=256, output=8,
                          tool_s=(0.05, 0.3), background=BACKGROUND),
}


def _med(xs) -> float:
    return float(np.median(xs))


def derive(sc: dict) -> dict:
    """PathLatency (seconds) from the raw residuals of the three scenarios (module docstring)."""
    idle, busy = sc["fidelity_idle"], sc["fidelity_busy"]
    dispatch_idle = _med(idle["local"]["later"])
    handoff = _med(idle["remote"]["later"]) - dispatch_idle
    open_ = float(np.mean([_med(idle[p]["round0"]) - _med(idle[p]["later"]) for p in ("local", "remote")]))
    busy_extra = _med(busy["remote"]["later"]) - _med(idle["remote"]["later"])
    dispatch = dispatch_idle + max(0.0, busy_extra)
    tool = _med(busy["local"]["tool"] + busy["remote"]["tool"])
    step = _med(busy["remote"]["step"])
    r4 = lambda x: round(x, 4)  # noqa: E731
    return {"open_s": r4(max(0.0, open_)), "dispatch_s": r4(max(0.0, dispatch)),
            "handoff_s": r4(max(0.0, handoff)), "tool_s": r4(max(0.0, tool)),
            "step_s": round(max(0.0, step), 5),
            "parts_s": {"step_local (cross-check of step)": round(_med(busy["local"]["step"]), 5),
                        "dispatch_idle": r4(dispatch_idle), "busy_extra": r4(busy_extra),
                        "busy_local_later_mean (cross-check of dispatch)": r4(float(np.mean(busy["local"]["later"]))),
                        "tool_idle": r4(_med(idle["local"]["tool"] + idle["remote"]["tool"])),
                        "zero_idle_dispatch": r4(_med(sc["zero_idle"]["local"]["later"])),
                        "zero_idle_remote_later": r4(_med(sc["zero_idle"]["remote"]["later"]))}}


def measure_path(log, scenarios=SCENARIOS) -> tuple[dict, dict]:
    """(per-scenario summaries, raw residuals in seconds)."""
    out, raw = {}, {}
    for name, sc in scenarios.items():
        start = 1.0 if sc["background"] else 0.0
        bg_out = 0
        if sc["background"]:
            # Background tokens: enough to decode through the whole measurement, not much longer.
            span = start + sc["n"] * sc["spacing"] + 1.0
            bg_out = int(span / load_profile(sc["profile"]).t_dec(1, sc["background"], sc["background"] * 1000))
        trace = path_trace(sc["n"], sc["rounds"], spacing=sc["spacing"], l_incr=sc["l_incr"],
                           output=sc["output"], tool_s=sc["tool_s"], start=start,
                           background=sc["background"], background_output=bg_out)
        log(f"path latency, scenario {name}:")
        per_policy = {p: run_path_scenario(sc["profile"], p, trace, log) for p in ("local", "remote")}
        raw[name] = {p: d.pop("_raw") for p, d in per_policy.items()}
        out[name] = {"setup": {k: (list(v) if isinstance(v, tuple) else v) for k, v in sc.items()},
                     "residual_ms": per_policy}
    return out, raw


def burst_trace(n: int, profile: str, gap_s: float = 0.025, seed: int = 11) -> list[Session]:
    """``n`` two-round sessions whose rounds reach the prefill worker in two bursts, ``gap_s``
    apart within a burst (far faster than the worker serves them): round 0 at ``gap_s * i`` (no
    history), round 1 one second after the simulated end of the first burst (tool times set from a
    simulation of round 0). Input sizes are random (128-1024 tokens), so the mock's timer slack,
    which depends on the fraction of a millisecond of each modelled time, averages out as in a
    real trace. Round 0 has one output token, so it ends at its first token, not at a decode step
    boundary: live, round 1 becomes ready late by round 0's own lag, which grows with ``i``, so
    the second burst keeps its order."""
    rng = random.Random(seed)
    sizes = [(rng.randint(128, 1024), rng.randint(128, 1024)) for _ in range(n)]
    first = [Session(id=f"burst-{i:03d}", arrival=gap_s * i, rounds=(Round(input=sizes[i][0], output=1),))
             for i in range(n)]
    sim = simulate(first, load_profile(profile), policy="remote", prefill="tp1*1", decode="tp1*1",
                   ttft_slo_s=1.0)
    end0 = {s.session_id: s.rounds[0].last_token for s in sim.sessions}
    t1 = max(end0.values()) + 1.0
    return [Session(id=s.id, arrival=s.arrival,
                    rounds=(Round(input=sizes[i][0], output=1, tool_s=round(t1 + gap_s * i - end0[s.id], 6)),
                            Round(input=sizes[i][1], output=1)))
            for i, s in enumerate(first)]


def measure_prefill_busy(log, n: int = 30, profile: str = FIDELITY_PROFILE) -> dict:
    """Extra time a prefill occupies the prefill worker live, beyond its modelled history read +
    compute + write-back: in a burst the worker runs the tasks back to back, so the k-th task's
    first token is late (live vs simulated, relative to the burst's first) by k times that extra.
    The simulator models it as ``PathLatency.prefill_busy`` (``handoff`` does not occupy the worker)."""
    records, sim, load = live_and_sim(profile, "remote", burst_trace(n, profile), "overhead-burst")
    simft = {(s.session_id, r.round): r.first_token for s in sim.sessions for r in s.rounds}
    liveft = {(rec.session_id, r.round): r.first_token for rec in records for r in rec.rounds}
    out = {"sessions": n, "loadavg_1m": load}
    for rnd, name in ((0, "no_history"), (1, "with_history")):
        keys = sorted((k for k in simft if k[1] == rnd), key=simft.get)
        same_order = keys == sorted(keys, key=liveft.get)
        lag = np.array([(liveft[k] - liveft[keys[0]]) - (simft[k] - simft[keys[0]]) for k in keys])
        slope, icpt = np.polyfit(np.arange(len(keys)), lag, 1)
        out[name] = {"extra_per_task_ms": round(float(slope) * 1e3, 3), "fit_intercept_ms": round(float(icpt) * 1e3, 2),
                     "last_task_lag_ms": round(float(lag[-1]) * 1e3, 1), "same_order_live_and_sim": same_order}
        log(f"prefill worker busy per task beyond the model ({name}): {out[name]}")
    return out


def main(n: int = 60, rounds: int = 5, paths_only: bool = False) -> dict:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    out = {"command": "python -m benchmarks.live_overhead (make bench BENCH=live_overhead)", "profile": "zero@none",
           "machine": f"{platform.machine()} {platform.python_version()}", "when": time.strftime("%Y-%m-%d %H:%M:%S"),
           "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
           "sessions": n, "rounds_per_session": rounds, "paths": {}}
    for policy in ("remote", "local"):
        opts = Options(prefill="tp1*1", decode="tp1*1", profile="zero@none", policy=policy)
        with Deployment(opts) as dep:
            asyncio.run(measure(dep.coordinator, 3, 2))  # warm NIXL connections and channels
            # CPU per round of every process on the path: on a shared box it shows what the path
            # costs whatever the load does to the latency.
            procs = {c.name: c.proc.pid for c in dep.children if not c.name.startswith("sidecar")}
            before = {k: cpu_s(p) for k, p in procs.items()} | {"client": sum(os.times()[:2])}
            load = os.getloadavg()[0]
            # the client on uvloop, as `ampd bench` runs it (ampd/bench/client.py)
            lat = uvloop.run(measure(dep.coordinator, n, rounds))
            after = {k: cpu_s(p) for k, p in procs.items()} | {"client": sum(os.times()[:2])}
        out["paths"][policy] = summary(lat)
        # A session's first round (its open: admission, binding, two new streams) apart from the
        # rest: the opens are a fifth of the samples and hold most of the tail.
        a = np.asarray(lat)  # sessions one at a time, every round measured, in order
        out["paths"][policy]["by_round"] = {"open": summary(a[::rounds]),
                                            "later": summary(np.delete(a, np.s_[::rounds]))}
        out["paths"][policy]["cpu_ms_per_round"] = {k: round((after[k] - before[k]) * 1e3 / len(lat), 2)
                                                    for k in before}
        out["paths"][policy]["loadavg_1m"] = {"before": round(load, 2), "after": round(os.getloadavg()[0], 2)}
        log(f"{policy:>7}: per-round added latency {out['paths'][policy]}")
    if paths_only:  # a quick look at the client latency; the results file is left alone
        return out
    scenarios, raw = measure_path(log)
    est = derive(raw)
    out["prefill_busy_extra"] = {
        **measure_prefill_busy(log),
        "method": "policy remote, qwen3-32b@h20 TP 1: 30 sessions (inputs 128-1024 tokens) whose round 0 "
                  "(no history) and round 1 (with history) reach the prefill worker in two bursts, 25 ms "
                  "apart within a burst; per burst, "
                  "slope over queue position of (live first token - the burst's first) - (simulated, "
                  "the same). The prefill worker runs the burst back to back, so the slope is the time "
                  "each task holds the worker beyond the modelled read + compute + write-back (timer "
                  "slack of the mock's sleeps, the NIXL write and its completion poll, the loop). "
                  "The simulator models it as PathLatency.prefill_busy (the mean of both slopes in "
                  "benchmarks/fidelity.py): see docs/fidelity.md.",
    }
    log(f"PathLatency: {est}")
    out["path_latency"] = {
        **est,
        "method": "per round, residual = live TTFT - simulated TTFT (no path latency), from the live "
                  "RoundTiming (decode worker clock); sessions spaced so that nothing queues. "
                  "fidelity_idle (qwen3-32b@h20 TP 1): dispatch = median later-round residual under "
                  "policy local; handoff = median later-round residual under remote - dispatch; open = "
                  "median round-0 minus median later-round residual (mean of local, remote). "
                  "fidelity_busy (4 sessions decoding throughout): busy_extra = median later-round "
                  "residual under remote, busy minus idle, added to dispatch; tool = median(next "
                  "input_ready - last token - tool_s); step = median over the background sessions "
                  "under remote of (live - simulated) mean token gap. See the module docstring.",
    }
    out["path_scenarios"] = scenarios
    out["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "live_overhead.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="What the live path adds per round (see the module docstring).")
    ap.add_argument("--sessions", type=int, default=60, help="sessions per policy for the client latency")
    ap.add_argument("--paths-only", action="store_true",
                    help="only the client latency (remote, local); print it, write no results file")
    a = ap.parse_args()
    main(a.sessions, paths_only=a.paths_only)
