"""Simulator fingerprint: hashes of what a fixed set of small seeded runs produce.

    python -m benchmarks.sim_fingerprint [--json OUT] [--compare BASE.json] [-- simulate options]

Runs the simulator over 3 presets (toolbench, gaia, hotpotqa; small seeded ``ampd.workload`` traces)
x the policies ampd, ampd-noreorder, remote, local, threshold, colocated, continuum, plus a few runs
that exercise the less common paths (chunked local prefill, NIC contention, control-path latencies,
a KV-tight deployment). Per run it hashes (sha256 of the exact float reprs):

- ``rounds``: every round's input-ready, first-token and last-token time, token count and every
  token time, placement (local/remote) and the worker its prefill ran on;
- ``report``: the full ``ampd.bench.report`` of the run, without the simulator's statistics block;
- ``stats``: the simulator's statistics (wall-clock fields left out).

Two simulator versions behave the same on these runs when every hash matches; ``--compare`` prints
the runs whose hashes differ. ``--set KEY=VALUE`` passes an extra ``simulate`` keyword to every run
(for example ``--set kv_overlap=False``). The simulator runs on the compiled cores where they are
built (ampd/compiled.py; ``AMPD_COMPILED=0``: the Python sources); the first line says which.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from ampd import compiled

compiled.install()  # before a core is imported: the compiled cores where built (ampd/compiled.py)

from ampd.perf import load_profile, profile_from_dict  # noqa: E402
from ampd.policy import SLO  # noqa: E402
from ampd.sim import PathLatency, sim_report, simulate  # noqa: E402
from ampd.workload import generate  # noqa: E402
from benchmarks import write_json  # noqa: E402

PROFILE = "llama3.1-70b@h20"
PRESETS = {  # preset -> (rate sessions/s, duration s, TTFT SLO s, ITL SLO s)
    "toolbench": (1.2, 60.0, 2.0, 0.1),
    "gaia": (0.12, 200.0, 20.0, 0.15),
    "hotpotqa": (1.5, 60.0, 2.0, 0.1),
}
POLICIES = ("ampd", "ampd-noreorder", "remote", "local", "threshold", "colocated", "continuum")
COLOC = ("colocated", "continuum")
DISAGG = ("tp4*1", "tp4*1")  # prefill, decode
COLOC_DECODE = "tp4*2"
STATS_SKIP = ("wall_s", "sessions_per_s")


def _tight_profile(prof, tokens: int):
    """``prof`` with every TP degree's KV capacity cut to ``tokens`` (KV admission under pressure)."""
    d = prof.to_json()
    for t in d["tp"].values():
        t["kv_capacity_tokens"] = tokens
    d["name"] = prof.name + "-kv" + str(tokens)
    return profile_from_dict(d)


def runs() -> list[dict]:
    out = []
    for preset in PRESETS:
        for pol in POLICIES:
            pre, dec = ("none", COLOC_DECODE) if pol in COLOC else DISAGG
            out.append({"name": f"{preset}/{pol}", "preset": preset, "policy": pol, "prefill": pre, "decode": dec})
    g = {"preset": "gaia", "prefill": DISAGG[0], "decode": DISAGG[1]}
    out += [
        {**g, "name": "gaia/ampd+chunked", "policy": "ampd", "opts": {"chunked_prefill": True}},
        {**g, "name": "gaia/local+chunked", "policy": "local", "opts": {"chunked_prefill": True}},
        {**g, "name": "gaia/ampd+contention", "policy": "ampd", "opts": {"kv_contention": True}},
        {**g, "name": "gaia/remote+contention", "policy": "remote", "opts": {"kv_contention": True}},
        {**g, "name": "gaia/ampd+path", "policy": "ampd",
         "path": "open=0.01,dispatch=0.004,handoff=0.002,tool=0.003,prefill_busy=0.005"},
        {**g, "name": "gaia/ampd-window", "policy": "ampd", "opts": {"slack": "window"}},
        {**g, "name": "gaia/ampd+kvtight", "policy": "ampd", "kv": 200_000},
        {**g, "name": "gaia/remote+kvtight", "policy": "remote", "kv": 200_000},
        {"preset": "gaia", "prefill": "none", "decode": COLOC_DECODE, "name": "gaia/continuum+kvtight",
         "policy": "continuum", "kv": 200_000},
        {"preset": "gaia", "prefill": "none", "decode": COLOC_DECODE, "name": "gaia/colocated+kvtight",
         "policy": "colocated", "kv": 200_000},
        # benchmarks/sim_speed.py's deployment and load (32 GPUs, 0.04 sessions/s, SLO 5 s / 100 ms)
        # on ~1000 sessions: the one run here whose routing read a stale cached view before the
        # worker cores' fix (a view reused after its service's residual time had passed)
        {"preset": "gaia", "prefill": "tp8*2", "decode": "tp8*2", "name": "gaia/ampd+speed32", "policy": "ampd",
         "load": (0.04, 25_000.0, 5.0, 0.1)},
    ]
    return out


