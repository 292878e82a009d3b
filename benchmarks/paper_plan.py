"""The planner's part of `make paper`: deployments from the planner, and the SLO-tightness sweep.

- ``plan_case``: for one model x preset at its sweep's middle rate, the planner's choice for AMPD
  (whole search space: mixed degrees, co-located deployments, every split), the best deployment the
  same search finds for each baseline (``remote``: disaggregated splits; ``colocated`` and
  ``continuum``: co-located), the planner's top 3 in Table 2's form (one degree per phase, all N
  GPUs, disaggregated), and Table 2's own top 3 simulated under AMPD on the same trace.
- ``tightness``: AMPD on its planned deployment against every baseline on its best deployment,
  as the ITL threshold runs from tight to lenient, on long agent sessions and on a mix of those with
  short chats, on 16 GPUs. Every deployment is planned on one trace (seed PLAN_SEED) and judged on
  others (the evaluation seeds), so no choice is scored on the trace it was picked with.

Pure functions of their job dicts (they run in worker processes); paper.py saves the results.
"""
from __future__ import annotations

import math
import time

import numpy as np

PLAN_SEED = 0  # the trace every deployment is planned on; the sweeps judge on other seeds

# Planner runs per case: name -> (policy the candidates are simulated with, search-space options)
PLANS = {
    "ampd": ("ampd", {}),
    "remote": ("remote", {"colocated": False}),
    "colocated": ("colocated", {}),
    "continuum": ("continuum", {}),
}
BASELINES = ("remote", "colocated", "continuum")

# ---- SLO-tightness sweep -------------------------------------------------------------------
TIGHT_MODEL = "llama3.1-70b@h20"
TIGHT_GPUS = 16
TIGHT_ITL_S = (0.02, 0.03, 0.04, 0.06, 0.08, 0.1)   # tight -> lenient (quick: every other one)
AGENT_RATE = 0.06         # GAIA-like sessions/s of the agent trace
MIX_AGENT_RATE = 0.05     # the mix: GAIA-like sessions/s ...
MIX_CHAT_RATE = 1.2       # ... and short chats/s
TIGHT_DURATION_S = 2400.0  # arrivals (quick: 1200 s)


def chats(rate: float, duration: float, seed: int):
    """Short chats: 1 to 3 turns, ~400-token first prompt, ~120-token follow-ups, ~250-token answers,
    the user's think time (~8 s) between turns. Deterministic in ``seed``."""
    from ampd.workload import generate
    from ampd.workload.trace import Round, Session

    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 7]))
    # arrivals: the same Poisson process the presets use (one stream per seed)
    arrivals = [s.arrival for s in generate("hotpotqa", rate, duration, seed + 1000)]
    out = []
    for i, t in enumerate(arrivals):
        turns = 1 + int(rng.binomial(2, 0.3))
        rounds = []
        for j in range(turns):
            inp = int(np.clip(rng.lognormal(math.log(400 if j == 0 else 120), 0.6), 16, 4000))
            outp = int(np.clip(rng.lognormal(math.log(250), 0.6), 8, 1024))
            think = round(float(np.clip(rng.lognormal(math.log(8.0), 0.5), 1.0, 60.0)), 3)
            rounds.append(Round(inp, outp, think if j < turns - 1 else None))
        out.append(Session(f"chat-{seed}-{i}", float(t), tuple(rounds)))
    return out


def tight_trace(kind: str, seed: int, quick: bool, load: float = 1.0):
    """``agent``: GAIA-like sessions; ``mix``: fewer of them and short chats; sorted by arrival. ``load``
    scales every rate."""
    from ampd.workload import generate

    dur = TIGHT_DURATION_S / 2 if quick else TIGHT_DURATION_S
    if kind == "agent":
        ss = generate("gaia", AGENT_RATE * load, dur, seed)
    elif kind == "mix":
        ss = generate("gaia", MIX_AGENT_RATE * load, dur, seed) + chats(MIX_CHAT_RATE * load, dur, seed)
    else:
        raise ValueError(f"unknown trace kind {kind!r}")
    return sorted(ss, key=lambda s: s.arrival)


def _request(profile, sessions, gpus, slo, policy, space, top, check_sessions):
    from ampd.planner import PlanRequest

    return PlanRequest(profile, sessions, gpus, slo, top=top, policy=policy, check_sessions=check_sessions,
                       **space)


def run_plans(profile, sessions, gpus, slo, cache, plans=PLANS, top=3, check_sessions=0) -> dict:
    """name -> {"top": [PlanEntry JSON ...], "seconds", "candidates" (simulated), "skipped"} for every
    planner run of ``plans``."""
    from ampd.planner import plan

    out = {}
    for name, (policy, space) in plans.items():
        t0 = time.time()
        res = plan(_request(profile, sessions, gpus, slo, policy, space, top, check_sessions), cache=cache)
        out[name] = {"top": [e.to_json() for e in res.top], "seconds": round(time.time() - t0, 2),
                     "candidates": res.candidates, "skipped": res.skipped}
    return out


