"""The planning ILP (docs/planner.md, "Formulation"), solved with SCIP through pyscipopt.

Variables, for each kind k in {prefill, decode, colocated} and degree n:
  cnt[k,n] in Z>=0   replicas (the paper's x(n) for prefill, y(n) for decode)
  act[k,n] in {0,1}  the replica type is instantiated: act <= cnt <= ub * act
  u[k,l]   in {0,1}  the utilisation level of kind k's replicas (exactly one per kind in use)
  co       in {0,1}  co-located deployment (no prefill workers)
  W[k]     >= 0      the worst normalised P95 of kind k's replicas; Z >= W[k] the worst over all
minimize  Z + EPS_BALANCE * sum_k W[k] + EPS_UNUSED * (N - GPUs used) / N
s.t.  W[k] >= tau[k,n,l] - M (2 - act[k,n] - u[k,l]), Z >= W[k]   (the paper's C1, C2 with activation)
      sum_n n (cnt[prefill,n] + cnt[decode,n] + cnt[colocated,n]) <= N       (C3)
      sum_n cnt[k,n] c[k,n] / rate >= sum_l u[k,l] / rho_l    (level l bounds the utilisation)
      sum_n cnt[prefill,n] >= 1 - co, sum_n cnt[decode,n] >= 1 - co, sum_n cnt[colocated,n] >= co
      cnt[prefill|decode,n] <= ub (1 - co), cnt[colocated,n] <= ub co
      sum_l u[prefill|decode,l] = 1 - co, sum_l u[colocated,l] = co
The k best deployments come from re-solving with a no-good cut on each one found.

A space of at most ENUMERATE_MAX deployments is solved by enumerating it instead
(:func:`best_deployments`): the same objective (``objective.surrogate``), hence the same optimum and
k best, for a fraction of a SCIP solve's cost.
"""
from __future__ import annotations

import math
from typing import Sequence

from .estimates import Estimates
from .objective import EPS_BALANCE, EPS_UNUSED, brute_force_top
from .space import KINDS, Deployment

__all__ = ["solve_top", "best_deployments", "space_size", "ENUMERATE_MAX"]

# Spaces up to this many deployments are enumerated, not solved. Scoring one deployment costs ~8 us
# (2,000: ~16 ms), SCIP's 6 best of a family 14-20 ms (benchmarks/results/planner_time.json, 8 and 16
# GPUs, Llama3.1-70B, degrees 2/4/8: 13 and 169 disaggregated deployments). Above it SCIP's time
# barely grows with N while the space does (2,982 disaggregated deployments at 32 GPUs, 77,692 at 64).
ENUMERATE_MAX = 2000


def space_size(gpus: int, degrees: Sequence[int], *, disaggregated: bool = True, colocated: bool = True,
               mixed: bool = True, all_gpus: bool = False) -> int:
    """How many deployments ``objective.enumerate_deployments`` yields for this space, counted
    without listing them."""
    # h[c]: non-empty replica-count vectors over the degrees (one degree only unless mixed) using c GPUs
    h = [0] * (gpus + 1)
    if mixed:
        h[0] = 1
        for n in degrees:  # coin-change count: vectors over the degrees so far
            for c in range(n, gpus + 1):
                h[c] += h[c - n]
        h[0] = 0
    else:
        for n in degrees:
            for c in range(n, gpus + 1, n):
                h[c] += 1
    total = 0
    if disaggregated:
        if all_gpus:
            total += sum(h[a] * h[gpus - a] for a in range(1, gpus))
        else:
            upto = [0] * (gpus + 1)  # upto[b]: non-empty vectors using at most b GPUs
            for b in range(1, gpus + 1):
                upto[b] = upto[b - 1] + h[b]
            total += sum(h[a] * upto[gpus - a] for a in range(1, gpus))
    if colocated:
        total += h[gpus] if all_gpus else sum(h)
    return total


def best_deployments(est: Estimates, gpus: int, degrees: Sequence[int], k: int, *, disaggregated: bool = True,
                     colocated: bool = True, mixed: bool = True, all_gpus: bool = False) -> list[tuple[float, Deployment]]:
    """The ``k`` best deployments by the ILP's objective, best first: by enumeration when the space
    holds at most ENUMERATE_MAX deployments (exact; ties to the lower worst utilisation, see
    ``objective.brute_force_top``), else by SCIP (ties arbitrary)."""
    space = dict(disaggregated=disaggregated, colocated=colocated, mixed=mixed, all_gpus=all_gpus)
    if not (disaggregated or colocated):
        raise ValueError("search space: allow disaggregated and/or co-located deployments")
    if space_size(gpus, degrees, **space) <= ENUMERATE_MAX:
        return brute_force_top(est, gpus, degrees, k, **space)
    return solve_top(est, gpus, degrees, k, **space)


def solve_top(est: Estimates, gpus: int, degrees: Sequence[int], k: int, *, disaggregated: bool = True,
              colocated: bool = True, mixed: bool = True, all_gpus: bool = False) -> list[tuple[float, Deployment]]:
    """The ``k`` best deployments by the ILP's objective, best first (fewer if the space is smaller)."""
    if not (disaggregated or colocated):
        raise ValueError("search space: allow disaggregated and/or co-located deployments")
    m, cnt, _ = _model(est, gpus, degrees, disaggregated, colocated, mixed, all_gpus)
    return _top(m, cnt, k, [])


