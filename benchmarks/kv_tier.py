"""The host KV tier in the simulator: a long-tool agent trace on a KV-tight decode pool, today's
deployment against KV eviction (drop) and the host tier (offload to host memory, back on the result).

    python -m benchmarks.kv_tier [--out benchmarks/results/kv_tier.json] [--quick]

The trace is the GAIA preset (``ampd.workload``) with every tool call ``TOOL_SCALE`` times longer
(slow browsing, code runs, human-in-the-loop tools: minutes), on llama3.1-70b@h20 with the decode
worker's KV cut to ``KV_CAP`` tokens, so sessions idle in tool calls hold most of the pool. Variants,
same trace and deployment:

- ``today``: the deployment without the tier (``--kv-host-ratio 0``, the default): coordinator
  admission ``kv`` (a session is bound only where its whole KV is promised; the others wait up to ``--admission-wait``
  and are refused with ``kv-full``);
- ``admit-all``: admission ``none`` (every session bound at once; its rounds wait for KV);
- ``drop``: admission ``none`` and ``--kv-evict`` (idle KV dropped under pressure, re-prefilled);
- ``ratio-1``: ``host`` with the host pool sized by ``--kv-host-ratio 1`` (as large as the device
  pool, 300k tokens) instead of ``--kv-host-mb``;
- ``host-admit-all``: admission ``none`` and ``--kv-host-mb`` (``ampd.worker.decode_tier``);
- ``host``: the default admission ``kv`` and ``--kv-host-mb`` (``HOST_MB``, ~1.4 x the device pool): admission promises each decode
  worker's device pool plus as much of its host pool as KV idle in tool calls can be on host
  (``ampd.policy.admit.promise_room``: none until it has seen 4 calls), the tier keeps,
  offloads or drops each tool call's KV, offloads idle KV under pressure and fetches it back with the
  profile's ``t_kv``; rounds are routed with their KV's location (``PrefillTask.kv_state``);
- ``host+early``: the same, and offloaded KV starts coming back at the tool's expected end
  (``--kv-prefetch-early``) into blocks no waiting round needs;
- ``host-2x``: ``host`` with twice the host pool: when admission promised the whole host pool it
  let in more than the workers could serve; it now promises only what idle KV fills.

Every variant runs on the trace of each seed in ``SEEDS`` (the first is the one reported row by row
in earlier results). Reports per run: sessions admitted (bound) and completed, SLO attainment (a
refused session misses it), TTFT P90, end-to-end P50, the tier's decisions by reason, route reasons,
tokens and bytes to and from host, recomputed history tokens, overcommits; and per rate and variant
the totals over the seeds, and whether issue 29.6's goal holds against ``today`` (more sessions
admitted and completed, attainment no lower, no overcommit).
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
SEEDS = (7, 1, 2, 3, 4, 5)  # workload seeds
OFF = {"kv_host_ratio": 0}  # the tier off, whatever the default (ampd/config.py kv_host_ratio)
VARIANTS = {
    "today": OFF,
    "admit-all": {"admission": "none", **OFF},
    "drop": {"admission": "none", "kv_evict": True, **OFF},
    "ratio-1": {"kv_host_ratio": 1},
    "host-admit-all": {"admission": "none", "kv_host_mb": HOST_MB},
    "host": {"kv_host_mb": HOST_MB},
    "host+early": {"kv_host_mb": HOST_MB, "kv_prefetch_early": True},
    "host-2x": {"kv_host_mb": 2 * HOST_MB},
}


def trace(rate: float, duration: float, seed: int = SEEDS[0]):
    out = []
    for s in generate(PRESET, rate, duration, seed):
        rounds = tuple(dataclasses.replace(r, tool_s=r.tool_s * TOOL_SCALE) if r.tool_s else r for r in s.rounds)
        out.append(dataclasses.replace(s, rounds=rounds))
    return out


def one(sessions, prof, rate: float, name: str, seed: int = SEEDS[0]) -> dict:
    res = simulate(sessions, prof, policy="ampd", prefill=DISAGG[0], decode=DISAGG[1], ttft_slo_s=TTFT_SLO,
                   itl_slo_s=ITL_SLO, seed=3, **VARIANTS[name])
    rep = sim_report(res, SLO(TTFT_SLO, ITL_SLO))
    st = res.stats
    admitted = sum(1 for s in res.sessions if s.rounds)
    tier = st.get("kv_tier", {})
    return {"variant": name, "rate": rate, "seed": seed, "sessions": rep["sessions"], "admitted": admitted,
            "completed": rep["completed"], "refused": st["admission_refused"],
            "slo_attainment": rep["slo_attainment"], "ttft_p90_s": rep["ttft_s"]["p90"],
            "e2e_p50_s": rep["e2e_s"]["p50"], "kv_overcommits": st["kv_overcommits"],
            "kv_evictions": st["kv_evictions"], "kv_recomputed_tokens": st.get("kv_recomputed_tokens", 0),
            "tier_decisions": tier.get("decisions", {}), "route_reasons": st["route_reasons"], "bytes_to_host": tier.get("bytes_to_host", 0),
            "bytes_from_host": tier.get("bytes_from_host", 0), "host_used_end": tier.get("host_used_end", []),
            "kv_used_end": st["kv_used_end"], "sim_wall_s": round(st["wall_s"], 2)}


def totals(rs: list[dict], summed: tuple[str, ...] = ()) -> dict:
    """Runs ``rs`` together: seeds, sessions, admitted, completed, the SLO attainment over all their
    sessions, and the sums of ``summed``."""
    n = sum(r["sessions"] for r in rs)
    return {"seeds": len(rs), "sessions": n, "admitted": sum(r["admitted"] for r in rs),
            "completed": sum(r["completed"] for r in rs),
            "slo_attainment": sum(r["slo_attainment"] * r["sessions"] for r in rs) / n if n else 0.0,
            **{k: sum(r[k] for r in rs) for k in summed}}


def summary(rows: list[dict]) -> list[dict]:
    """Per rate and variant, the totals over the seeds; and issue 29.6's test against ``today``."""
    out = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        base = None
        for name in VARIANTS:
            rs = [r for r in rows if r["rate"] == rate and r["variant"] == name]
            if not rs:
                continue
            row = {"rate": rate, "variant": name, **totals(rs, ("kv_overcommits", "bytes_to_host", "bytes_from_host"))}
            if name == "today":
                base = row
            elif base is not None:
                row["goal_29_6"] = (row["admitted"] > base["admitted"] and row["completed"] > base["completed"]
                                    and row["slo_attainment"] >= base["slo_attainment"]
                                    and row["kv_overcommits"] == 0)
            out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kv_tier.json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="one rate, a shorter trace")
    a = ap.parse_args(argv)
    prof = _tight_profile(load_profile(PROFILE), KV_CAP)
    rates, duration, seeds = (RATES[:1], DURATION_S / 3, SEEDS[:1]) if a.quick else (RATES, DURATION_S, SEEDS)
    rows = []
    for rate in rates:
        for seed in seeds:
            sessions = trace(rate, duration, seed)
            for name in VARIANTS:
                r = one(sessions, prof, rate, name, seed)
                rows.append(r)
                _print(r)
    summ = summary(rows)
    for r in summ:
        print(f"rate {r['rate']:.3f} {r['variant']:14s} over {r['seeds']} seeds: admitted {r['admitted']}/"
              f"{r['sessions']} completed {r['completed']} attainment {r['slo_attainment']:.3f} overcommits "
              f"{r['kv_overcommits']}" + (f" goal 29.6 {r['goal_29_6']}" if "goal_29_6" in r else ""), flush=True)
    out = {"command": "python -m benchmarks.kv_tier " + " ".join(argv if argv is not None else sys.argv[1:]),
           "profile": PROFILE, "preset": PRESET, "tool_scale": TOOL_SCALE, "kv_capacity_tokens": KV_CAP,
           "kv_host_mb": HOST_MB, "variants": VARIANTS, "slo": {"ttft_s": TTFT_SLO, "itl_s": ITL_SLO},
           "duration_s": duration,
           "seeds": list(seeds), "deployment": {"prefill": DISAGG[0], "decode": DISAGG[1], "policy": "ampd"},
           "load_avg": os.getloadavg(), "summary": summ, "runs": rows}
    if a.out:
        write_json(a.out, out)
    return 0


def _print(r: dict) -> None:
    print(f"rate {r['rate']:.3f} seed {r['seed']} {r['variant']:14s}: admitted {r['admitted']}/{r['sessions']} "
          f"completed {r['completed']} attainment {r['slo_attainment']:.3f} TTFT p90 {r['ttft_p90_s']:.2f} s "
          f"e2e p50 {r['e2e_p50_s']:.0f} s refused {r['refused']} evictions {r['kv_evictions']} recomputed "
          f"{r['kv_recomputed_tokens']} to host {r['bytes_to_host'] / 2**30:.1f} GiB from host "
          f"{r['bytes_from_host'] / 2**30:.1f} GiB {r['tier_decisions']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
