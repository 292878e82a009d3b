"""Coordinator capacity: the rounds per second one coordinator routes before its added latency
doubles, and two coordinators sharing one Redis (`ampd up --coordinators 2`).

A mock deployment on the zero-cost profile (``zero@none``: every modelled cost is 0, so a round's
TTFT is the live path itself: the decode worker's prefill_task, the coordinator's route decision,
its route back to the decode worker (local_prefill, or remote_prefill: the decode worker submits the
task to the prefill worker), the first token back through the coordinator), ``PREFILL`` prefill and
``DECODE`` decode workers. Load: sessions of ``ROUNDS`` rounds (``INPUT`` new tokens, ``OUTPUT``
output tokens each), their tool calls on the decode workers' sidecars taking ``TOOL_S`` each, so a
session makes about 1/``TOOL_S`` rounds a second; for a target rate X, X*``TOOL_S`` sessions run at
once (arrivals spread over ``TOOL_S``). Every round but the first is an incremental prefill that the
coordinator routes (the first goes with the open, routed ahead).

On this shared 2-core box the latency knee is where the box runs out of CPU (every service, the
client and other work share it), not where a coordinator does; so each point also records the CPU
seconds each coordinator process and Redis used per round routed (/proc/PID/stat), and
``cpu_capacity_rounds_per_s`` = 1 / (a coordinator's CPU seconds per round): the rate one coordinator
could route on one core of its own, and the two coordinators' sum with Redis's CPU per round as the
shared bound.

At each target rate: the achieved rate (rounds that completed over the span they took) and the P50
and P99 of the rounds' TTFT (server clocks: input ready to first token). The baseline is the P99 at
the lowest rate; the capacity is the highest achieved rate whose P99 stays within twice it (and
which reached at least ``REACH`` of its target). One coordinator and two coordinators are measured
in the same run, both deployments up, taking turns at each rate (each point twice, the lower P99
counting), with the load average beside each point.

A coordinator's CPU per round falls as its own rate rises (more events per wake-up of its loop), so
the CPU comparison of one and two is made at the same load per coordinator (``matched``: one at R
rounds/s, two at 2R), each coordinator's CPU split by thread (its event loop's, grpc.aio's poller's)
and into user and kernel time (/proc/PID/task).

Then the coordinator at the highest rate it was measured at is profiled with py-spy (``PROFILE_S`` seconds,
``--gil``: only samples of a thread holding the GIL, so its waits in the event loop's poll are not
counted as work): the functions with the most samples go to ``profile`` in the results, where its
Python-side CPU goes.

Writes benchmarks/results/coordinator_capacity.json (``make bench BENCH=coordinator_capacity``).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.workload import Round, Session

RESULTS = Path(__file__).parent / "results"
PREFILL, DECODE = "tp1*2", "tp1*2"
ROUNDS, INPUT, OUTPUT, TOOL_S = 24, 32, 2, 0.5  # a point runs ~12 s: its P99 is of >= 600 rounds
RATES = (50, 100, 200, 400, 800, 1600, 2400)  # target rounds per second
REACH = 0.8  # a point counts only if it achieved this share of its target rate
GOAL_ONE, GOAL_RATIO = 2000.0, 1.8
PROFILE_S = 8.0
READING = (
    "capacity_rounds_per_s: the latency criterion (P99 TTFT within twice the lowest rate's). On this 2-core box "
    "every service of the deployment, the client and Redis share two cores (loadavg_1m: mostly the deployment "
    "itself), so the knee is where the box runs out of CPU, ~200 rounds/s in all, with the coordinator using a "
    "fraction of one core; it is the same for one and two coordinators. cpu_capacity_rounds_per_s: 1 / (a "
    "coordinator's CPU seconds per round it routes): what one coordinator routes on a core of its own. "
    "matched: the CPU comparison at the same load per coordinator (one at R rounds/s, two at 2R), with each "
    "coordinator's CPU per round by thread and user/kernel (/proc/PID/task); cpu_capacity_two_over_one is its "
    "last entry's: twice two's per-coordinator rate over one's (each of two also follows every worker's "
    "statistics, which grow with the total rate). redis_cpu_capacity_rounds_per_s bounds any number of "
    "coordinators. profile.where_time_goes: py-spy's samples of the one coordinator at the highest rate "
    "measured, by category, taken only while a thread holds the GIL (py-spy --gil): the Python-side CPU, waits "
    "left out (the event loop category is the C work called from the loop: uvloop, and grpc's server-side "
    "reads and writes). A round through the coordinator is six gRPC messages (the decode worker's "
    "prefill_task, first tokens and round end in; its route to the decode worker, unanswered, out; two "
    "SessionEvents to the client: the first tokens, then the rest with round_end and tool_call) and about "
    "three statistics publications on the Redis channel.")
REPEAT = 2
# a coordinator's threads, as its CPU is split (thread_cpu_s)
THREAD_ROLES = ("main thread (event loop)", "grpc event_engine threads", "other threads (grpc.aio poller)")
MATCHED = (50, 100)  # rounds/s per coordinator compared (this box runs ~200 rounds/s in all: two at 2x100)


def sessions_for(rate: float, tag: str) -> list[Session]:
    n = max(1, round(rate * TOOL_S))
    rounds = tuple(Round(INPUT, OUTPUT, TOOL_S if i < ROUNDS - 1 else None) for i in range(ROUNDS))
    return [Session(f"{tag}-{i}", TOOL_S * i / n, rounds) for i in range(n)]


def _user_sys(stat: Path) -> tuple[float, float]:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    return sum(_user_sys(Path(f"/proc/{pid}/stat")))


def thread_cpu_s(pid: int) -> dict[str, tuple[float, float]]:
    """(user, system) CPU seconds so far of process ``pid``'s threads, by role: its main thread
    (the event loop and everything the loop calls), grpc's C++ ``event_engine`` threads, and the
    rest (grpc.aio's completion-queue poller, a Python thread, and any other)."""
    out: dict[str, tuple[float, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            user, system = _user_sys(task / "stat")
        except OSError:  # (a thread that ended meanwhile)
            continue
        role = THREAD_ROLES[0] if task.name == str(pid) else \
            THREAD_ROLES[1] if comm.startswith("event_engine") else THREAD_ROLES[2]
        u, s = out.get(role, (0.0, 0.0))
        out[role] = (u + user, s + system)
    return out


def point(target: str, rate: float, tag: str, pids: dict[str, int] | None = None) -> dict:
    load0 = os.getloadavg()[0]
    pids = pids or {}
    cpu0 = {k: cpu_s(p) for k, p in pids.items()}
    coords = {k: p for k, p in pids.items() if k.startswith("coordinator")}
    threads0 = {k: thread_cpu_s(p) for k, p in coords.items()}
    records, stats, wall, _ = asyncio.run(replay(target, sessions_for(rate, tag), progress=False, timeout_s=120))
    cpu = {k: cpu_s(p) - cpu0[k] for k, p in pids.items()}
    threads = {k: thread_cpu_s(p) for k, p in coords.items()}
    ttft, first, last = [], float("inf"), 0.0
    for rec in records:
        for r in rec.rounds:
            if r.first_token is None:
                continue
            ttft.append(r.first_token - r.input_ready)
            first, last = min(first, r.input_ready), max(last, r.first_token)
    done = sum(1 for r in records if r.completed)
    achieved = len(ttft) / (last - first) if ttft and last > first else 0.0
    out = {"target_rounds_per_s": rate, "achieved_rounds_per_s": round(achieved, 1), "rounds": len(ttft),
           "sessions": len(records), "sessions_completed": done, "errors": stats.errors[:3],
           "ttft_p50_ms": round(float(np.percentile(ttft, 50)) * 1e3, 2) if ttft else None,
           "ttft_p99_ms": round(float(np.percentile(ttft, 99)) * 1e3, 2) if ttft else None,
           "wall_s": round(wall, 1), "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    if ttft:
        out["cpu_ms_per_round"] = {k: round(v / len(ttft) * 1e3, 3) for k, v in cpu.items()}
        # the coordinators share the rounds: each one's CPU per round it routed is their CPU summed per
        # round, and 1 / that the rounds one would route on one core of its own
        spent = sum(cpu[k] for k in coords)
        if spent:
            out["coordinator_ms_per_own_round"] = round(spent / len(ttft) * 1e3, 3)
            out["cpu_capacity_rounds_per_s"] = round(len(ttft) / spent, 1)
            out["coordinator_threads_ms_per_own_round"] = split_threads(threads0, threads, len(ttft))
    print(f"  {tag}: target {rate:g}/s achieved {out['achieved_rounds_per_s']}/s, P50 {out['ttft_p50_ms']} ms, "
          f"P99 {out['ttft_p99_ms']} ms, {done}/{len(records)} sessions, load {out['loadavg_1m']}, "
          f"cpu ms/round {out.get('cpu_ms_per_round')}",
          file=sys.stderr, flush=True)
    return out


def split_threads(before: dict, after: dict, rounds: float) -> dict[str, dict[str, float]]:
    """Every coordinator's CPU, summed, per round it routed, by thread role and user/kernel."""
    out: dict[str, dict[str, float]] = {}
    for k, roles in after.items():
        for role, (user, system) in roles.items():
            u0, s0 = before[k].get(role, (0.0, 0.0))
            acc = out.setdefault(role, {"user": 0.0, "kernel": 0.0})
            acc["user"] += (user - u0) / rounds * 1e3
            acc["kernel"] += (system - s0) / rounds * 1e3
    return {role: {k: round(v, 3) for k, v in acc.items()} for role, acc in out.items()}


def pids_of(dep: Deployment) -> dict[str, int]:
    return {c.name: c.proc.pid for c in dep.children if c.name.startswith("coordinator") or c.name == "redis"}


def within(p: dict) -> bool:
    """The point ran within the box's limit: it reached ``REACH`` of its target rate."""
    return p["achieved_rounds_per_s"] >= REACH * p["target_rounds_per_s"]


def sweep(deps: dict[int, Deployment], rates) -> dict[int, dict]:
    """Both deployments, rate by rate, taking turns (each point twice, its P99 the lower of the two),
    so that they see the same load on the box. A deployment's latency capacity is fixed at the first
    rate past it; its points go on to the box's limit (a rate not reached, or sessions not
    completed), for its CPU per round at the highest rate the box runs."""
    state = {n: {"points": [], "base": None, "capacity": 0.0, "past": False, "done": False} for n in deps}
    for rate in rates:
        for rep in range(REPEAT):
            for n, dep in deps.items():
                if not state[n]["done"]:
                    state[n]["points"].append(point(dep.coordinator, rate, f"c{n}-{rate:g}-{rep}", pids_of(dep)))
        for n, st in state.items():
            if st["done"]:
                continue
            tries = [p for p in st["points"] if p["target_rounds_per_s"] == rate]
            p99 = min((p["ttft_p99_ms"] for p in tries if p["ttft_p99_ms"] is not None), default=None)
            complete = all(p["sessions_completed"] == p["sessions"] for p in tries)
            if p99 is None or not complete or not any(within(p) for p in tries):
                st["done"] = True  # the box's limit: a higher rate only queues more
                continue
            if st["base"] is None:
                st["base"] = p99
            if p99 > 2 * st["base"]:
                st["past"] = True  # past its latency capacity
            if not st["past"]:
                st["capacity"] = max(st["capacity"], *(p["achieved_rounds_per_s"] for p in tries))
        if all(st["done"] for st in state.values()):
            break
    return {n: {"baseline_p99_ms": st["base"], "capacity_rounds_per_s": st["capacity"], "points": st["points"]}
            for n, st in state.items()}


def matched(deps: dict[int, Deployment], rates) -> tuple[list[dict], dict[int, list[dict]]]:
    """The CPU comparison at the same load per coordinator: one coordinator at R rounds/s against
    two at 2R (each routing about R), taking turns, ``REPEAT`` times each (the less disturbed try,
    the lower CPU a round, counting): a coordinator's CPU a round falls as its rate rises (more
    events per wake-up), so two at the same total rate as one would each look dearer."""
    pts: dict[int, list[dict]] = {n: [] for n in deps}
    out = []
    for rate in rates:
        tries: dict[int, list[dict]] = {n: [] for n in deps}
        for rep in range(REPEAT):
            for n, dep in deps.items():
                tries[n].append(point(dep.coordinator, rate * n, f"m{n}-{rate * n:g}-{rep}", pids_of(dep)))
        best = {}
        for n, ps in tries.items():
            pts[n] += ps
            measured = [p for p in ps if p.get("coordinator_ms_per_own_round")]
            if measured:
                best[n] = min(measured, key=lambda p: p["coordinator_ms_per_own_round"])
        if len(best) < 2:
            continue
        one, two = best[1]["coordinator_ms_per_own_round"], best[2]["coordinator_ms_per_own_round"]
        out.append({"rounds_per_coordinator_per_s": rate,
                    "achieved_per_coordinator": {n: round(p["achieved_rounds_per_s"] / n, 1) for n, p in best.items()},
                    "one_ms_per_round": one, "two_ms_per_own_round": two,
                    "redis_ms_per_round": {n: p["cpu_ms_per_round"].get("redis") for n, p in best.items()},
                    "threads_ms_per_own_round": {n: p["coordinator_threads_ms_per_own_round"] for n, p in best.items()},
                    "two_over_one": round(2 * one / two, 2)})
    return out, pts


# Where a sample's time goes, by the first of these found in its stack (leaf first): what it is
# named in the results, and the frame names that mark it.
CATEGORIES = (
    ("stats channel (following every worker's publications)", ("Cluster._follow", "_ingest")),
    ("Redis commands (records, promises, liveness polls)", ("execute_command", "Retry.call_with_retry",
                                                            "Promises.", "StateStore.")),
    ("gRPC message reads and writes (grpc.aio, per message)", ("_call.py", "_interceptor.py", "CallStream.",
                                                               "_base_call", "_server.py")),
    ("route decisions (cluster view, Algorithm 1)", ("_decide", "route (", "ClusterView", "Cluster.view",
                                                     "Cluster.routed", "_assemble")),
    ("session logic (events, log, forwarding)", ("SessionRun.", "CoordinatorService.", "SessionLog.",
                                                 "merge_tokens", "Admission.")),
    ("logging", ("structlog", "logs.py")),
)
THREAD = "gRPC core (its poller thread: HTTP/2 framing and socket I/O)"


def classify(frames: list[str]) -> str:
    if frames and frames[0].startswith("Thread._bootstrap"):
        return THREAD
    for f in reversed(frames):
        for name, marks in CATEGORIES:
            if any(m in f for m in marks):
                return name
    return "event loop and other (uvloop, asyncio, grpc's C parts called from the loop)"


def profile(dep: Deployment, rate: float, pid: int) -> dict:
    """py-spy's samples of the coordinator while ``rate`` rounds/s run through it: the functions
    it spends the most samples in (own time) and the stacks above them."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return {"error": "py-spy is not installed"}
    raw = Path(tempfile.mkdtemp()) / "coordinator.txt"
    proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(PROFILE_S)), "--format", "raw",
                             "--output", str(raw), "--nonblocking", "--gil", "--rate", "200"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        point(dep.coordinator, rate, f"profile-{rate:g}")
    finally:
        _, err = proc.communicate(timeout=60)
    if not raw.exists():
        return {"error": f"py-spy wrote nothing: {err.decode(errors='replace')[-400:]}"}
    return summarize(raw, rate)


def summarize(raw: Path, rate: float) -> dict:
    """py-spy's raw samples (``--format raw``) by category, and the top functions."""
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    where: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 2)[-1]
                  if " (" in f else f for f in stack.split(";")]
        own[frames[-1]] += n
        where[classify(frames)] += n
        for f in set(frames):
            inclusive[f] += n
    share = lambda c: [{"function": f, "share": round(n / total, 3)} for f, n in c.most_common(25)]  # noqa: E731
    return {"samples": total, "rate_rounds_per_s": rate,
            "where_time_goes": {k: round(n / total, 3) for k, n in where.most_common()},
            "own": share(own), "inclusive": share(inclusive)}


def deployment(coordinators: int, run_dir: str) -> Deployment:
    return Deployment(Options(prefill=PREFILL, decode=DECODE, profile="zero@none", policy="ampd",
                              coordinators=coordinators, ttft_slo=5.0, itl_slo=1.0, run_dir=run_dir,
                              namespace=f"capacity{coordinators}", admission_queue=4096))


def derive(out: dict) -> None:
    """The summary of a run's points (``out``, as main writes it): the capacities, the ratios and
    whether the goal is met."""
    out["reading"] = READING
    matched_points = {int(n): pts for n, pts in out["matched_points"].items()}  # (str keys once in JSON)
    for n, pts in matched_points.items():
        res = out[f"coordinators_{n}"]
        # CPU per round at the highest rate measured within the box's limit (the fixed costs spread
        # the thinnest; past the limit events queue, and a round costs less, for seconds of latency)
        res["cpu_capacity_rounds_per_s"] = max(
            (p["cpu_capacity_rounds_per_s"] for p in res["points"] + pts
             if p.get("cpu_capacity_rounds_per_s") and within(p)), default=None)
    one, two = out["coordinators_1"]["capacity_rounds_per_s"], out["coordinators_2"]["capacity_rounds_per_s"]
    out["two_over_one"] = round(two / one, 2) if one else None
    if out["matched"]:  # each of two coordinators routes at its own one-core rate: their sum, against one's,
        # at the highest load per coordinator compared
        out["cpu_capacity_two_over_one"] = out["matched"][-1]["two_over_one"]
    redis = [p["cpu_ms_per_round"]["redis"] for p in out["coordinators_2"]["points"] + matched_points[2]
             if p.get("cpu_ms_per_round", {}).get("redis") and within(p)]
    if redis:  # the shared Redis's one-core bound on the rounds of any number of coordinators (its best point)
        out["redis_cpu_capacity_rounds_per_s"] = round(1e3 / min(redis), 1)
    out["goal_met"] = {"one": one >= GOAL_ONE, "two_over_one": bool(one) and two / one >= GOAL_RATIO}
    c1 = out["coordinators_1"]["cpu_capacity_rounds_per_s"]
    out["goal_met_on_a_core_each"] = {"one": bool(c1) and c1 >= GOAL_ONE,
                                      "two_over_one": out.get("cpu_capacity_two_over_one", 0) >= GOAL_RATIO}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default=",".join(str(r) for r in RATES), help="target rounds/s, ascending")
    ap.add_argument("--matched", default=",".join(str(r) for r in MATCHED),
                    help="rounds/s per coordinator for the CPU comparison (one at R, two at 2R)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "coordinator_capacity.json"))
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    out: dict = {"command": "make bench BENCH=coordinator_capacity", "machine": platform.platform(),
                 "cpus": os.cpu_count(), "shape": {"prefill": PREFILL, "decode": DECODE, "profile": "zero@none",
                                                   "rounds": ROUNDS, "input": INPUT, "output": OUTPUT,
                                                   "tool_s": TOOL_S},
                 "goal": {"one_rounds_per_s": GOAL_ONE, "two_over_one": GOAL_RATIO}}
    with deployment(1, tempfile.mkdtemp(prefix="ampd-capacity1-")) as one, \
            deployment(2, tempfile.mkdtemp(prefix="ampd-capacity2-")) as two:
        deps = {1: one, 2: two}
        for n, dep in deps.items():
            print(f"{n} coordinator(s): {dep.coordinator}", file=sys.stderr, flush=True)
            point(dep.coordinator, rates[0], f"warmup{n}")
        for n, res in sweep(deps, rates).items():
            out[f"coordinators_{n}"] = res
        out["matched"], out["matched_points"] = matched(deps, [float(r) for r in args.matched.split(",")])
        if not args.no_profile:  # one coordinator at the highest rate the box ran
            top = max((p["target_rounds_per_s"] for p in out["coordinators_1"]["points"] if within(p)), default=rates[0])
            out["profile"] = profile(one, top, one.child("coordinator").proc.pid)
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    derive(out)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    c1, c2 = out["coordinators_1"], out["coordinators_2"]
    print(f"latency capacity: one coordinator {c1['capacity_rounds_per_s']:g} rounds/s, two "
          f"{c2['capacity_rounds_per_s']:g}; on a core of its own: one {c1['cpu_capacity_rounds_per_s']} rounds/s, "
          f"two {out.get('cpu_capacity_two_over_one')}x one; wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
