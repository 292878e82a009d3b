"""Plan a deployment: estimates -> ILP top candidates -> a whole-deployment simulation of each.

Pure: takes the profile and the sessions as values, reports progress through a callback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .estimates import SAMPLE_SESSIONS, EstimateCache, Estimates, build_estimates, outcome, trace_fingerprint
from .ilp import finalists
from .objective import evaluate
from .space import Deployment, PlanError, feasible_degrees

__all__ = ["PlanRequest", "PlanEntry", "PlanResult", "plan", "default_slo", "resolve_slo", "search_space", "check",
           "family_candidates", "check_policy", "FINALISTS_EXTRA", "CHECK_SESSIONS", "max_context", "SLO_TTFT_K", "SLO_ITL_M"]

# Default SLO when the request gives none: the rule of docs/paper-results.md ("SLO rule"), taken at the
# largest degree a prefill and a decode replica can both use.
SLO_TTFT_K = 3.0   # TTFT threshold = K x P90 of the standalone prefill time of every round
SLO_ITL_M = 3.0    # ITL threshold = M x one decode step at batch SLO_ITL_BATCH, median round context
SLO_ITL_BATCH = 32

FINALISTS_EXTRA = 1  # finalists simulated beyond --top by default (the ILP's next best)
CHECK_SESSIONS = 250  # sessions a check simulates by default (the first by arrival; 0: the whole trace)

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class PlanRequest:
    profile: object            # ampd.perf.Profile
    sessions: Sequence         # ampd.workload.Session
    gpus: int
    slo: object                # ampd.bench.report.SLO
    top: int = 3
    policy: str = "ampd"       # the policy the candidates are checked with
    colocated: bool = True     # search co-located deployments (no prefill workers) too
    mixed: bool = True         # a phase may mix TP degrees (False: one degree per phase, like Table 2)
    all_gpus: bool = False     # use exactly `gpus` GPUs (C3 as an equality, as every Table 2 entry does)
    candidates: int = 0        # ILP finalists to simulate (0: top + FINALISTS_EXTRA)
    check_sessions: int = CHECK_SESSIONS  # simulate the first this many sessions in the checks (0: all)
    sample_sessions: int = SAMPLE_SESSIONS  # sessions the closed-form estimates draw from the trace
    seed: int = 0
    skip_dominated: bool = True  # do not simulate a candidate skippable() shows cannot rank (False: all)


@dataclass(frozen=True)
class PlanEntry:
    deployment: Deployment
    policy: str                # policy of the check simulation
    slo_attainment: float      # of the check simulation
    p95_s: float               # P95 TTFT of the check simulation
    p95_itl_s: float           # P95 over sessions of the mean ITL, check simulation
    objective: float           # the ILP's objective (estimated worst P95 / SLO threshold)
    levels: dict = field(default_factory=dict)  # kind -> estimated utilisation level
    spill: float = 0.0         # the estimated share of a decode replica's time on local prefills
    seconds: float = 0.0       # of the check simulation (0: from the cache)

    def to_json(self) -> dict:
        d = self.deployment
        return {"prefill": d.prefill_spec, "decode": d.decode_spec, "p95_s": _num(self.p95_s),
                "slo_attainment": self.slo_attainment, "gpus": d.gpus, "policy": self.policy,
                "p95_itl_s": _num(self.p95_itl_s),
                "estimate": {"worst_p95_over_slo": round(self.objective, 6), "utilisation": self.levels,
                             "local_prefill_share": self.spill},
                "simulation_s": round(self.seconds, 4)}


@dataclass(frozen=True)
class PlanResult:
    gpus: int
    top: list[PlanEntry]
    degrees: tuple[int, ...]
    slo: object
    candidates: int            # deployments the ILP proposed and the simulator checked
    estimates: Estimates
    skipped: int = 0           # deployments the ILP proposed that were not simulated (skippable)
    solves: list = field(default_factory=list)  # one {"family", "status", "seconds", "nodes"} per SCIP solve
    solve_s: float = 0.0       # the ILP's seconds, SCIP and the model's build
    simulation_s: float = 0.0  # the check simulations' seconds
    simulations: int = 0       # check simulations run (the others came from the cache)
    policy: str = "ampd"

    def to_json(self, seconds: float) -> dict:
        return {"gpus": self.gpus, "seconds": round(seconds, 4), "top": [e.to_json() for e in self.top],
                "degrees": list(self.degrees), "slo": {"ttft_s": self.slo.ttft_s, "itl_s": self.slo.itl_s},
                "policy": self.policy, "colocated_form": _colocated_form(self.policy), "solver": "scip", "solver_calls": len(self.solves), "solves": self.solves,
                "timings": {"estimates_s": round(self.estimates.seconds, 4), "solve_s": round(self.solve_s, 4),
                            "simulations_s": round(self.simulation_s, 4), "simulations": self.simulations},
                "candidates_checked": self.candidates, "candidates_skipped": self.skipped}


def _colocated_form(policy: str) -> str:
    from ampd.policy import policy_spec

    return policy_spec(policy).on_colocated()


def _num(x: float):
    return x if math.isfinite(x) else None


def _percentile(xs, q: float) -> float:
    """numpy's default ("linear") percentile, without importing numpy."""
    s = sorted(xs)
    h = (len(s) - 1) * q / 100.0
    lo = math.floor(h)
    return float(s[lo] + (h - lo) * (s[min(lo + 1, len(s) - 1)] - s[lo]))


