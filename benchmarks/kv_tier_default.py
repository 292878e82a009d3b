"""Should the host KV tier be on by default? The tier at ``--kv-host-ratio 1`` (a host pool as large as
the device pool) against the tier off, in the simulator, where KV is tight but tool calls are not long.

    python -m benchmarks.kv_tier_default [--out benchmarks/results/kv_tier_default.json] [--quick]

``benchmarks.kv_tier`` measures where the tier is meant to help (tool calls of minutes: its
``ratio-1`` variant); this one measures the runs of ``benchmarks/sim_fingerprint.py`` that the
default would change: GAIA at its own tool times on llama3.1-70b@h20 with every decode worker's KV
cut to ``KV_CAP`` tokens, each policy on its fingerprint deployment, over ``SEEDS`` workload seeds
and ``DURATION_S``. A default may only be flipped where it loses nowhere ("AMPD must never lose to a
baseline it can turn itself into"). Reports per policy and ratio: sessions, admitted (bound),
completed, SLO attainment (a refused session misses it), and the tier's bytes to host.
"""
from __future__ import annotations

import argparse
import sys

from ampd.perf import load_profile
from ampd.policy import SLO
from ampd.sim import sim_report, simulate
from ampd.workload import generate
from benchmarks import write_json
from benchmarks.kv_tier import totals
from benchmarks.sim_fingerprint import COLOC, COLOC_DECODE, DISAGG, PRESETS, PROFILE, _tight_profile

KV_CAP = 200_000  # sim_fingerprint's KV-tight runs
PRESET = "gaia"
POLICIES = ("ampd", "remote", "colocated", "continuum")
RATIOS = (0.0, 1.0)
SEEDS = (7, 1, 2, 3, 4, 5, 6, 8)
DURATION_S = 400.0


def one(sessions, prof, policy: str, ratio: float, seed: int) -> dict:
    rate, _, ttft, itl = PRESETS[PRESET]
    pre, dec = ("none", COLOC_DECODE) if policy in COLOC else DISAGG
    res = simulate(sessions, prof, policy=policy, prefill=pre, decode=dec, ttft_slo_s=ttft, itl_slo_s=itl, seed=3,
                   kv_host_ratio=ratio)
    rep = sim_report(res, SLO(ttft, itl))
    return {"policy": policy, "kv_host_ratio": ratio, "seed": seed, "sessions": rep["sessions"],
            "admitted": sum(1 for s in res.sessions if s.rounds), "completed": rep["completed"],
            "slo_attainment": rep["slo_attainment"],
            "bytes_to_host": res.stats.get("kv_tier", {}).get("bytes_to_host", 0)}


def summary(rows: list[dict]) -> list[dict]:
    """Per policy and ratio, the totals over the seeds."""
    return [{"policy": pol, "kv_host_ratio": ratio,
             **totals([r for r in rows if r["policy"] == pol and r["kv_host_ratio"] == ratio], ("bytes_to_host",))}
            for pol in dict.fromkeys(r["policy"] for r in rows) for ratio in dict.fromkeys(r["kv_host_ratio"] for r in rows)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kv_tier_default.json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="two seeds")
    a = ap.parse_args(argv)
    seeds, rate, prof = SEEDS[:2] if a.quick else SEEDS, PRESETS[PRESET][0], _tight_profile(load_profile(PROFILE), KV_CAP)
    rows = []
    for seed in seeds:
        sessions = generate(PRESET, rate, DURATION_S, seed)
        rows += [one(sessions, prof, pol, ratio, seed) for pol in POLICIES for ratio in RATIOS]
    summ = summary(rows)
    for r in summ:
        print(f"{r['policy']:10s} ratio {r['kv_host_ratio']:g}: admitted {r['admitted']}/{r['sessions']} completed "
              f"{r['completed']} attainment {r['slo_attainment']:.3f}", flush=True)
    write_json(a.out, {"command": "python -m benchmarks.kv_tier_default " + " ".join(argv if argv is not None
                                                                                    else sys.argv[1:]),
                       "profile": PROFILE, "preset": PRESET, "rate": rate, "kv_capacity_tokens": KV_CAP,
                       "duration_s": DURATION_S, "seeds": list(seeds), "summary": summ, "runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