def _model(est, gpus, degrees, disaggregated, colocated, mixed, all_gpus):
    from pyscipopt import SCIP_PARAMSETTING, Model, quicksum

    m = Model("ampd-plan")
    m.hideOutput()
    # The model is small (tens of integers): SCIP's presolve, cutting planes, primal heuristics and
    # symmetry detection cost more than the branching they save (measured: 6 solves at 256 GPUs,
    # 0.44 s -> 0.12 s), and so do timing every plugin and the default branching rule's strong
    # branching (most-infeasible branching instead: 12 solves at 8 GPUs, ~65 -> ~45 ms CPU).
    m.setPresolve(SCIP_PARAMSETTING.OFF)
    m.setSeparating(SCIP_PARAMSETTING.OFF)
    m.setHeuristics(SCIP_PARAMSETTING.OFF)
    m.setParam("misc/usesymmetry", 0)
    m.setParam("timing/enabled", False)
    m.setParam("branching/mostinf/priority", 100000)
    m.setParam("limits/gap", 0.0)
    m.setParam("limits/absgap", 0.0)
    kinds = [kd for kd in KINDS if (kd == "colocated" and colocated) or (kd != "colocated" and disaggregated)]
    co = m.addVar("co", vtype="B", lb=1 if not disaggregated else 0, ub=0 if not colocated else 1)
    z = m.addVar("Z", vtype="C", lb=0.0)
    cnt, act, w = {}, {}, {}
    for kd in kinds:
        w[kd] = m.addVar(f"W_{kd}", vtype="C", lb=0.0)
        m.addCons(z >= w[kd])
        on = co if kd == "colocated" else 1 - co
        for n in degrees:
            ub = gpus // n
            cnt[kd, n] = m.addVar(f"cnt_{kd}_{n}", vtype="I", lb=0, ub=ub)
            act[kd, n] = m.addVar(f"act_{kd}_{n}", vtype="B")
            m.addCons(cnt[kd, n] <= ub * act[kd, n])
            m.addCons(cnt[kd, n] >= act[kd, n])
            m.addCons(cnt[kd, n] <= ub * on)
        m.addCons(quicksum(cnt[kd, n] for n in degrees) >= on)
        if not mixed:
            m.addCons(quicksum(act[kd, n] for n in degrees) <= 1)
        u = {l: m.addVar(f"u_{kd}_{l}", vtype="B") for l in range(len(est.levels))}
        m.addCons(quicksum(u.values()) == on)
        need = quicksum(u[l] / rho for l, rho in enumerate(est.levels) if not math.isinf(rho))
        m.addCons(quicksum(cnt[kd, n] * (est.capacity[kd][n] / est.rate) for n in degrees) >= need)
        for n in degrees:  # u selects one level, so the sum is tau at that level (tighter than big-M per level)
            taus = est.tau[kd][n]
            m.addCons(w[kd] >= quicksum(t * u[l] for l, t in enumerate(taus)) - max(taus) * (1 - act[kd, n]))
    used = quicksum(n * v for (kd, n), v in cnt.items())
    m.addCons(used == gpus) if all_gpus else m.addCons(used <= gpus)
    m.setObjective(z + EPS_BALANCE * quicksum(w.values()) + EPS_UNUSED * (gpus - used) / gpus, "minimize")
    return m, cnt, co


def _top(m, cnt, k: int, found: list) -> list[tuple[float, Deployment]]:
    """Solve, cut off the solution, solve again, until ``found`` holds ``k`` deployments."""
    while len(found) < k:
        m.optimize()
        if m.getStatus() != "optimal":
            m.freeTransform()  # the family is exhausted; the model stays editable for the next one
            break
        obj = m.getObjVal()
        sol = {key: int(round(m.getVal(v))) for key, v in cnt.items()}
        pre = {n: c for (kd, n), c in sol.items() if kd == "prefill"}
        dec = {n: c for (kd, n), c in sol.items() if kd == "decode" and c}
        dec.update({n: c for (kd, n), c in sol.items() if kd == "colocated" and c})  # one of the two is empty
        found.append((obj, Deployment.of(pre, dec)))
        m.freeTransform()
        _exclude(m, cnt, sol, len(found))
    return found


def _exclude(m, cnt, sol, tag: int) -> None:
    """No-good cut: some replica count must differ from ``sol`` (up by one or down by one at least)."""
    from pyscipopt import quicksum

    moves = []
    for key, v in cnt.items():
        star, ub = sol[key], int(v.getUbOriginal())
        if star < ub:
            up = m.addVar(f"up{tag}_{key[0]}_{key[1]}", vtype="B")
            m.addCons(v >= (star + 1) * up)
            moves.append(up)
        if star > 0:
            down = m.addVar(f"dn{tag}_{key[0]}_{key[1]}", vtype="B")
            m.addCons(v <= star - 1 + ub * (1 - down))
            moves.append(down)
    m.addCons(quicksum(moves) >= 1)
