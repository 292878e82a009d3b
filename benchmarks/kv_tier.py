"""The host KV tier in the simulator: a long-tool agent trace on a KV-tight decode pool, today's
deployment against KV eviction (drop) and the host tier (offload to host memory, back on the result).

    python -m benchmarks.kv_tier [--out benchmarks/results/kv_tier.json] [--quick]

The trace is the GAIA preset (``ampd.workload``, seed 7) with every tool call ``TOOL_SCALE`` times
longer (slow browsing, code runs, human-in-the-loop tools: minutes), on llama3.1-70b@h20 with the
decode worker's KV cut to ``KV_CAP`` tokens, so sessions idle in tool calls hold most of the pool.
Variants, same trace and deployment:

- ``today``: the defaults: coordinator admission ``kv`` (a session is bound only where its whole KV
  is promised; the others wait up to ``--admission-wait`` and are refused with ``kv-full``);
- ``admit-all``: admission ``none`` (every session bound at once; its rounds wait for KV);
- ``drop``: admission ``none`` and ``--kv-evict`` (idle KV dropped under pressure, re-prefilled);
- ``host``: admission ``none`` and ``--kv-host-mb`` (``ampd.worker.decode_tier``: each tool call's
  keep / offload / drop decision, idle KV offloaded to host under pressure, fetched back with the
  profile's ``t_kv`` when the result arrives);
- ``host+early``: the same, and offloaded KV starts coming back at the tool's expected end
  (``--kv-prefetch-early``) into blocks no waiting round needs.

The admission ``kv`` rule promises a session's whole KV up front, so neither eviction nor the tier
can admit more sessions under it: they need admission ``none`` (or an admission that counts
evictable KV, which the coordinator does not have yet). Reports per variant: sessions admitted
(bound) and completed, SLO attainment, TTFT P90, end-to-end P50, the tier's decisions by reason,
tokens and bytes to and from host, recomputed history tokens, overcommits.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ampd.perf import load_profile
from ampd.policy import SLO
from ampd.sim import sim_report, simulate
from ampd.workload import generate
from benchmarks import write_json
from benchmarks.sim_fingerprint import DISAGG, PROFILE, _tight_profile

PRESET = "gaia"
TOOL_SCALE = 10.0  # tool calls 10x GAIA's: mean ~34 s
KV_CAP = 300_000  # decode KV tokens (llama3.1-70b@h20 tp4 has ~575k)
HOST_MB = 128 * 1024  # 128 GiB of host memory per decode worker: ~400k tokens at 320 KiB a token
TTFT_SLO, ITL_SLO = 20.0, 0.15  # benchmarks/sim_fingerprint.py's GAIA SLOs
RATES = (0.02, 0.03, 0.045, 0.06)  # sessions/s
DURATION_S = 1200.0
VARIANTS = {
    "today": {},
    "admit-all": {"admission": "none"},
    "drop": {"admission": "none", "kv_evict": True},
    "host": {"admission": "none", "kv_host_mb": HOST_MB},
    "host+early": {"admission": "none", "kv_host_mb": HOST_MB, "kv_prefetch_early": True},
}


def trace(rate: float, duration: float):
    out = []
    for s in generate(PRESET, rate, duration, 7):
        rounds = tuple(dataclasses.replace(r, tool_s=r.tool_s * TOOL_SCALE) if r.tool_s else r for r in s.rounds)
        out.append(dataclasses.replace(s, rounds=rounds))
    return out


def one(sessions, prof, rate: float, name: str) -> dict:
    res = simulate(sessions, prof, policy="ampd", prefill=DISAGG[0], decode=DISAGG[1], ttft_slo_s=TTFT_SLO,
                   itl_slo_s=ITL_SLO, seed=3, **VARIANTS[name])
    rep = sim_report(res, SLO(TTFT_SLO, ITL_SLO))
    st = res.stats
    admitted = sum(1 for s in res.sessions if s.rounds)
    tier = st.get("kv_tier", {})
    return {"variant": name, "rate": rate, "sessions": rep["sessions"], "admitted": admitted,
            "completed": rep["completed"], "refused": st["admission_refused"],
            "slo_attainment": rep["slo_attainment"], "ttft_p90_s": rep["ttft_s"]["p90"],
            "e2e_p50_s": rep["e2e_s"]["p50"], "kv_overcommits": st["kv_overcommits"],
            "kv_evictions": st["kv_evictions"], "kv_recomputed_tokens": st.get("kv_recomputed_tokens", 0),
            "tier_decisions": tier.get("decisions", {}), "bytes_to_host": tier.get("bytes_to_host", 0),
            "bytes_from_host": tier.get("bytes_from_host", 0), "host_used_end": tier.get("host_used_end", []),
            "kv_used_end": st["kv_used_end"], "sim_wall_s": round(st["wall_s"], 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kv_tier.json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="one rate, a shorter trace")
    a = ap.parse_args(argv)
    prof = _tight_profile(load_profile(PROFILE), KV_CAP)
    rates, duration = (RATES[:1], DURATION_S / 3) if a.quick else (RATES, DURATION_S)
    rows = []
    for rate in rates:
        sessions = trace(rate, duration)
        for name in VARIANTS:
            r = one(sessions, prof, rate, name)
            rows.append(r)
            print(f"rate {rate:.3f} {name:10s}: admitted {r['admitted']}/{r['sessions']} completed {r['completed']} "
                  f"attainment {r['slo_attainment']:.3f} TTFT p90 {r['ttft_p90_s']:.2f} s e2e p50 "
                  f"{r['e2e_p50_s']:.0f} s refused {r['refused']} evictions {r['kv_evictions']} recomputed "
                  f"{r['kv_recomputed_tokens']} to host {r['bytes_to_host'] / 2**30:.1f} GiB from host "
                  f"{r['bytes_from_host'] / 2**30:.1f} GiB {r['tier_decisions']}", flush=True)
    out = {"command": "python -m benchmarks.kv_tier " + " ".join(argv if argv is not None else sys.argv[1:]),
           "profile": PROFILE, "preset": PRESET, "tool_scale": TOOL_SCALE, "kv_capacity_tokens": KV_CAP,
           "kv_host_mb": HOST_MB, "slo": {"ttft_s": TTFT_SLO, "itl_s": ITL_SLO}, "duration_s": duration,
           "deployment": {"prefill": DISAGG[0], "decode": DISAGG[1], "policy": "ampd"},
           "load_avg": os.getloadavg(), "runs": rows}
    if a.out:
        write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
