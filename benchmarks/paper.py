"""The paper's experiments (ICML 2026 AMPD, section 7) on the simulator: `make paper`.

Parts (each saves its JSON under --out as soon as it finishes, so a partial run leaves results):

- ``slo``        the SLO thresholds per model x preset, from one stated rule (``slo_rule``);
- ``scan``       a coarse rate scan per model x preset that picks the sweep's rates (on Table 2's #1);
- ``plan``       the planner (ampd/planner) at each sweep's middle rate: AMPD's deployment (whole search
                 space, co-location included), each baseline's best deployment by the same search, the
                 planner's top 3 in Table 2's form beside Table 2's top 3 (benchmarks/paper_plan.py);
- ``sweep``      SLO attainment vs rate for every policy on its planned deployment (Figure 3), the
                 AMPD-vs-baseline table and the average gains beside the paper's +67.29% (Dynamo) /
                 +339.74% (vLLM);
- ``breakdown``  mean TTFT (initial / incremental) and mean ITL per policy at the middle rate (Fig. 4);
- ``ablation``   remote -> + adaptive routing (ampd-noreorder) -> + reordering (ampd) (Fig. 5 left);
- ``local``      the share of prefills AMPD runs locally, per preset (Fig. 5 right);
- ``sensitivity`` w, alpha, beta on Llama3.1-70B DuReader at the middle rate (Fig. 6);
- ``kvratio``    T_kv / T_pre of incremental prefills, by tasks and by tokens (computed from the traces
                 and the deployment with the profile);
- ``chunked``    beyond the paper: chunked local prefill for AMPD and co-location;
- ``tightness``  the SLO-tightness sweep: the ITL threshold from tight to lenient on long agent sessions
                 and a mix with short chats (16 GPUs), AMPD on its planned deployment against every
                 baseline on its best deployment.

Write-up: docs/paper-results.md.  Usage:
    python -m benchmarks.paper [--quick] [--jobs 2] [--out benchmarks/results/paper] [--parts ...]
    make paper PAPER_ARGS="--quick --out /tmp/paper-quick"
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from multiprocessing import Pool

import numpy as np

MODELS = ["llama3.1-70b@h20", "qwen3-32b@h20", "mixtral-8x7b@h20"]
PRESETS = ["toolbench", "hotpotqa", "dureader", "gaia"]
GPUS = {"toolbench": 8, "hotpotqa": 8, "dureader": 16, "gaia": 32}
SHORT = {"llama3.1-70b@h20": "Llama3.1-70B", "qwen3-32b@h20": "Qwen3-32B", "mixtral-8x7b@h20": "Mixtral-8x7B"}

# Paper Table 2, top-1 planner configuration, P<TP,DP> D<TP,DP> -> (prefill SPEC, decode SPEC).
TABLE2 = {
    ("llama3.1-70b@h20", "dureader"): ("tp4*2", "tp8*1"),
    ("llama3.1-70b@h20", "hotpotqa"): ("tp4*1", "tp4*1"),
    ("llama3.1-70b@h20", "gaia"): ("tp8*2", "tp8*2"),
    ("llama3.1-70b@h20", "toolbench"): ("tp4*1", "tp4*1"),
    ("qwen3-32b@h20", "hotpotqa"): ("tp4*1", "tp4*1"),
    ("qwen3-32b@h20", "dureader"): ("tp4*2", "tp4*2"),
    ("qwen3-32b@h20", "toolbench"): ("tp4*1", "tp4*1"),
    ("qwen3-32b@h20", "gaia"): ("tp8*2", "tp8*2"),
    ("mixtral-8x7b@h20", "hotpotqa"): ("tp4*1", "tp4*1"),
    ("mixtral-8x7b@h20", "dureader"): ("tp8*1", "tp8*1"),
    ("mixtral-8x7b@h20", "toolbench"): ("tp4*1", "tp4*1"),
    ("mixtral-8x7b@h20", "gaia"): ("tp8*2", "tp8*2"),
}

# Table 2's #2 and #3 (set beside our planner's top 3 in plan.json).
TABLE2_ALT = {
    ("llama3.1-70b@h20", "dureader"): [("tp2*4", "tp8*1"), ("tp8*1", "tp8*1")],
    ("llama3.1-70b@h20", "hotpotqa"): [("tp2*2", "tp4*1"), ("tp2*1", "tp2*3")],
    ("llama3.1-70b@h20", "gaia"): [("tp8*3", "tp8*1"), ("tp4*4", "tp8*2")],
    ("llama3.1-70b@h20", "toolbench"): [("tp2*2", "tp4*1"), ("tp2*1", "tp2*3")],
    ("qwen3-32b@h20", "hotpotqa"): [("tp2*2", "tp4*1"), ("tp2*1", "tp2*3")],
    ("qwen3-32b@h20", "dureader"): [("tp4*2", "tp2*4"), ("tp2*4", "tp4*2")],
    ("qwen3-32b@h20", "toolbench"): [("tp2*2", "tp4*1"), ("tp2*1", "tp2*3")],
    ("qwen3-32b@h20", "gaia"): [("tp8*3", "tp8*1"), ("tp4*4", "tp8*2")],
    ("mixtral-8x7b@h20", "hotpotqa"): [("tp2*1", "tp2*3"), ("tp4*1", "tp2*2")],
    ("mixtral-8x7b@h20", "dureader"): [("tp8*1", "tp4*2"), ("tp4*2", "tp8*1")],
    ("mixtral-8x7b@h20", "toolbench"): [("tp2*1", "tp2*3"), ("tp4*1", "tp2*2")],
    ("mixtral-8x7b@h20", "gaia"): [("tp8*3", "tp8*1"), ("tp4*4", "tp8*2")],
}

# Lines of the sweep (labels; dep_for says which deployment and policy each runs):
# - ampd, ampd-noreorder, ampd-window (the paper's slack rule), ampd-margin (margin routing): AMPD's
#   planned deployment (a co-located plan runs under the co-located policy it was planned with);
# - ampd-table2: AMPD on Table 2's #1 (what the planner changes);
# - remote: Dynamo on AMPD's deployment, as in the paper (Table 2's #1 when AMPD's plan is co-located);
# - remote-best, colocated, continuum: each baseline on the best deployment the same search finds for it.
AMPD_LINES = ["ampd", "ampd-noreorder", "ampd-window", "ampd-margin"]
COLOC = ["colocated", "continuum"]
SWEEP_POLICIES = AMPD_LINES + ["ampd-table2", "remote", "remote-best"] + COLOC
BASELINES = ["remote", "remote-best", "colocated", "continuum"]
PAPER_POLICIES = ["ampd", "remote", "colocated", "continuum"]  # Figure 3's four lines

# ---- SLO rule (one rule for every model x preset, fixed before any sweep was run) ---------------
TTFT_K = 3.0     # TTFT_thres = TTFT_K x P90 standalone prefill time (all prefills, AMPD deployment)
ITL_M = 3.0      # ITL_thres  = ITL_M x decode step time at batch ITL_BATCH, median round context, decode TP
ITL_BATCH = 32
COLOC_MIN_TP = 4  # co-located candidates: TP 4 and TP 8 (TP 2 was worst in every quick check; see docs)
SLO_SEED = 0     # trace used to compute the medians (rounds do not depend on rate/duration)

PAPER = {"gain_vs_remote_pct": 67.29, "gain_vs_colocated_pct": 339.74,
         "max_gain_vs_remote_pct": 967.54, "max_gain_vs_colocated_pct": 3435.1,
         "local_share": {"dureader": 0.317, "gaia": 0.313, "hotpotqa": 0.155, "toolbench": 0.139},
         "ablation_routing_gain_pct": (27.37, 350.0), "ablation_reorder_extra_pct": (13.42, 14.81),
         "ablation_both_pct": (44.47, 402.0), "sensitivity_w_band_pct": 3.0}

KV_BUCKETS = [(0.0, 0.01, "0-1%"), (0.01, 0.05, "1-5%"), (0.05, 0.10, "5-10%"), (0.10, 0.20, "10-20%"),
              (0.20, 0.25, "20-25%"), (0.25, math.inf, ">25%")]


def tp_of(spec: str) -> int:
    return int(spec.split("*")[0][2:])


def n_gpus(spec: str) -> int:
    if spec in ("", "none"):
        return 0
    tot = 0
    for g in spec.split(","):
        tp, _, r = g.partition("*")
        tot += int(tp[2:]) * int(r or 1)
    return tot


@functools.lru_cache(maxsize=8)
def _profile(model):
    from ampd.perf import load_profile
    return load_profile(model)


@functools.lru_cache(maxsize=4)
def _trace(preset, rate, duration, seed):
    from ampd.workload import generate
    return tuple(generate(preset, rate, duration, seed))


def duration_for(preset: str, rate: float, quick: bool) -> float:
    """~300 sessions per point (150 quick), arrivals over [200, 1500] s (GAIA [300, 1500])."""
    target = 120 if quick else 300
    lo = 300.0 if preset == "gaia" else 200.0
    hi = 600.0 if quick else 1500.0
    return float(min(max(target / rate, lo), hi))


def slo_rule(model: str, preset: str) -> dict:
    """TTFT_thres = TTFT_K x P90 of the standalone (idle-cluster) time of every prefill of the preset's
    trace, initial and incremental, on AMPD's deployment (T_pre at the prefill TP + the KV read and
    write-back); ITL_thres = ITL_M x T_dec(decode TP, ITL_BATCH, ITL_BATCH x median round context)."""
    from ampd.workload import generate
    prof = _profile(model)
    pre, dec = TABLE2[(model, preset)]
    tpp, tpd = tp_of(pre), tp_of(dec)
    ss = generate(preset, 1.0, 500.0, SLO_SEED)
    first, allp, ctxs, smax = [], [], [], []
    for s in ss:
        h, mx = 0, 0.0
        for j, r in enumerate(s.rounds):
            t = prof.t_pre(tpp, h, r.input) + prof.t_kv(h, tpd, tpp) + prof.t_kv(r.input, tpp, tpd)
            allp.append(t)
            if j == 0:
                first.append(prof.t_pre(tpp, 0, r.input))
            mx = max(mx, t)
            ctxs.append(h + r.input + r.output // 2)
            h += r.input + r.output
        smax.append(mx)
    p90 = float(np.percentile(allp, 90))
    ctx = statistics.median(ctxs)
    step = prof.t_dec(tpd, ITL_BATCH, ITL_BATCH * ctx)
    ttft = round(TTFT_K * p90, 3)
    return {"model": model, "preset": preset, "prefill": pre, "decode": dec,
            "p90_standalone_prefill_s": p90, "median_initial_prefill_s": statistics.median(first),
            "median_round_context_tokens": ctx, "decode_step_s": step, "ttft_s": ttft,
            "itl_s": round(ITL_M * step, 4),
            "idle_feasible_sessions": float(np.mean(np.array(smax) <= ttft)),
            "ttft_over_median_initial_prefill": ttft / statistics.median(first)}


def coloc_candidates(model: str, preset: str) -> list[str]:
    n = GPUS[preset]
    return [f"tp{tp}*{n // tp}" for tp in _profile(model).tps if tp <= n and n % tp == 0 and tp >= COLOC_MIN_TP]


def deployment(model, preset, policy, coloc_spec=None):
    """Table 2's #1 (a co-located policy: ``coloc_spec``); the rate scan's deployments."""
    if policy in COLOC:
        return "none", coloc_spec
    return TABLE2[(model, preset)]


def dep_for(ctx, model, preset, label) -> tuple[str, str, str]:
    """(prefill SPEC, decode SPEC, simulated policy) of a sweep line (see SWEEP_POLICIES)."""
    from benchmarks.paper_plan import chosen

    plan = ctx.plans[f"{model}|{preset}"]
    if label == "ampd-table2":
        return (*TABLE2[(model, preset)], "ampd")
    if label in AMPD_LINES:
        pre, dec, pol = chosen(plan, "ampd")
        return pre, dec, (label if pol == "ampd" else pol)
    if label == "remote":
        pre, dec, _ = chosen(plan, "ampd")
        if pre == "none":
            pre, dec = TABLE2[(model, preset)]
        return pre, dec, "remote"
    if label == "remote-best":
        return chosen(plan, "remote")
    if label in COLOC:
        return chosen(plan, label)
    raise ValueError(f"unknown sweep line {label!r}")


def disagg_dep(ctx, model, preset) -> tuple[str, str]:
    """AMPD's planned deployment when it is disaggregated, else Table 2's #1 (the parts that study the
    prefill workers: sensitivity, kvratio)."""
    pre, dec, _ = dep_for(ctx, model, preset, "remote")
    return pre, dec


def _summ(x):
    return {k: x[k] for k in ("mean", "p50", "p90", "p99")}


def run_point(job: dict) -> dict:
    """One simulation: job = {model, preset, policy, rate, duration, seed, prefill, decode, slo, opts}."""
    from ampd.policy import SLO
    from ampd.sim import simulate
    from ampd.sim.records import sim_report

    t0 = time.time()
    prof = _profile(job["model"])
    sess = _trace(job["preset"], job["rate"], job["duration"], job["seed"])
    opts = dict(job.get("opts") or {})
    policy = job["policy"]
    if policy == "ampd-window":
        policy, opts["slack"] = "ampd", "window"
    qw = opts.pop("reorder_window", 3)
    slo = job["slo"]
    res = simulate(sess, prof, policy=policy, prefill=job["prefill"], decode=job["decode"],
                   ttft_slo_s=slo["ttft_s"], itl_slo_s=slo["itl_s"], seed=job["seed"],
                   reorder_window=qw, **opts, **job.get("sim", {}))
    rep = sim_report(res, SLO(ttft_s=slo["ttft_s"], itl_s=slo["itl_s"]))
    out = {k: job[k] for k in ("model", "preset", "policy", "rate", "duration", "seed", "prefill", "decode")}
    out["policy"], out["sim_policy"] = job.get("label") or job["policy"], job["policy"]
    out["opts"] = job.get("opts") or {}
    out["sim"] = job.get("sim") or {}
    out.update({
        "sessions": rep["sessions"], "slo_attainment": rep["slo_attainment"],
        "ttft_attainment": rep["ttft_attainment"], "itl_attainment": rep["itl_attainment"],
        "local_fraction": rep["local_fraction"], "ttft_initial_s": _summ(rep["ttft_initial_s"]),
        "ttft_incremental_s": _summ(rep["ttft_incremental_s"]), "itl_s": _summ(rep["itl_s"]),
        "e2e_s": _summ(rep["e2e_s"]), "route_reasons": rep["simulation"].get("route_reasons", {}),
        "kv_overcommits": rep["simulation"].get("kv_overcommits", 0),
        "kv_evictions": rep["simulation"].get("kv_evictions", 0),
        "wall_s": round(time.time() - t0, 3),
    })
    if job.get("itl_stats"):
        from ampd.sim.records import to_session_records
        tt, itl = slo["ttft_s"], slo["itl_s"]
        ok = {"mean": 0, "p90": 0, "p99": 0, "max": 0}
        n = 0
        for s in to_session_records(res):
            n += 1
            ttft_ok = s.completed and all(r.first_token is not None and r.first_token - r.input_ready <= tt + 1e-9
                                          for r in s.rounds)
            gaps = np.concatenate([np.diff(r.token_times) for r in s.rounds if len(r.token_times) > 1] or
                                  [np.zeros(0)])
            if not ttft_ok:
                continue
            if gaps.size == 0:
                for k in ok:
                    ok[k] += 1
                continue
            ok["mean"] += gaps.mean() <= itl + 1e-9
            ok["p90"] += np.percentile(gaps, 90) <= itl + 1e-9
            ok["p99"] += np.percentile(gaps, 99) <= itl + 1e-9
            ok["max"] += gaps.max() <= itl + 1e-9
        out["attainment_by_itl_stat"] = {k: v / max(n, 1) for k, v in ok.items()}
    if job.get("want_remote_rounds"):
        rr = []
        for s in res.sessions:
            for r in s.rounds:
                if r.round > 0 and not r.local:
                    rr.append((s.session_id, r.round))
        out["remote_incremental_rounds"] = rr
    return out


# simulate() keywords every job gets (set from the command line, e.g. --no-kv-overlap)
SIM_OPTS: dict = {}


def run_jobs(jobs, nproc):
    if SIM_OPTS:
        jobs = [dict(j, sim=dict(SIM_OPTS)) for j in jobs]
    if nproc <= 1 or len(jobs) <= 1:
        return [run_point(j) for j in jobs]
    out = [None] * len(jobs)
    t0 = time.time()
    with Pool(min(nproc, 2)) as pool:
        for n, (i, r) in enumerate(pool.imap_unordered(_indexed, list(enumerate(jobs)), chunksize=1), 1):
            out[i] = r
            if n % 50 == 0 or n == len(jobs):
                print(f"    {n}/{len(jobs)} simulations, {time.time() - t0:.0f} s", flush=True)
    return out


def _indexed(ij):
    i, j = ij
    return i, run_point(j)


def _indexed_fn(fij):
    f, i, j = fij
    return i, f(j)


def run_fn(fn, jobs, nproc):
    """``[fn(job) for job in jobs]`` on up to 2 worker processes, in order."""
    if nproc <= 1 or len(jobs) <= 1:
        return [fn(j) for j in jobs]
    out = [None] * len(jobs)
    t0 = time.time()
    with Pool(min(nproc, 2)) as pool:
        for n, (i, r) in enumerate(pool.imap_unordered(_indexed_fn, [(fn, i, j) for i, j in enumerate(jobs)],
                                                       chunksize=1), 1):
            out[i] = r
            print(f"    {n}/{len(jobs)} {fn.__name__}, {time.time() - t0:.0f} s", flush=True)
    return out


def merged(ctx, name, key, new: dict) -> dict:
    """With --merge: ``new`` over the ``key`` dict of ``name`` already in --out (other cases kept)."""
    path = os.path.join(ctx.out, name)
    if not getattr(ctx, "merge", False) or not os.path.exists(path):
        return new
    with open(path) as f:
        old = json.load(f).get(key, {})
    return {**old, **new}


def whole(ctx):
    """ctx over every model x preset the merged results hold (tables and figures of a --merge run)."""
    keys = set(ctx.slos) & set(ctx.rates)
    w = Ctx()
    w.__dict__.update(ctx.__dict__)
    w.models = [m for m in MODELS if any(k.startswith(m + "|") for k in keys)]
    w.presets = [p for p in PRESETS if any(k.endswith("|" + p) for k in keys)]
    return w


def save(out_dir, name, obj):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=float)
    print(f"  wrote {path}", flush=True)


# ---------------------------------------------------------------------------------------------

def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_fig(ctx, fig, name: str, dpi: int) -> None:
    plt = _pyplot()
    fig.tight_layout()
    path = os.path.join(ctx.out, name)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"  wrote {path}", flush=True)


def part_plan(ctx):
    """The planner at each sweep's middle rate (benchmarks/paper_plan.py): ctx.plans and plan.json."""
    from benchmarks.paper_plan import plan_case

    jobs = []
    for m in ctx.models:
        for p in ctx.presets:
            key = f"{m}|{p}"
            rate = plan_rate(ctx, key)
            jobs.append(dict(model=m, preset=p, gpus=GPUS[p], rate=rate, duration=duration_for(p, rate, ctx.quick),
                             slo={k: ctx.slos[key][k] for k in ("ttft_s", "itl_s")},
                             table2=[TABLE2[(m, p)], *TABLE2_ALT[(m, p)]]))
    res = run_fn(plan_case, jobs, ctx.jobs)
    ctx.plans = merged(ctx, "plan.json", "cases", {f"{r['model']}|{r['preset']}": r for r in res})
    save(ctx.out, "plan.json", {"note": "planned on the trace of seed 0 at plan_rate (between the sweep's middle "
                                        "and highest rates; the sweep judges on its own seeds); every candidate "
                                        "simulated on the whole trace",
                                "cases": ctx.plans})