def max_context(sessions) -> int:
    return max(s.context_tokens for s in sessions)


def default_slo(profile, sessions, degree: int):
    """The default thresholds on this workload at ``degree`` (see SLO_TTFT_K, SLO_ITL_M)."""
    from ampd.bench.report import SLO

    pre, ctxs = [], []
    for s in sessions:
        h = 0
        for r in s.rounds:
            pre.append(profile.t_pre(degree, h, r.input))
            ctxs.append(h + r.input + r.output // 2)
            h += r.input + r.output
    ctx = _percentile(ctxs, 50)
    ttft = SLO_TTFT_K * _percentile(pre, 90)
    itl = SLO_ITL_M * profile.t_dec(degree, SLO_ITL_BATCH, int(SLO_ITL_BATCH * ctx))
    return SLO(ttft_s=round(ttft, 3), itl_s=round(itl, 4))


def resolve_slo(profile, sessions, gpus: int, ttft_s: float | None, itl_s: float | None):
    """The request's SLO: the thresholds given, else the default rule at the largest degree that leaves
    room for a replica of each phase (docs/planner.md, "Default SLO")."""
    from ampd.bench.report import SLO

    for name, v in (("ttft_slo", ttft_s), ("itl_slo", itl_s)):
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise PlanError(name, f"must be a number > 0 seconds, got {v!r}")
    if not sessions:
        raise PlanError("trace", "the trace has no sessions")
    degrees = feasible_degrees(profile, gpus, max_context(sessions))
    fit = [n for n in degrees if 2 * n <= gpus] or [min(degrees)]
    rule = default_slo(profile, sessions, max(fit))
    return SLO(ttft_s=ttft_s if ttft_s is not None else rule.ttft_s, itl_s=itl_s if itl_s is not None else rule.itl_s)


def search_space(req: PlanRequest) -> tuple[tuple[int, ...], bool, bool]:
    """(degrees, disaggregated, colocated) of the request; PlanError names the field at fault."""
    from ampd.policy import policy_spec

    if not req.sessions:
        raise PlanError("trace", "the trace has no sessions")
    for name in ("top", "sample_sessions"):
        v = getattr(req, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(name, f"must be an integer >= 1, got {v!r}")
    for name, zero in (("candidates", "the default"), ("check_sessions", "the whole trace")):
        v = getattr(req, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PlanError(name, f"must be an integer >= 0 (0: {zero}), got {v!r}")
    try:
        spec = policy_spec(req.policy)
    except ValueError as exc:
        raise PlanError("policy", str(exc)) from None
    degrees = feasible_degrees(req.profile, req.gpus, max_context(req.sessions))
    disagg = spec.uses_prefill_workers
    coloc = req.colocated or not disagg
    if disagg and not coloc and req.gpus < 2 * min(degrees):
        raise PlanError("gpus", f"{req.gpus} GPUs cannot hold one prefill and one decode replica of "
                                f"{req.profile.name}: the smallest replica that holds the model needs "
                                f"{min(degrees)} GPUs (allow co-located deployments to plan one replica)")
    if disagg and req.gpus < 2 * min(degrees):
        disagg = False  # one replica fits: only co-location remains
    return degrees, disagg, coloc


def check(req: PlanRequest, dep: Deployment) -> tuple[str, float, float, float]:
    """(policy, SLO attainment, P95 TTFT, P95 mean ITL) of ``dep`` simulated on the request's trace."""
    from ampd.sim import simulate

    policy = check_policy(req, dep)
    sessions = sorted(req.sessions, key=lambda s: s.arrival)
    if req.check_sessions:
        sessions = sessions[: req.check_sessions]
    res = simulate(sessions, req.profile, policy=policy, prefill=dep.prefill_spec, decode=dep.decode_spec,
                   ttft_slo_s=req.slo.ttft_s, itl_slo_s=req.slo.itl_s, seed=req.seed)
    att, ttft, itl, _ = outcome(res, req.slo)
    return policy, att, ttft, itl


def check_policy(req: PlanRequest, dep: Deployment) -> str:
    """The policy ``dep`` runs under: the request's, but a co-located deployment runs the request's
    co-located form (``PolicySpec.on_colocated``: ``ampd`` -> ``ampd-colocated``, whose decode
    workers keep Algorithm 2's order; a policy that names none -> ``colocated``)."""
    from ampd.policy import policy_spec

    return req.policy if not dep.colocated else policy_spec(req.policy).on_colocated()


def headroom(e: "PlanEntry", slo) -> float:
    """The tie-break between deployments of equal simulated attainment: the worse of P95 TTFT / TTFT
    threshold and P95 mean ITL / ITL threshold (lower is better; the ILP's objective, measured). P95
    TTFT alone would prefer co-location at large TP (its prefills are fastest) where its ITL is
    nearly spent."""
    worst = max(e.p95_s / slo.ttft_s, e.p95_itl_s / slo.itl_s)
    return worst if math.isfinite(worst) else math.inf


def family_candidates(est, gpus: int, degrees, k: int, *, disaggregated: bool, colocated: bool, mixed: bool,
                      all_gpus: bool, log: list | None = None) -> list:
    """The finalists: the ILP's ``k`` best over the search space, plus the best of each family
    (co-located, disaggregated) when the ``k`` best lack it (``ilp.finalists``: one model, ``k``
    SCIP solves and one more per missing family), so AMPD's finalists hold the
    deployment a baseline's plan of one family (``remote``: disaggregated, ``colocated``: co-located)
    would choose first by the ILP, and AMPD can become that baseline's deployment where it wins
    (docs/planner.md, "Never lose to a baseline")."""
    return finalists(est, gpus, degrees, k, disaggregated=disaggregated, colocated=colocated, mixed=mixed,
                     all_gpus=all_gpus, log=log)


def holds(big: Deployment, small: Deployment) -> bool:
    """``big`` runs every replica ``small`` runs, and more: same family (co-located or not), at least
    as many replicas of each (phase, degree)."""
    if big == small or big.colocated != small.colocated:
        return False
    bp, bd = dict(big.prefill), dict(big.decode)
    return all(bp.get(n, 0) >= c for n, c in small.prefill) and all(bd.get(n, 0) >= c for n, c in small.decode)


def check_order(cands) -> list[int]:
    """Indices of ``cands`` in the order they are checked: every deployment that no other candidate
    holds first (the ILP's order), then the others, most GPUs first, so a deployment is checked after
    every candidate that holds it (:func:`skippable`)."""
    deps = [d for _, d in cands]
    held = [any(holds(b, d) for b in deps) for d in deps]
    rest = sorted((i for i in range(len(deps)) if held[i]), key=lambda i: -deps[i].gpus)
    return [i for i in range(len(deps)) if not held[i]] + rest


def skippable(dep: Deployment, entries, top: int) -> bool:
    """Whether checking ``dep`` cannot change the top ``top``: a checked deployment that holds it
    already attains less than the ``top``-th best checked one. The premise: adding replicas to a
    deployment does not lower its simulated attainment (more capacity for the same trace), so ``dep``
    attains less than that too and ranks below the top ``top`` (ties go by attainment first, so
    strictly less is enough). In deep overload it can fail by a few sessions (docs/planner.md §2)."""
    if len(entries) < top:
        return False
    bound = [e.slo_attainment for e in entries if holds(e.deployment, dep)]
    if not bound:
        return False
    kth = sorted((e.slo_attainment for e in entries), reverse=True)[top - 1]
    return min(bound) < kth


def plan(req: PlanRequest, *, cache: EstimateCache | None = None, progress: Progress | None = None) -> PlanResult:
    """The ``req.top`` best deployments: the ILP's best ``candidates`` by estimated worst P95 (closed-form
    estimates under ``req.policy``, solved by SCIP), each simulated whole on the trace under the policy
    that will run (but those :func:`skippable` shows cannot rank, with ``req.skip_dominated``) and
    ranked by simulated SLO attainment, then by the worse of P95 TTFT and P95 mean ITL over their
    thresholds (:func:`headroom`). ``cache`` keeps the check simulations for a later plan of the trace."""
    import time

    degrees, disagg, coloc = search_space(req)
    kinds = (("prefill", "decode") if disagg else ()) + (("colocated",) if coloc else ())
    est = build_estimates(req.profile, req.sessions, degrees, req.slo, kinds=kinds, policy=req.policy,
                          sample_size=req.sample_sessions)
    if progress is not None:
        progress("estimates", 1, 1)
    n_cand = req.candidates or req.top + FINALISTS_EXTRA
    solves: list = []
    t0 = time.perf_counter()
    cands = family_candidates(est, req.gpus, degrees, max(n_cand, req.top), disaggregated=disagg,
                              colocated=coloc, mixed=req.mixed, all_gpus=req.all_gpus, log=solves)
    solve_s = time.perf_counter() - t0
    if not cands:
        raise PlanError("gpus", f"no deployment of degrees {list(degrees)} uses exactly {req.gpus} GPUs")
    from ampd.sim.gcpause import gc_paused

    entries, rank = [], {}
    key0 = None if cache is None else (req.profile.name, req.profile.source, trace_fingerprint(req.sessions),
                                       req.slo.ttft_s, req.slo.itl_s, req.check_sessions, req.seed)
    with gc_paused():  # the checks' records die by reference counting; a collection would walk every live object
        _check_all(req, est, cands, entries, rank, progress, cache, key0)
    # full ties keep the candidates' order, whatever order they were checked in
    entries.sort(key=lambda e: (-e.slo_attainment, headroom(e, req.slo), e.objective, rank[e.deployment]))
    return PlanResult(gpus=req.gpus, top=entries[: req.top], degrees=degrees, slo=req.slo,
                      candidates=len(entries), estimates=est, skipped=len(cands) - len(entries), solves=solves,
                      solve_s=solve_s, simulation_s=sum(e.seconds for e in entries),
                      simulations=sum(e.seconds > 0 for e in entries), policy=req.policy)


def _check_all(req: PlanRequest, est, cands, entries: list, rank: dict, progress: Progress | None,
               cache: EstimateCache | None, key0) -> None:
    """Simulate the candidates in :func:`check_order`, skipping the :func:`skippable` ones."""
    import time

    for done, i in enumerate(check_order(cands)):
        if progress is not None:
            progress("checks", done, len(cands))
        obj, dep = cands[i]
        if req.skip_dominated and skippable(dep, entries, req.top):
            continue
        policy = check_policy(req, dep)
        key = None if key0 is None else key0 + (policy, dep.prefill_spec, dep.decode_spec)
        hit = cache.get(key) if key is not None else None
        t0 = time.perf_counter()
        if hit is None:
            _, att, p95, p95_itl = check(req, dep)
            secs = time.perf_counter() - t0
            if key is not None:
                cache.put(key, (att, p95, p95_itl))
        else:
            (att, p95, p95_itl), secs = hit, 0.0
        _, _, lv, j = evaluate(dep, est, req.gpus)
        levels = {k: est.levels[l] if math.isfinite(est.levels[l]) else "overload" for k, l in lv.items()}
        entries.append(PlanEntry(dep, policy, att, p95, p95_itl, obj, levels, est.spills[j] if "decode" in lv else 0.0,
                                 secs))
        rank[dep] = i
    if progress is not None:
        progress("checks", len(cands), len(cands))
