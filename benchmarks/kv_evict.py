"""KV eviction in the simulator: the same KV-tight deployments with ``kv_evict`` off and on.

    python -m benchmarks.kv_evict [--json benchmarks/results/kv_evict.json]

Per preset (GAIA, ToolBench: seeded ``ampd.workload`` traces at the rates of
benchmarks/sim_fingerprint.py, longer), policy (ampd, remote, colocated) and decode KV capacity
(tokens per worker, cut from llama3.1-70b@h20's), one run without and one with eviction. Reports SLO
attainment, TTFT P90, end-to-end P50, overcommits (rounds the decode core let through over capacity:
a live worker fails those sessions), evictions and recomputed history tokens.

Two settings per run: ``defaults`` (today's: admission ``kv``, the host KV tier at ratio 1, prefix
sharing on), where admission holds sessions back (``completed`` < ``sessions``: refused) and the
tier moves idle KV to host, so the pool never overfills and eviction never fires; and
``no-admission-no-tier`` (admission ``none``, ``kv_host_ratio`` 0: every session bound at once, the
conditions this benchmark was first measured under), where it does.
"""
from __future__ import annotations

import argparse
import os
import sys

from ampd.perf import load_profile
from ampd.policy import SLO
from ampd.sim import sim_report, simulate
from ampd.workload import generate
from benchmarks.sim_fingerprint import COLOC_DECODE, DISAGG, PRESETS, PROFILE, _tight_profile
from benchmarks import write_json

RUNS = {"gaia": (600.0, (200_000, 400_000)), "toolbench": (120.0, (20_000, 40_000))}  # duration s, KV caps
POLICIES = ("ampd", "remote", "colocated")
SETTINGS = {"defaults": {}, "no-admission-no-tier": {"admission": "none", "kv_host_ratio": 0.0}}


def one(preset: str, policy: str, kv: int, evict: bool, prof, settings: str = "defaults") -> dict:
    rate, _, ttft, itl = PRESETS[preset]
    duration = RUNS[preset][0]
    pre, dec = ("none", COLOC_DECODE) if policy == "colocated" else DISAGG
    res = simulate(generate(preset, rate, duration, 7), _tight_profile(prof, kv), policy=policy, prefill=pre,
                   decode=dec, ttft_slo_s=ttft, itl_slo_s=itl, seed=3, kv_evict=evict, **SETTINGS[settings])
    rep = sim_report(res, SLO(ttft, itl))
    st = res.stats
    return {"settings": settings, "preset": preset, "policy": policy, "kv_capacity_tokens": kv, "kv_evict": evict,
            "sessions": rep["sessions"], "completed": rep["completed"], "slo_attainment": rep["slo_attainment"],
            "ttft_p90_s": rep["ttft_s"]["p90"], "e2e_p50_s": rep["e2e_s"]["p50"],
            "kv_overcommits": st["kv_overcommits"], "kv_evictions": st["kv_evictions"],
            "kv_recomputed_tokens": st.get("kv_recomputed_tokens", 0), "local_fraction": rep["local_fraction"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    prof = load_profile(PROFILE)
    rows = []
    for settings in SETTINGS:
        for preset, (_, caps) in RUNS.items():
            for policy in POLICIES:
                for kv in caps:
                    for evict in (False, True):
                        r = one(preset, policy, kv, evict, prof, settings)
                        rows.append(r)
                        print(f"{settings} {preset:9s} {policy:9s} kv {kv:7d} evict {evict!s:5s}: attainment "
                              f"{r['slo_attainment']:.3f} completed {r['completed']}/{r['sessions']} TTFT p90 "
                              f"{r['ttft_p90_s']:.2f} s e2e p50 {r['e2e_p50_s']:.1f} s overcommits "
                              f"{r['kv_overcommits']} evictions {r['kv_evictions']} recomputed "
                              f"{r['kv_recomputed_tokens']}", flush=True)
    out = {"command": "python -m benchmarks.kv_evict " + " ".join(argv if argv is not None else sys.argv[1:]),
           "profile": PROFILE, "settings": SETTINGS,
           "note": "simulator; settings 'defaults': admission kv, kv_host_ratio 1, prefix sharing on (eviction "
                   "never fires: admission refuses what would overfill the pool, the tier moves idle KV); "
                   "'no-admission-no-tier': admission none, kv_host_ratio 0, as first measured (before the "
                   "simulator admitted sessions and before the tier was on by default)",
           "load_avg": os.getloadavg(), "runs": rows}
    if a.json:
        write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