def part_slo(ctx):
    slos = merged(ctx, "slo.json", "slos", {f"{m}|{p}": slo_rule(m, p) for m in ctx.models for p in ctx.presets})
    ctx.slos = slos
    save(ctx.out, "slo.json", {"rule": f"TTFT = {TTFT_K} x P90 over every prefill (initial and incremental) "
                               f"of its standalone time on AMPD's deployment (T_pre at the prefill TP + "
                               f"KV read + write-back); ITL = {ITL_M} x "
                               f"T_dec(tp_D, batch {ITL_BATCH}, {ITL_BATCH} x median round context) at "
                               f"AMPD's decode TP; medians over the preset's trace (seed {SLO_SEED})",
                               "slos": slos})


def _scale_rate(model, preset):
    """Rough sessions/s at which the prefill workers of AMPD's deployment are saturated under `remote`."""
    prof = _profile(model)
    pre, _ = TABLE2[(model, preset)]
    tp = tp_of(pre)
    reps = n_gpus(pre) // tp
    ss = _trace(preset, 1.0, 300.0, 12345)
    work = []
    for s in ss:
        h, w = 0, 0.0
        for r in s.rounds:
            w += prof.t_pre(tp, h, r.input)
            h += r.input + r.output
        work.append(w)
    return reps / float(np.mean(work))


