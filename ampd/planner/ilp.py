"""The planning ILP (docs/planner.md, "Formulation"), solved with SCIP through pyscipopt at every size.

Variables, for each kind k in {prefill, decode, colocated} and degree n:
  cnt[k,n] in Z>=0   replicas (the paper's x(n) for prefill, y(n) for decode)
  act[k,n] in {0,1}  the replica type is instantiated: act <= cnt <= ub * act
  u[k,l]   in {0,1}  the utilisation level of kind k's replicas (exactly one per kind in use)
  v[j]     in {0,1}  the share SPILLS[j] of a decode replica's time on local prefills (one, if decode in use)
  g[n,i]   in {0,1}  the prefill replicas of degree n form a pool of at least POOLS[i] (one per active n)
  s        >= 0      sessions/s whose prefills run on their decode replica (0 unless the policy routes locally)
  co       in {0,1}  co-located deployment (no prefill workers)
  W[k]     >= 0      the worst normalised P95 of kind k's replicas; Z >= W[k] the worst over all
minimize  Z + EPS_BALANCE * sum_k W[k] + EPS_UNUSED * (N - GPUs used) / N
s.t.  W[k] >= tau[k,n,l(,j|i)] when act[k,n], u[k,l] (and v[j] or g[n,i]) are on   (the paper's C1, C2)
      cnt[prefill,n] >= POOLS[i] g[n,i]
      sum_n n (cnt[prefill,n] + cnt[decode,n] + cnt[colocated,n]) <= N       (C3)
      rate - s <= rho_l sum_n cnt[prefill,n] c[prefill,n]  when u[prefill,l]   (level l bounds the utilisation)
      rate     <= rho_l sum_n cnt[k,n] c[k,n]              when u[k,l], k in {decode, colocated}
      s <= SPILLS[j] sum_n cnt[decode,n] c[prefill,n]      when v[j]   (a decode replica prefills at c[prefill,n])
      sum_n cnt[prefill,n] >= 1 - co, sum_n cnt[decode,n] >= 1 - co, sum_n cnt[colocated,n] >= co
      cnt[prefill|decode,n] <= ub (1 - co), cnt[colocated,n] <= ub co
The k best deployments come from re-solving with a no-good cut on each one found. Every solve is
logged (status, seconds, nodes): ``ampd plan --json`` reports them. ``objective.brute_force_top``
enumerates the same objective: the tests' oracle, never the planner's answer.
"""
from __future__ import annotations

import math
import time
from typing import Sequence

from .estimates import Estimates
from .objective import EPS_BALANCE, EPS_UNUSED
from .space import KINDS, Deployment

__all__ = ["solve_top", "best_deployments", "finalists", "space_size"]


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
                     colocated: bool = True, mixed: bool = True, all_gpus: bool = False,
                     log: list | None = None) -> list[tuple[float, Deployment]]:
    """The ``k`` best deployments by the ILP's objective, best first, each found by SCIP (ties
    arbitrary); each solve is appended to ``log`` (see :func:`solve_top`)."""
    return solve_top(est, gpus, degrees, k, disaggregated=disaggregated, colocated=colocated, mixed=mixed,
                     all_gpus=all_gpus, log=log)


def solve_top(est: Estimates, gpus: int, degrees: Sequence[int], k: int, *, disaggregated: bool = True,
              colocated: bool = True, mixed: bool = True, all_gpus: bool = False,
              log: list | None = None) -> list[tuple[float, Deployment]]:
    """The ``k`` best deployments by the ILP's objective, best first (fewer if the space is smaller).
    Each SCIP solve appends ``{"family", "status", "seconds", "nodes"}`` to ``log``."""
    if not (disaggregated or colocated):
        raise ValueError("search space: allow disaggregated and/or co-located deployments")
    family = "both" if disaggregated and colocated else ("disaggregated" if disaggregated else "colocated")
    m, cnt, _ = _model(est, gpus, degrees, disaggregated, colocated, mixed, all_gpus)
    return _top(m, cnt, k, [], family, log)


def finalists(est: Estimates, gpus: int, degrees: Sequence[int], k: int, *, disaggregated: bool = True,
              colocated: bool = True, mixed: bool = True, all_gpus: bool = False,
              log: list | None = None) -> list[tuple[float, Deployment]]:
    """The ``k`` best deployments over the whole space, then the best of each family (co-located,
    disaggregated) that they lack, from one model: ``k`` solves, and one more per missing family
    with ``co`` fixed to it (the no-good cuts so far exclude only the other family's deployments).
    Solving each family apart took ``2k`` solves for the same finalists."""
    if not (disaggregated or colocated):
        raise ValueError("search space: allow disaggregated and/or co-located deployments")
    both = disaggregated and colocated
    family = "both" if both else ("disaggregated" if disaggregated else "colocated")
    m, cnt, co = _model(est, gpus, degrees, disaggregated, colocated, mixed, all_gpus)
    found = _top(m, cnt, k, [], family, log)
    if both:
        for fam, fixed in (("disaggregated", 0.0), ("colocated", 1.0)):
            if any(d.colocated == bool(fixed) for _, d in found):
                continue
            m.chgVarLb(co, fixed)
            m.chgVarUb(co, fixed)
            extra = _top(m, cnt, len(found) + 1, list(found), fam, log)[len(found):]
            m.chgVarLb(co, 0.0)
            m.chgVarUb(co, 1.0)
            found += extra
    return found