def plan_case(job: dict) -> dict:
    """job: model, preset, gpus, rate, duration, slo {ttft_s, itl_s}, table2 [(prefill, decode) x 3]."""
    from ampd.bench.report import SLO
    from ampd.deployment import parse_spec
    from ampd.perf import load_profile
    from ampd.planner import Deployment, EstimateCache, PlanRequest
    from ampd.planner.plan import check
    from ampd.workload import generate

    t0 = time.time()
    prof = load_profile(job["model"])
    sessions = generate(job["preset"], job["rate"], job["duration"], PLAN_SEED)
    slo = SLO(ttft_s=job["slo"]["ttft_s"], itl_s=job["slo"]["itl_s"])
    cache = EstimateCache()
    plans = dict(PLANS, **{"table2-form": ("ampd", {"colocated": False, "mixed": False, "all_gpus": True})})
    out = run_plans(prof, sessions, job["gpus"], slo, cache, plans)
    req = PlanRequest(prof, sessions, job["gpus"], slo, policy="ampd")
    t2 = []
    for rank, (pre, dec) in enumerate(job["table2"], 1):
        dep = Deployment.of(dict(parse_spec(pre)), dict(parse_spec(dec)))
        policy, att, p95, _ = check(req, dep)
        t2.append({"rank": rank, "prefill": pre, "decode": dec, "policy": policy, "slo_attainment": att,
                   "p95_s": p95 if math.isfinite(p95) else None})
    return {"model": job["model"], "preset": job["preset"], "gpus": job["gpus"], "rate": job["rate"],
            "sessions": len(sessions), "slo": job["slo"], "plans": out, "table2": t2,
            "check_simulations": {"run": cache.misses, "cached": cache.hits}, "wall_s": round(time.time() - t0, 1)}


def chosen(plan_json: dict, name: str) -> tuple[str, str, str]:
    """(prefill SPEC, decode SPEC, policy it was simulated with) of the planner's first choice."""
    e = plan_json["plans"][name]["top"][0]
    return e["prefill"], e["decode"], e["policy"]


def tight_point(job: dict) -> dict:
    """One (trace kind, ITL threshold): plan every policy on the PLAN_SEED trace, then simulate each
    choice on every evaluation seed. AMPD's planned deployment also runs ampd-margin."""
    from ampd.bench.report import SLO
    from ampd.perf import load_profile
    from ampd.planner import EstimateCache
    from ampd.sim import sim_report, simulate

    t0 = time.time()
    prof = load_profile(TIGHT_MODEL)
    slo = SLO(ttft_s=job["ttft_s"], itl_s=job["itl_s"])
    load = job.get("load", 1.0)
    plan_trace = tight_trace(job["kind"], PLAN_SEED, job["quick"], load)
    cache = EstimateCache()
    plans = run_plans(prof, plan_trace, TIGHT_GPUS, slo, cache, PLANS, top=1)
    runs = {name: chosen({"plans": plans}, name) for name in PLANS}
    pre, dec, pol = runs["ampd"]
    runs["ampd-margin"] = (pre, dec, "ampd-margin" if pol == "ampd" else pol)
    att: dict[str, list[float]] = {}
    for seed in job["seeds"]:
        sessions = tight_trace(job["kind"], seed, job["quick"], load)
        for name, (pre, dec, pol) in runs.items():
            res = simulate(sessions, prof, policy=pol, prefill=pre, decode=dec, ttft_slo_s=slo.ttft_s,
                           itl_slo_s=slo.itl_s, seed=seed)
            rep = sim_report(res, slo, extras=False)
            att.setdefault(name, []).append(float(rep["slo_attainment"]))
    mean = {k: float(np.mean(v)) for k, v in att.items()}
    best_base = max(BASELINES, key=lambda b: mean[b])
    return {"kind": job["kind"], "load": load, "itl_s": job["itl_s"], "ttft_s": job["ttft_s"], "seeds": job["seeds"],
            "deployments": {k: {"prefill": v[0], "decode": v[1], "policy": v[2]} for k, v in runs.items()},
            "attainment": mean, "attainment_by_seed": att, "best_baseline": best_base,
            "ampd_minus_best_pts": (mean["ampd"] - mean[best_base]) * 100,
            "margin_minus_ampd_pts": (mean["ampd-margin"] - mean["ampd"]) * 100,
            "plans": plans, "wall_s": round(time.time() - t0, 1)}