def part_scan(ctx):
    factors = [0.15, 0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0] if not ctx.quick else [0.25, 0.5, 1.0, 1.7]
    jobs, meta = [], {}
    for m in ctx.models:
        for p in ctx.presets:
            key = f"{m}|{p}"
            base = _scale_rate(m, p)
            meta[key] = base
            coloc = coloc_candidates(m, p)
            mid = coloc[len(coloc) // 2]
            for f in factors:
                rate = round(base * f, 4)
                dur = duration_for(p, rate, True)
                for pol in ("ampd", "remote", "colocated"):
                    pre, dec = deployment(m, p, pol, mid)
                    jobs.append(dict(model=m, preset=p, policy=pol, rate=rate, duration=dur, seed=101,
                                     prefill=pre, decode=dec, slo=ctx.slos[key]))
    res = run_jobs(jobs, ctx.jobs)
    rates = {}
    for m in ctx.models:
        for p in ctx.presets:
            key = f"{m}|{p}"
            pts = sorted({r["rate"] for r in res if r["model"] == m and r["preset"] == p})
            att = {rt: [r["slo_attainment"] for r in res if r["model"] == m and r["preset"] == p
                        and r["rate"] == rt] for rt in pts}
            hi_ok = [rt for rt in pts if min(att[rt]) >= 0.8]
            lo_ok = [rt for rt in pts if max(att[rt]) <= 0.3]
            r_lo = max(hi_ok) if hi_ok else pts[0]
            r_hi = min([rt for rt in lo_ok if rt > r_lo], default=pts[-1])
            n = 3 if ctx.quick else 5
            rates[key] = [round(float(x), 4) for x in np.geomspace(r_lo, r_hi, n)]
    ctx.rates = rates
    save(ctx.out, "scan.json", {"scale_rate": meta, "factors": factors, "points": res, "rates": rates,
                                "rule": "r_lo = highest scanned rate where every one of ampd/remote/"
                                        "colocated attains >= 80%; r_hi = lowest higher rate where the "
                                        "best of them attains <= 30%; sweep = geometric between them"})


def _sweep_points(ctx):
    """Every (model, preset, rate, duration, seed) of the sweep, with a job builder bound to it."""
    for m in ctx.models:
        for p in ctx.presets:
            key = f"{m}|{p}"
            for rate in ctx.rates[key]:
                dur = duration_for(p, rate, ctx.quick)
                for seed in ctx.seeds:
                    def job(pol, pre, dec, _m=m, _p=p, _rate=rate, _dur=dur, _seed=seed, _key=key, **extra):
                        return dict(model=_m, preset=_p, policy=pol, rate=_rate, duration=_dur, seed=_seed,
                                    prefill=pre, decode=dec, slo=ctx.slos[_key], **extra)
                    yield m, p, job


def part_sweep(ctx):
    jobs = []
    for m, p, job in _sweep_points(ctx):
        for label in SWEEP_POLICIES:
            pre, dec, pol = dep_for(ctx, m, p, label)
            jobs.append(job(pol, pre, dec, label=label))
    t = time.time()
    res = run_jobs(jobs, ctx.jobs)
    print(f"  sweep: {len(jobs)} simulations in {time.time() - t:.0f} s", flush=True)
    agg = {}
    for r in res:
        agg.setdefault((r["model"], r["preset"], r["policy"], r["rate"]), []).append(r)
    rows = []
    for rs in agg.values():
        row = dict(rs[0])
        row["seeds"] = [x["seed"] for x in rs]
        for f in ("slo_attainment", "ttft_attainment", "itl_attainment", "local_fraction", "sessions"):
            row[f] = float(np.mean([x[f] for x in rs]))
        for f in ("ttft_initial_s", "ttft_incremental_s", "itl_s", "e2e_s"):
            row[f] = {q: float(np.mean([x[f][q] for x in rs])) for q in ("mean", "p50", "p90", "p99")}
        rows.append(row)
    deps = merged(ctx, "sweep.json", "deployments", {
        f"{m}|{p}|{label}": dict(zip(("prefill", "decode", "policy"), dep_for(ctx, m, p, label)))
        for m in ctx.models for p in ctx.presets for label in SWEEP_POLICIES})
    if ctx.merge and os.path.exists(os.path.join(ctx.out, "sweep.json")):
        with open(os.path.join(ctx.out, "sweep.json")) as f:
            ours = {(m, p) for m in ctx.models for p in ctx.presets}
            rows += [r for r in json.load(f)["points"] if (r["model"], r["preset"]) not in ours]
        ctx.sweep = rows
        ctx = whole(ctx)
    rows.sort(key=lambda r: (r["model"], r["preset"], r["policy"], r["rate"]))
    ctx.sweep = rows
    table, gains = gain_table(ctx, rows)
    save(ctx.out, "sweep.json", {"seeds": ctx.seeds, "rates": ctx.rates, "deployments": deps,
                                 "points": rows, "table": table, "gains": gains, "paper": PAPER})
    plot_fig3(ctx, rows)


def _att(rows, m, p, pol, rate):
    for r in rows:
        if r["model"] == m and r["preset"] == p and r["policy"] == pol and r["rate"] == rate:
            return r["slo_attainment"]
    return None


def rel_gain(a, b):
    """Relative gain of a over b in percent; None when b == 0 (undefined)."""
    if b is None or a is None:
        return None
    if b == 0:
        return None if a == 0 else math.inf
    return (a - b) / b * 100.0


def gain_table(ctx, rows):
    table = []
    for m in ctx.models:
        for p in ctx.presets:
            for rate in ctx.rates[f"{m}|{p}"]:
                e = {"model": m, "preset": p, "rate": rate}
                for pol in SWEEP_POLICIES:
                    e[pol] = _att(rows, m, p, pol, rate)
                e["ampd_best"] = all(e["ampd"] >= e[b] - 1e-9 for b in BASELINES)
                table.append(e)
    gains = {}
    for base in (*BASELINES, "ampd-window", "ampd-table2", "ampd-margin"):
        rel, inf_n, both0, diffs = [], 0, 0, []
        for e in table:
            g = rel_gain(e["ampd"], e[base])
            diffs.append((e["ampd"] - e[base]) * 100)
            if g is None:
                both0 += 1
            elif math.isinf(g):
                inf_n += 1
            else:
                rel.append(g)
        per = {}
        for m in ctx.models:
            for p in ctx.presets:
                sub = [rel_gain(e["ampd"], e[base]) for e in table if e["model"] == m and e["preset"] == p]
                fin = [g for g in sub if g is not None and not math.isinf(g)]
                dd = [(e["ampd"] - e[base]) * 100 for e in table if e["model"] == m and e["preset"] == p]
                per[f"{m}|{p}"] = {"mean_rel_pct": float(np.mean(fin)) if fin else None,
                                   "min_rel_pct": float(min(fin)) if fin else None,
                                   "max_rel_pct": float(max(fin)) if fin else None,
                                   "inf_points": sum(1 for g in sub if g is not None and math.isinf(g)),
                                   "mean_abs_pts": float(np.mean(dd))}
        gains[base] = {"mean_rel_pct": float(np.mean(rel)) if rel else None,
                       "median_rel_pct": float(np.median(rel)) if rel else None,
                       "max_rel_pct": float(max(rel)) if rel else None,
                       "min_rel_pct": float(min(rel)) if rel else None,
                       "points": len(table), "points_finite": len(rel),
                       "points_baseline_zero_ampd_positive": inf_n, "points_both_zero": both0,
                       "mean_abs_pts": float(np.mean(diffs)),
                       "ampd_worse_points": sum(1 for d in diffs if d < -1e-6),
                       "per_model_preset": per}
    return table, gains


def plot_fig3(ctx, rows):
    plt = _pyplot()
    styles = {"ampd": ("C3", "o", "-"), "remote": ("C0", "s", "-"), "colocated": ("C2", "^", "-"),
              "continuum": ("C1", "v", "-"), "remote-best": ("C0", "s", ":"), "ampd-table2": ("C3", "o", ":"),
              "ampd-noreorder": ("C4", "x", ":"), "ampd-margin": ("C5", "P", "--"),
              "ampd-window": ("C3", "d", "--")}
    fig, axes = plt.subplots(len(ctx.models), len(ctx.presets),
                             figsize=(4 * len(ctx.presets), 3.2 * len(ctx.models)), squeeze=False)
    for i, m in enumerate(ctx.models):
        for j, p in enumerate(ctx.presets):
            ax = axes[i][j]
            for pol in ["ampd", "ampd-table2", "ampd-window", "ampd-margin", "remote", "remote-best", "colocated",
                        "continuum"]:
                pts = sorted((r["rate"], r["slo_attainment"]) for r in rows
                             if r["model"] == m and r["preset"] == p and r["policy"] == pol)
                if not pts:
                    continue
                c, mk, ls = styles[pol]
                lab = f"{pol} ({_dep_label(rows, m, p, pol)})"
                ax.plot([x for x, _ in pts], [y * 100 for _, y in pts], color=c, marker=mk, ls=ls, label=lab)
            ax.set_title(f"{SHORT[m]} / {p} ({GPUS[p]} GPUs)", fontsize=9)
            ax.set_ylim(-3, 103)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("SLO attainment (%)")
            if i == len(ctx.models) - 1:
                ax.set_xlabel("rate (sessions/s)")
            ax.legend(fontsize=6)
    _save_fig(ctx, fig, "fig3_slo_attainment.png", 110)


def _dep_label(rows, m, p, pol):
    for r in rows:
        if r["model"] == m and r["preset"] == p and r["policy"] == pol:
            return f"P{r['prefill']} D{r['decode']}"
    return "?"


def plan_rate(ctx, key):
    """The rate every deployment is planned at: between the sweep's middle and highest rates (the 4th of
    5 geometric rates). At the middle rate most deployments attain 100 %, which says little about the
    load where they differ; a deployment is sized for the upper part of the range it serves."""
    rs = ctx.rates[key]
    return round(math.sqrt(rs[len(rs) // 2] * rs[-1]), 4)


def mid_rate(ctx, key):
    rs = ctx.rates[key]
    return rs[len(rs) // 2]


def part_breakdown(ctx):
    out = []
    for m in ctx.models:
        for p in ctx.presets:
            rate = mid_rate(ctx, f"{m}|{p}")
            for pol in SWEEP_POLICIES:
                for r in ctx.sweep:
                    if r["model"] == m and r["preset"] == p and r["policy"] == pol and r["rate"] == rate:
                        out.append({"model": m, "preset": p, "rate": rate, "policy": pol,
                                    "deployment": f"P {r['prefill']} / D {r['decode']}",
                                    "slo_attainment": r["slo_attainment"],
                                    "ttft_attainment": r["ttft_attainment"], "itl_attainment": r["itl_attainment"],
                                    "ttft_initial_mean_s": r["ttft_initial_s"]["mean"],
                                    "ttft_incremental_mean_s": r["ttft_incremental_s"]["mean"],
                                    "itl_mean_s": r["itl_s"]["mean"], "itl_p99_s": r["itl_s"]["p99"],
                                    "e2e_mean_s": r["e2e_s"]["mean"], "local_fraction": r["local_fraction"]})
    save(ctx.out, "breakdown.json", {"note": "middle rate of each sweep; means over seeds", "rows": out})
    plt = _pyplot()
    pols = PAPER_POLICIES
    m = ctx.models[0]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    metrics = [("ttft_initial_mean_s", "mean TTFT initial (s)"), ("ttft_incremental_mean_s",
               "mean TTFT incremental (s)"), ("itl_mean_s", "mean ITL (ms)")]
    x = np.arange(len(ctx.presets))
    wdt = 0.8 / len(pols)
    for ax, (f, lab) in zip(axes, metrics):
        for k, pol in enumerate(pols):
            vals = []
            for p in ctx.presets:
                v = [o[f] for o in out if o["model"] == m and o["preset"] == p and o["policy"] == pol]
                vals.append((v[0] * (1000 if f == "itl_mean_s" else 1)) if v else 0)
            ax.bar(x + k * wdt, vals, wdt, label=pol)
        ax.set_xticks(x + wdt * (len(pols) - 1) / 2)
        ax.set_xticklabels([f"{p}\n@{mid_rate(ctx, f'{m}|{p}')}/s" for p in ctx.presets], fontsize=8)
        ax.set_ylabel(lab)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{SHORT[m]}: latency breakdown at each preset's middle sweep rate", fontsize=10)
    _save_fig(ctx, fig, "fig4_breakdown.png", 110)


def part_ablation(ctx):
    out = []
    for m in ctx.models:
        for p in ctx.presets:
            key = f"{m}|{p}"
            for rate in ctx.rates[key]:
                a = {pol: _att(ctx.sweep, m, p, pol, rate) for pol in ("remote", "ampd-noreorder", "ampd",
                                                                        "ampd-window")}
                loc = [r["local_fraction"] for r in ctx.sweep if r["model"] == m and r["preset"] == p
                       and r["policy"] == "ampd" and r["rate"] == rate][0]
                out.append({"model": m, "preset": p, "rate": rate, "middle": rate == mid_rate(ctx, key),
                            **{f"att_{k}": v for k, v in a.items()},
                            "routing_gain_pct": rel_gain(a["ampd-noreorder"], a["remote"]),
                            "reorder_extra_pct": rel_gain(a["ampd"], a["ampd-noreorder"]),
                            "both_pct": rel_gain(a["ampd"], a["remote"]),
                            "ampd_local_fraction": loc})
    save(ctx.out, "ablation.json", {"rows": out, "paper": {k: PAPER[k] for k in PAPER if "ablation" in k}})
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    labels, x = [], 0
    for m in ctx.models:
        for p in ctx.presets:
            row = [o for o in out if o["model"] == m and o["preset"] == p and o["middle"]][0]
            for k, (pol, c) in enumerate([("remote", "C0"), ("ampd-noreorder", "C4"), ("ampd", "C3")]):
                axes[0].bar(x + k * 0.27, row[f"att_{pol}"] * 100, 0.27, color=c,
                            label=pol if x == 0 else None)
            labels.append(f"{SHORT[m][:5]}\n{p}")
            x += 1
    axes[0].set_xticks(np.arange(x) + 0.27)
    axes[0].set_xticklabels(labels, fontsize=6)
    axes[0].set_ylabel("SLO attainment (%) at middle rate")
    axes[0].legend(fontsize=7)
    axes[0].set_title("Ablation: remote -> +routing -> +reordering", fontsize=9)
    # local share per preset (Fig. 5 right): AMPD at the middle rate, per model
    wdt = 0.8 / len(ctx.models)
    for k, m in enumerate(ctx.models):
        vals = [[o for o in out if o["model"] == m and o["preset"] == p and o["middle"]][0]["ampd_local_fraction"]
                * 100 for p in ctx.presets]
        axes[1].bar(np.arange(len(ctx.presets)) + k * wdt, vals, wdt, label=SHORT[m])
    axes[1].scatter(np.arange(len(ctx.presets)) + 0.4 - wdt / 2,
                    [PAPER["local_share"][p] * 100 for p in ctx.presets], color="k", marker="*", s=60,
                    label="paper (Llama, 2 req/s)", zorder=5)
    axes[1].set_xticks(np.arange(len(ctx.presets)) + 0.4 - wdt / 2)
    axes[1].set_xticklabels(ctx.presets)
    axes[1].set_ylabel("prefills run locally (%)")
    axes[1].legend(fontsize=7)
    axes[1].set_title("AMPD local share at the middle rate", fontsize=9)
    _save_fig(ctx, fig, "fig5_ablation_local.png", 110)
    # local share per preset, all rates
    loc = {f"{m}|{p}": {str(r["rate"]): r["local_fraction"] for r in ctx.sweep if r["model"] == m
                        and r["preset"] == p and r["policy"] == "ampd"} for m in ctx.models for p in ctx.presets}
    save(ctx.out, "local_share.json", {"ampd_local_fraction_by_rate": loc, "paper": PAPER["local_share"]})


def part_sensitivity(ctx):
    m, p = "llama3.1-70b@h20", "dureader"
    if m not in ctx.models or p not in ctx.presets:
        m, p = ctx.models[0], ctx.presets[0]
    key = f"{m}|{p}"
    grids = {"w": [1, 2, 3, 4, 5], "alpha": [0.5, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5],
             "beta": [0.5, 0.7, 0.85, 1.0, 1.2, 1.5]}
    rates = ctx.rates[key][1:4] if not ctx.quick else [mid_rate(ctx, key)]
    seeds = ctx.sens_seeds
    jobs = []
    pre, dec = disagg_dep(ctx, m, p)
    for slack in ("queue", "window"):
        for rate in rates:
            dur = duration_for(p, rate, ctx.quick)
            for param, vals in grids.items():
                for v in vals:
                    opts = {"slack": slack}
                    if param == "w":
                        opts["reorder_window"] = v
                    else:
                        opts[param] = v
                    for seed in seeds:
                        jobs.append(dict(model=m, preset=p, policy="ampd", rate=rate, duration=dur, seed=seed,
                                         prefill=pre, decode=dec, slo=ctx.slos[key], opts=opts, param=param,
                                         value=v))
    res = run_jobs(jobs, ctx.jobs)
    rows = {}
    for j, r in zip(jobs, res):
        k = (j["opts"]["slack"], r["rate"], j["param"], j["value"])
        rows.setdefault(k, []).append(r)
    out = [{"slack": k[0], "rate": k[1], "param": k[2], "value": k[3],
            "slo_attainment": float(np.mean([x["slo_attainment"] for x in v])),
            "local_fraction": float(np.mean([x["local_fraction"] for x in v])), "seeds": len(v)}
           for k, v in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3]))]
    save(ctx.out, "sensitivity.json", {"model": m, "preset": p, "rates": rates, "seeds": seeds,
                                       "defaults": {"w": 3, "alpha": 0.9, "beta": 0.85}, "rows": out})
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for ax, param in zip(axes, ["w", "alpha", "beta"]):
        for slack, ls in (("queue", "-"), ("window", "--")):
            for i, rate in enumerate(rates):
                pts = [(o["value"], o["slo_attainment"] * 100) for o in out
                       if o["slack"] == slack and o["rate"] == rate and o["param"] == param]
                ax.plot([a for a, _ in pts], [b for _, b in pts], ls=ls, marker="o", color=f"C{i}",
                        label=f"{rate}/s, slack={slack}")
        ax.set_xlabel(param)
        ax.set_ylabel("SLO attainment (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.suptitle(f"Sensitivity, {SHORT[m]} / {p}, AMPD (solid: our queue slack; dashed: paper's window slack)",
                 fontsize=9)
    _save_fig(ctx, fig, "fig6_sensitivity.png", 110)


def part_itlrule(ctx):
    """How the verdict depends on the ITL statistic the SLO judges: at each middle rate, attainment with
    the session's mean ITL (our rule), its P90 gap, its P99 gap, its max gap <= ITL_thres."""
    jobs = []
    for m in ctx.models:
        for p in ctx.presets:
            key = f"{m}|{p}"
            rate = mid_rate(ctx, key)
            dur = duration_for(p, rate, ctx.quick)
            for label in ("ampd", "remote", "colocated", "continuum"):
                pre, dec, pol = dep_for(ctx, m, p, label)
                jobs.append(dict(model=m, preset=p, policy=pol, label=label, rate=rate, duration=dur,
                                 seed=ctx.seeds[0], prefill=pre, decode=dec, slo=ctx.slos[key], itl_stats=True))
    res = run_jobs(jobs, ctx.jobs)
    rows = [{"model": r["model"], "preset": r["preset"], "rate": r["rate"], "policy": r["policy"],
             "decode": r["decode"], **{f"att_itl_{k}": v for k, v in r["attainment_by_itl_stat"].items()}}
            for r in res]
    save(ctx.out, "itl_rule.json", {"note": "middle rate, seed %d; TTFT rule unchanged" % ctx.seeds[0],
                                    "rows": rows})


def part_chunked(ctx):
    """Beyond the paper: chunked local prefill (simulate(..., chunked_prefill=True)) for AMPD and for the
    co-located baseline (vLLM chunks prefills by default in its V1 engine), at every sweep point."""
    jobs = []
    for m, p, job in _sweep_points(ctx):
        for label in ("ampd", "colocated"):
            pre, dec, pol = dep_for(ctx, m, p, label)
            jobs.append(job(pol, pre, dec, label=label, opts={"chunked_prefill": True}))
    res = run_jobs(jobs, ctx.jobs)
    agg = {}
    for r in res:
        agg.setdefault((r["model"], r["preset"], r["policy"] + "+chunked", r["rate"]), []).append(r)
    rows = []
    for (m, p, pol, rate), rs in sorted(agg.items()):
        base = {x: _att(ctx.sweep, m, p, x, rate) for x in ("ampd", "colocated", "continuum", "remote")}
        rows.append({"model": m, "preset": p, "policy": pol, "rate": rate, "decode": rs[0]["decode"],
                     "slo_attainment": float(np.mean([x["slo_attainment"] for x in rs])),
                     "ttft_attainment": float(np.mean([x["ttft_attainment"] for x in rs])),
                     "itl_attainment": float(np.mean([x["itl_attainment"] for x in rs])),
                     "local_fraction": float(np.mean([x["local_fraction"] for x in rs])),
                     "unchunked": base})
    summ = {}
    for pol, ref in (("ampd+chunked", "ampd"), ("colocated+chunked", "colocated")):
        d = [(r["slo_attainment"] - r["unchunked"][ref]) * 100 for r in rows if r["policy"] == pol]
        summ[pol] = {"mean_abs_pts_vs_unchunked": float(np.mean(d)) if d else None,
                     "min": float(min(d)) if d else None, "max": float(max(d)) if d else None}
    a = {(r["model"], r["preset"], r["rate"]): r["slo_attainment"] for r in rows if r["policy"] == "ampd+chunked"}
    c = {(r["model"], r["preset"], r["rate"]): r["slo_attainment"] for r in rows if r["policy"] == "colocated+chunked"}
    diffs = [(a[k] - max(c[k], _att(ctx.sweep, k[0], k[1], "colocated", k[2]))) * 100 for k in a if k in c]
    summ["ampd+chunked_vs_best_colocated"] = {"mean_abs_pts": float(np.mean(diffs)) if diffs else None,
                                              "worse_points": sum(1 for x in diffs if x < -1e-6),
                                              "points": len(diffs)}
    save(ctx.out, "chunked.json", {"rows": rows, "summary": summ})
    plt = _pyplot()
    fig, axes = plt.subplots(len(ctx.models), len(ctx.presets),
                             figsize=(4 * len(ctx.presets), 3.2 * len(ctx.models)), squeeze=False)
    for i, m in enumerate(ctx.models):
        for j, p in enumerate(ctx.presets):
            ax = axes[i][j]
            for pol, c_, ls, src in (("ampd", "C3", "-", ctx.sweep), ("ampd+chunked", "C3", "--", rows),
                                     ("colocated", "C2", "-", ctx.sweep), ("colocated+chunked", "C2", "--", rows)):
                pts = sorted((r["rate"], r["slo_attainment"]) for r in src
                             if r["model"] == m and r["preset"] == p and r["policy"] == pol)
                ax.plot([x for x, _ in pts], [y * 100 for _, y in pts], color=c_, ls=ls, marker="o", label=pol)
            ax.set_title(f"{SHORT[m]} / {p}", fontsize=9)
            ax.set_ylim(-3, 103)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    _save_fig(ctx, fig, "fig3b_chunked.png", 100)


def part_kvratio(ctx):
    """T_kv/T_pre of incremental prefills on AMPD's deployment: every incremental prefill of the trace
    (as if remote), and the ones AMPD actually sent remote at the middle rate."""
    out = {}
    for m in ctx.models:
        prof = _profile(m)
        for p in ctx.presets:
            key = f"{m}|{p}"
            pre, dec = disagg_dep(ctx, m, p)
            tpp, tpd = tp_of(pre), tp_of(dec)  # the first (largest) group of each phase
            rate = mid_rate(ctx, key)
            dur = duration_for(p, rate, ctx.quick)
            sess = _trace(p, rate, dur, ctx.seeds[0])
            r = run_point(dict(model=m, preset=p, policy="ampd", rate=rate, duration=dur, seed=ctx.seeds[0],
                               prefill=pre, decode=dec, slo=ctx.slos[key], want_remote_rounds=True))
            remote_set = set(map(tuple, r["remote_incremental_rounds"]))
            allr, rem = [], []
            for s in sess:
                h = 0
                for j, rd in enumerate(s.rounds):
                    if j > 0:
                        tkv = prof.t_kv(h, tpd, tpp) + prof.t_kv(rd.input, tpp, tpd)
                        tpre = prof.t_pre(tpp, h, rd.input)
                        x = (tkv / tpre, rd.input)
                        allr.append(x)
                        if (s.id, j) in remote_set:
                            rem.append(x)
                    h += rd.input + rd.output
            out[key] = {"rate": rate, "all_incremental": _bucket(allr), "ampd_remote_incremental": _bucket(rem)}
    save(ctx.out, "kv_ratio.json", {"buckets": [b[2] for b in KV_BUCKETS], "by_tokens": "weighted by l_incr",
                                    "formula": "(T_kv(l_hist, D->P) + T_kv(l_incr, P->D)) / T_pre(P, l_hist, l_incr)",
                                    "results": out})
    plt = _pyplot()
    fig, axes = plt.subplots(len(ctx.models), 2, figsize=(11, 2.8 * len(ctx.models)), squeeze=False)
    labs = [b[2] for b in KV_BUCKETS]
    for i, m in enumerate(ctx.models):
        for j, how in enumerate(("tasks", "tokens")):
            ax = axes[i][j]
            wdt = 0.8 / len(ctx.presets)
            for k, p in enumerate(ctx.presets):
                d = out[f"{m}|{p}"]["all_incremental"][f"by_{how}"]
                ax.bar(np.arange(len(labs)) + k * wdt, [d[b] * 100 for b in labs], wdt, label=p)
            ax.set_xticks(np.arange(len(labs)) + 0.4 - wdt / 2)
            ax.set_xticklabels(labs, fontsize=8)
            ax.set_ylabel(f"% of {how}")
            ax.set_title(f"{SHORT[m]}: T_kv/T_pre of incremental prefills, by {how}", fontsize=9)
            ax.legend(fontsize=7)
    _save_fig(ctx, fig, "fig_kv_ratio.png", 110)


def _bucket(xs):
    res = {"n": len(xs), "by_tasks": {}, "by_tokens": {}}
    if not xs:
        return res
    ratios = np.array([x for x, _ in xs])
    toks = np.array([t for _, t in xs], dtype=float)
    for lo, hi, name in KV_BUCKETS:
        msk = (ratios >= lo) & (ratios < hi)
        res["by_tasks"][name] = float(msk.mean())
        res["by_tokens"][name] = float(toks[msk].sum() / toks.sum())
    res["median_ratio"] = float(np.median(ratios))
    res["mean_ratio"] = float(ratios.mean())
    return res


def part_tightness(ctx):
    """The SLO-tightness sweep (benchmarks/paper_plan.py): tightness.json and fig_tightness.png."""
    from benchmarks import paper_plan as pp

    itls = pp.TIGHT_ITL_S[::2] if ctx.quick else pp.TIGHT_ITL_S
    ttft = slo_rule(pp.TIGHT_MODEL, "gaia")["ttft_s"]
    jobs = [{"kind": k, "itl_s": itl, "ttft_s": ttft, "seeds": ctx.seeds, "quick": ctx.quick}
            for k in ("agent", "mix") for itl in itls]
    res = run_fn(pp.tight_point, jobs, ctx.jobs)
    short = [d for d in res if d["ampd_minus_best_pts"] < -1.0]
    save(ctx.out, "tightness.json", {
        "model": pp.TIGHT_MODEL, "gpus": pp.TIGHT_GPUS, "ttft_s": ttft, "itl_s": list(itls),
        "traces": {"agent": f"gaia-like sessions at {pp.AGENT_RATE}/s",
                   "mix": f"gaia-like sessions at {pp.MIX_AGENT_RATE}/s + short chats at {pp.MIX_CHAT_RATE}/s"},
        "duration_s": pp.TIGHT_DURATION_S / 2 if ctx.quick else pp.TIGHT_DURATION_S, "plan_seed": pp.PLAN_SEED,
        "goal": "ampd >= best baseline - 1 point at every point",
        "points_short_of_goal": [(d["kind"], d["itl_s"]) for d in short], "points": res})
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, kind in zip(axes, ("agent", "mix")):
        pts = [d for d in res if d["kind"] == kind]
        for lab, c, ls in (("ampd", "C3", "-"), ("ampd-margin", "C5", "--"), ("remote", "C0", "-"),
                           ("colocated", "C2", "-"), ("continuum", "C1", "-")):
            ax.plot([d["itl_s"] * 1000 for d in pts], [d["attainment"][lab] * 100 for d in pts], color=c, ls=ls,
                    marker="o", label=lab)
        ax.set_xlabel("ITL threshold (ms), tight -> lenient")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_title(f"{SHORT[pp.TIGHT_MODEL]}, {pp.TIGHT_GPUS} GPUs, {kind} trace", fontsize=9)
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save_fig(ctx, fig, "fig_tightness.png", 110)


def _git_head() -> str:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


class Ctx:
    pass


# In run order; "tightness" needs only "slo"'s rule and runs right after the sweep.
PARTS = ["slo", "scan", "plan", "sweep", "tightness", "breakdown", "ablation", "sensitivity", "itlrule", "kvratio",
         "chunked"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small subset: Llama only, 3 rates, 1 seed, short traces")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (at most 2 are used)")
    ap.add_argument("--out", default="benchmarks/results/paper")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--seeds", default="1,2", help="trace/router seeds of the sweep, comma list")
    ap.add_argument("--sens-seeds", default="1,2,3")
    ap.add_argument("--reuse", action="store_true", help="reuse slo/scan/sweep JSON in --out when present")
    ap.add_argument("--merge", action="store_true",
                    help="slo/plan/sweep: rerun --models x --presets only and keep the other cases already in --out")
    ap.add_argument("--no-kv-overlap", action="store_true",
                    help="prefill workers read the next task's history KV only when it starts (no overlap)")
    a = ap.parse_args(argv)
    if a.no_kv_overlap:
        SIM_OPTS["kv_overlap"] = False
    ctx = Ctx()
    ctx.quick, ctx.jobs, ctx.out, ctx.merge = a.quick, max(1, min(a.jobs, 2)), a.out, a.merge
    ctx.models = a.models.split(",") if not a.quick else ["llama3.1-70b@h20"]
    ctx.presets = a.presets.split(",")
    ctx.seeds = [int(s) for s in a.seeds.split(",")][:1] if a.quick else [int(s) for s in a.seeds.split(",")]
    ctx.sens_seeds = [int(s) for s in a.sens_seeds.split(",")] if not a.quick else [1]
    parts = a.parts.split(",")
    t0 = time.time()
    timings = {}

    def load(name):
        path = os.path.join(ctx.out, name)
        with open(path) as f:
            return json.load(f)

    for part in PARTS:
        t = time.time()
        if part == "slo":
            part_slo(ctx)
        elif part == "scan":
            if part in parts and not (a.reuse and os.path.exists(os.path.join(ctx.out, "scan.json"))):
                part_scan(ctx)
            else:
                ctx.rates = load("scan.json")["rates"]
        elif part == "plan":
            if part in parts and not (a.reuse and os.path.exists(os.path.join(ctx.out, "plan.json"))):
                part_plan(ctx)
            else:
                ctx.plans = load("plan.json")["cases"]
        elif part == "sweep":
            if part in parts and not (a.reuse and os.path.exists(os.path.join(ctx.out, "sweep.json"))):
                part_sweep(ctx)
            else:
                ctx.sweep = load("sweep.json")["points"]
        elif part in parts:
            {"breakdown": part_breakdown, "ablation": part_ablation, "sensitivity": part_sensitivity,
             "kvratio": part_kvratio, "itlrule": part_itlrule, "chunked": part_chunked,
             "tightness": part_tightness}[part](ctx)
        timings[part] = round(time.time() - t, 1)
        print(f"[{part}] {timings[part]} s", flush=True)
    meta = {"argv": sys.argv, "sim_options": SIM_OPTS, "timings_s": timings, "total_s": round(time.time() - t0, 1),
            "git_head": _git_head()}
    prev = os.path.join(ctx.out, "run_meta.json")
    runs = []
    if os.path.exists(prev):
        try:
            old = load("run_meta.json")
            runs = old.get("runs", [{k: v for k, v in old.items() if k != "runs"}])
        except (OSError, ValueError):
            runs = []
    meta["runs"] = runs + [{k: v for k, v in meta.items() if k != "runs"}]
    save(ctx.out, "run_meta.json", meta)


if __name__ == "__main__":
    main()