def _h(obj) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


def fingerprint(run: dict, prof, extra: dict) -> dict:
    rate, dur, ttft, itl = run.get("load") or PRESETS[run["preset"]]
    sessions = generate(run["preset"], rate, dur, 7)
    if run.get("kv"):
        prof = _tight_profile(prof, run["kv"])
    opts = {**(run.get("opts") or {}), **extra}
    t0 = time.perf_counter()
    res = simulate(sessions, prof, policy=run["policy"], prefill=run["prefill"], decode=run["decode"],
                   ttft_slo_s=ttft, itl_slo_s=itl, seed=3, path=PathLatency.parse(run.get("path", "")), **opts)
    wall = time.perf_counter() - t0
    rounds = []
    for s in res.sessions:
        for r in s.rounds:
            rounds.append((s.session_id, s.decode_worker, s.completed, r.round, r.input_ready, r.first_token,
                           r.last_token, r.n_tokens, r.local, r.target, res.token_times(r)))
    rep = sim_report(res, SLO(ttft, itl))
    stats = {k: v for k, v in rep.pop("simulation").items() if k not in STATS_SKIP}
    return {"rounds": _h(rounds), "report": _h(json.dumps(rep, sort_keys=True)),
            "stats": _h(json.dumps(stats, sort_keys=True, default=repr)),
            "summary": {"sessions": rep["sessions"], "completed": rep["completed"],
                        "slo_attainment": rep["slo_attainment"], "local_fraction": rep["local_fraction"],
                        "kv_overcommits": stats.get("kv_overcommits"), "kv_evictions": stats.get("kv_evictions")},
            "wall_s": round(wall, 3)}


def _value(text: str):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the fingerprints here")
    ap.add_argument("--compare", help="a fingerprint JSON to compare against (exit 1 on any difference)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra simulate() keyword for every run")
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    a = ap.parse_args(argv)
    print(f"cores: {compiled.STATE}", flush=True)
    extra = {}
    for kv in a.set:
        k, sep, v = kv.partition("=")
        if not sep:
            ap.error(f"--set {kv!r}: expected KEY=VALUE")
        extra[k] = _value(v)
    prof = load_profile(PROFILE)
    only = {x for x in a.only.split(",") if x}
    out = {"command": "python -m benchmarks.sim_fingerprint " + " ".join(argv if argv is not None else sys.argv[1:]),
           "profile": PROFILE, "presets": PRESETS, "runs": {}}
    for run in runs():
        if only and run["name"] not in only:
            continue
        fp = fingerprint(run, prof, extra)
        out["runs"][run["name"]] = fp
        print(f"{run['name']:28s} {fp['rounds']} {fp['report']} {fp['stats']}  {fp['summary']}", flush=True)
    if a.json:
        write_json(a.json, out)
    if a.compare:
        with open(a.compare) as f:
            base = json.load(f)["runs"]
        diff = 0
        for name, fp in out["runs"].items():
            b = base.get(name)
            keys = [k for k in ("rounds", "report", "stats") if b is None or b[k] != fp[k]]
            if keys:
                diff += 1
                print(f"DIFFERS {name}: {', '.join(keys)}  base {b and b['summary']}  now {fp['summary']}")
        print(f"{len(out['runs']) - diff}/{len(out['runs'])} runs match {a.compare}")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