def _scip():
    """An empty SCIP model, set for these small models."""
    from pyscipopt import SCIP_PARAMSETTING, Model

    m = Model("ampd-plan")
    m.hideOutput()
    # The model is small (tens of integers): SCIP's presolve, cutting planes, primal heuristics and
    # symmetry detection cost more than the branching they save, and so does timing every plugin
    # (measured on the closed-form estimates of a 400-session toolbench trace, 4 solves: 8 GPUs 0.07 s
    # with them off against 0.37 s on; 128 GPUs 0.21 s against 0.68 s; the default branching rule
    # beat most-infeasible branching, 0.21 s against 0.22 s and 0.08 s against 0.13 s at 256 GPUs).
    m.setPresolve(SCIP_PARAMSETTING.OFF)
    m.setSeparating(SCIP_PARAMSETTING.OFF)
    m.setHeuristics(SCIP_PARAMSETTING.OFF)
    m.setParam("misc/usesymmetry", 0)
    m.setParam("timing/enabled", False)
    m.setParam("limits/gap", 0.0)
    m.setParam("limits/absgap", 0.0)
    return m


def _model(est, gpus, degrees, disaggregated, colocated, mixed, all_gpus):
    from pyscipopt import quicksum

    m = _scip()
    kinds = [kd for kd in KINDS if (kd == "colocated" and colocated) or (kd != "colocated" and disaggregated)]
    co = m.addVar("co", vtype="B", lb=1 if not disaggregated else 0, ub=0 if not colocated else 1)
    z = m.addVar("Z", vtype="C", lb=0.0)
    rate = est.rate
    spill = disaggregated and len(est.spills) > 1
    s = m.addVar("s", vtype="C", lb=0.0, ub=rate if spill else 0.0)
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
        # A valid floor: whatever degrees are active, the worst of them is at least the best tau any
        # degree has at the chosen level. The big-M rows below are void in the LP relaxation (act is
        # fractional there), which left the root bound at 0; with the floor SCIP prunes (64 GPUs,
        # the disaggregated family alone: 90-190 nodes a solve instead of 160-410).
        floor = [min(_least(est.tau[kd][n][l]) for n in degrees) for l in range(len(est.levels))]
        m.addCons(w[kd] >= quicksum(floor[l] * u[l] for l in range(len(est.levels))))
        cap = quicksum(cnt[kd, n] * est.capacity[kd][n] for n in degrees)
        if kd == "prefill" and spill:  # the prefill workers carry rate - s: one big-M row per level
            for l, rho in enumerate(est.levels):
                if not math.isinf(rho):
                    m.addCons(rate - s <= rho * cap + rate * (1 - u[l]))
        else:  # sum_l u_l / rho_l: the aggregated form, tighter than a big-M row per level
            need = quicksum(u[l] / rho for l, rho in enumerate(est.levels) if not math.isinf(rho))
            m.addCons(cap * (1.0 / rate) >= need)
        _worst_tau_rows(m, est, kd, gpus, degrees, cnt, act, w[kd], u, on, s, spill)
    used = quicksum(n * v for (kd, n), v in cnt.items())
    m.addCons(used == gpus) if all_gpus else m.addCons(used <= gpus)
    m.setObjective(z + EPS_BALANCE * quicksum(w.values()) + EPS_UNUSED * (gpus - used) / gpus, "minimize")
    return m, cnt, co


def _worst_tau_rows(m, est, kd, gpus, degrees, cnt, act, wk, u, on, s, spill):
    """The rows that hold ``wk`` (the W of kind ``kd``) at least at the tau of each of its active
    degrees at the load level ``u`` selects: for decode workers at the share ``v`` of the spilled
    prefills they run too, for prefill workers at the replica pool ``g`` of each active degree."""
    from pyscipopt import quicksum

    rate = est.rate
    if kd == "decode":
        v = {j: m.addVar(f"v_{j}", vtype="B") for j in range(len(est.spills))}
        m.addCons(quicksum(v.values()) == on)
        local = quicksum(cnt[kd, n] * est.capacity["prefill"][n] for n in degrees)
        for j, f in enumerate(est.spills):
            if spill:
                m.addCons(s <= f * local + rate * (1 - v[j]))
            for n in degrees:  # u selects one level: the sum is tau at that level and share j
                taus = est.tau[kd][n]
                big = max(max(t) for t in taus)
                m.addCons(wk >= quicksum(taus[l][j] * u[l] for l in range(len(taus)))
                          - big * (2 - act[kd, n] - v[j]))
    elif kd == "prefill":
        for n in degrees:  # g[i] on: the group holds at least POOLS[i] replicas; one g per active degree
            taus = est.tau[kd][n]
            big = max(max(t) for t in taus)
            g = {i: m.addVar(f"g_{n}_{i}", vtype="B") for i, c in enumerate(est.pools) if c <= gpus // n}
            m.addCons(quicksum(g.values()) == act[kd, n])
            for i, gi in g.items():
                m.addCons(cnt[kd, n] >= est.pools[i] * gi)
                m.addCons(wk >= quicksum(taus[l][i] * u[l] for l in range(len(taus))) - big * (1 - gi))
    else:
        for n in degrees:  # u selects one level, so the sum is tau at that level (tighter than big-M per level)
            taus = est.tau[kd][n]
            m.addCons(wk >= quicksum(t * u[l] for l, t in enumerate(taus)) - max(taus) * (1 - act[kd, n]))


def _top(m, cnt, k: int, found: list, family: str, log: list | None) -> list[tuple[float, Deployment]]:
    """Solve, cut off the solution, solve again, until ``found`` holds ``k`` deployments."""
    while len(found) < k:
        t0 = time.perf_counter()
        m.optimize()
        status = m.getStatus()
        if log is not None:
            log.append({"family": family, "status": status, "seconds": round(time.perf_counter() - t0, 5),
                        "nodes": int(m.getNNodes())})
        if status != "optimal":
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


def _least(t) -> float:
    """The smallest tau of one (kind, degree, level): over the spill shares or pool sizes it holds."""
    return min(t) if isinstance(t, tuple) else t
