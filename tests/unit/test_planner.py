"""Planner core: the SCIP ILP against brute-force enumeration (the oracle), the closed-form estimates
under the policy that will run, the search space and its errors."""
from __future__ import annotations

import math
import random

import pytest

from ampd.bench.report import SLO
from ampd.perf import load_profile
from ampd.planner import (Deployment, EstimateCache, Estimates, PlanError, PlanRequest, brute_force_top,
                          build_estimates, capacities, feasible_degrees, plan, solve_top, surrogate)
from ampd.planner.estimates import LEVELS, OVERLOAD, POOLS, SPILLS, sample_sessions, saturated
from ampd.planner.ilp import best_deployments, space_size
from ampd.planner.objective import enumerate_deployments, evaluate
from ampd.planner.plan import family_candidates
from ampd.workload import generate

PROFILES = ["llama3.1-70b@h20", "qwen3-32b@h20", "mixtral-8x7b@h20"]


SPILL3 = (0.0, 0.1, 0.3)


def _random_estimates(profile, degrees, rate, seed, spills=SPILL3, pools=POOLS) -> Estimates:
    """Real capacity weights of the profile on a toolbench mix, random monotone tau per level (for
    decode replicas rising with the local-prefill share, for prefill replicas falling with the pool)."""
    rng = random.Random(seed)
    sample = sample_sessions(generate("toolbench", 1.0, 60.0, seed), 16)
    cap = capacities(profile, sample, degrees, 0.05)
    tau = {}
    for kind in cap:
        tau[kind] = {}
        for n in degrees:
            cur, vals = rng.uniform(0.1, 1.5), []
            for rho in LEVELS[:-1]:
                cur += rng.uniform(0.0, 0.6) * rho
                vals.append(round(cur, 4))
            vals.append(OVERLOAD)
            if kind == "decode":
                steps = [rng.uniform(0.0, 0.8) * j for j in range(len(spills))]
                vals = [tuple(round(v + d, 4) if v < OVERLOAD else OVERLOAD for d in steps) for v in vals]
            if kind == "prefill":
                cuts = [1.0]
                for _ in pools[1:]:  # a larger pool never waits longer
                    cuts.append(cuts[-1] * rng.uniform(0.8, 1.0))
                vals = [tuple(round(v * f, 4) if v < OVERLOAD else OVERLOAD for f in cuts) for v in vals]
            tau[kind][n] = tuple(vals)
    return Estimates(rate=rate, levels=LEVELS, capacity=cap, tau=tau, spills=spills, pools=pools)


def _flat(kind, value):
    """A decode tau entry is a tuple over the spill shares, a prefill one over the pools; the
    co-located ones are numbers."""
    return (value,) if kind in ("decode", "prefill") else value


CASES = [(prof, gpus, seed) for prof in PROFILES for gpus, seed in ((2, 1), (4, 2), (6, 3), (8, 4), (12, 5), (16, 6))]


@pytest.mark.parametrize("prof,gpus,seed", CASES)
def test_ilp_optimum_equals_brute_force(prof, gpus, seed):
    profile = load_profile(prof)
    degrees = feasible_degrees(profile, gpus, 1000)
    # rate: about what the GPUs can serve, so the optimum trades prefill against decode capacity
    rate = gpus * 0.05 * (1 + seed % 3)
    est = _random_estimates(profile, degrees, rate, seed)
    for space in ({}, {"mixed": False}, {"colocated": False}, {"all_gpus": True, "mixed": False}):
        if space.get("colocated") is False and gpus < 2 * min(degrees):
            continue
        got = solve_top(est, gpus, degrees, 3, **space)
        want = brute_force_top(est, gpus, degrees, 3, **space)
        assert [v for v, _ in got] == pytest.approx([v for v, _ in want], abs=1e-6), (space, got, want)
        # the ILP's value is the objective of the deployment it returns
        for v, dep in got:
            assert surrogate(dep, est, gpus) == pytest.approx(v, abs=1e-6)
            assert dep.gpus <= gpus
        assert len({d for _, d in got}) == len(got)  # the no-good cuts give distinct deployments


@pytest.mark.parametrize("prof,gpus,seed", [c for c in CASES if c[1] >= 4])
def test_finalists_hold_the_joint_best_and_each_familys_best(prof, gpus, seed):
    """The finalists are the ILP's k best over the whole space plus each family's best: the
    deployment a baseline's plan (one family) ranks first is always simulated too."""
    profile = load_profile(prof)
    degrees = feasible_degrees(profile, gpus, 1000)
    if gpus < 2 * min(degrees):
        return
    est = _random_estimates(profile, degrees, gpus * 0.05 * (1 + seed % 3), seed)
    # make co-location look bad to the surrogate, so the joint top 2 is all disaggregated
    est.tau["colocated"].update({n: tuple(t + 5.0 for t in v) for n, v in est.tau["colocated"].items()})
    log: list = []
    cands = family_candidates(est, gpus, degrees, 2, disaggregated=True, colocated=True, mixed=True,
                              all_gpus=False, log=log)
    assert [v for v, _ in cands[:2]] == pytest.approx([v for v, _ in brute_force_top(est, gpus, degrees, 2)], abs=1e-6)
    assert len({d for _, d in cands}) == len(cands)
    assert any(d.colocated for _, d in cands) and any(not d.colocated for _, d in cands)
    for fam in ({"disaggregated": True, "colocated": False}, {"disaggregated": False, "colocated": True}):
        best = brute_force_top(est, gpus, degrees, 1, **fam)[0][0]
        assert min(v for v, d in cands if d.colocated == fam["colocated"]) == pytest.approx(best, abs=1e-6)
    assert log and all(x["status"] in ("optimal", "infeasible") for x in log)  # every candidate from a SCIP solve


@pytest.mark.parametrize("policy", ["ampd", "remote"])
def test_ilp_on_closed_form_estimates_equals_brute_force(policy):
    profile = load_profile("qwen3-32b@h20")
    sessions = generate("toolbench", 1.5, 120.0, 3)
    slo = SLO(ttft_s=1.5, itl_s=0.05)
    degrees = feasible_degrees(profile, 8, max(s.context_tokens for s in sessions))
    est = build_estimates(profile, sessions, degrees, slo, policy=policy)
    got = solve_top(est, 8, degrees, 4)
    want = brute_force_top(est, 8, degrees, 4)
    assert [v for v, _ in got] == pytest.approx([v for v, _ in want], abs=1e-6)
    for kind, by_n in est.tau.items():  # tau never falls as the load rises
        for vals in by_n.values():
            cols = list(zip(*vals)) if kind in ("decode", "prefill") else [vals]
            for col in cols:
                assert all(b >= a for a, b in zip(col, col[1:]))


def test_tau_is_estimated_under_the_policy_that_will_run():
    """AMPD's estimates let a decode replica take local prefills (the prefill workers then carry
    less); remote's do not. Under AMPD an under-provisioned prefill phase is relieved, so the ILP's
    estimate of a prefill-starved split is lower than remote's, and the chosen plan's estimate is
    what its check finds (not several times the SLO)."""
    profile = load_profile("llama3.1-70b@h20")
    sessions = generate("toolbench", 0.8, 300.0, 3)
    slo = SLO(ttft_s=2.0, itl_s=0.055)
    degrees = (2, 4, 8)
    ampd = build_estimates(profile, sessions, degrees, slo, policy="ampd")
    remote = build_estimates(profile, sessions, degrees, slo, policy="remote")
    assert ampd.spills == SPILLS and remote.spills == (0.0,)
    starved = Deployment.of({2: 1}, {4: 1, 2: 1})
    assert evaluate(starved, ampd, 8)[0] < evaluate(starved, remote, 8)[0]
    assert evaluate(starved, ampd, 8)[3] > 0  # it counts on local prefills
    res = plan(PlanRequest(profile, sessions, 8, slo, top=1))
    assert res.estimates.spills == SPILLS and res.top[0].slo_attainment > 0.9
    assert res.top[0].objective < 2.0


def test_past_saturation_the_surrogate_still_ranks_by_load():
    """Every phase over capacity: the surrogate grows with the worst phase's load instead of one flat
    "overload", so the ILP (equal to brute force) picks the split whose worst phase is least over."""
    profile = load_profile("llama3.1-70b@h20")
    degrees = (4, 8)
    sample = sample_sessions(generate("toolbench", 1.0, 60.0, 1), 16)
    cap = capacities(profile, sample, degrees, 0.05)
    tau = {kind: {n: tuple(_flat(kind, saturated(r) if math.isfinite(r) else OVERLOAD) for r in LEVELS)
                  for n in degrees} for kind in cap}
    gpus = 16
    space = list(enumerate_deployments(gpus, degrees, colocated=False, mixed=False, all_gpus=True))

    def served(dep):  # sessions/s the deployment's weaker phase sustains
        return min(sum(c * cap[k][n] for n, c in dep.groups(k)) for k in ("prefill", "decode"))
    rate = 2.5 * max(served(d) for d in space)  # every deployment saturated, by 2.5x at least
    est = Estimates(rate=rate, levels=LEVELS, capacity=cap, tau=tau)
    got = solve_top(est, gpus, degrees, 3, colocated=False, mixed=False, all_gpus=True)
    want = brute_force_top(est, gpus, degrees, 3, colocated=False, mixed=False, all_gpus=True)
    assert [v for v, _ in got] == pytest.approx([v for v, _ in want], abs=1e-6)
    assert len({round(v, 6) for v, _ in want}) > 1  # not one flat value

    # the first choice serves the most of the load (within one level's rounding of the best)
    assert served(got[0][1]) >= max(served(d) for d in space) / 1.5
    assert served(got[0][1]) > min(served(d) for d in space)


def test_outcome_is_the_reports_attainment():
    """The planner's one-pass outcome (compact records) gives the report's SLO attainment."""
    from ampd.planner.estimates import outcome
    from ampd.sim import sim_report, simulate

    prof = load_profile("qwen3-32b@h20")
    sessions = generate("toolbench", 2.0, 60.0, 4)
    slo = SLO(1.5, 0.05)
    res = simulate(sessions, prof, policy="ampd", prefill="tp2*2", decode="tp2*2", ttft_slo_s=slo.ttft_s,
                   itl_slo_s=slo.itl_s, seed=0)
    att, ttft, itl, done = outcome(res, slo)
    assert att == pytest.approx(sim_report(res, slo, extras=False)["slo_attainment"], abs=1e-12)
    assert 0.0 < att < 1.0 and ttft > 0 and itl > 0 and done > 0


def test_enumeration_respects_phases_and_budget():
    deps = list(enumerate_deployments(4, (1, 2, 4)))
    assert all(d.gpus <= 4 for d in deps)
    assert all(d.decode for d in deps)  # every deployment decodes
    assert Deployment.of({2: 1}, {1: 2}) in deps and Deployment.of({}, {4: 1}) in deps
    assert Deployment.of({4: 1}, {}) not in deps
    homo = list(enumerate_deployments(4, (1, 2, 4), mixed=False))
    assert all(len(d.prefill) <= 1 and len(d.decode) <= 1 for d in homo)
    assert Deployment.of({1: 2}, {2: 1}) in homo and Deployment.of({}, {1: 2, 2: 1}) not in homo


def test_deployment_specs():
    d = Deployment.of({2: 2, 4: 1}, {8: 1})
    assert d.prefill_spec == "tp4*1,tp2*2" and d.decode_spec == "tp8*1" and d.gpus == 16
    assert not d.colocated and Deployment.of({}, {4: 2}).colocated
    assert Deployment.of({}, {4: 2}).prefill_spec == "none"


def test_degrees_hold_the_model():
    llama = load_profile("llama3.1-70b@h20")
    assert feasible_degrees(llama, 8, 1000) == (2, 4, 8)  # TP 1 cannot hold 70B weights on a 96 GB H20
    # a session longer than a TP 2 replica's KV capacity rules TP 2 out
    assert feasible_degrees(llama, 8, llama.kv_capacity_tokens(2) + 1) == (4, 8)
    assert feasible_degrees(llama, 3, 1000) == (2,)


def test_too_few_gpus_is_a_clear_error():
    llama = load_profile("llama3.1-70b@h20")
    with pytest.raises(PlanError, match=r"^gpus: 1 GPUs cannot hold one replica of llama3.1-70b@h20: .*needs 2 GPUs") as e:
        feasible_degrees(llama, 1, 1000)
    assert e.value.field == "gpus"
    sessions = generate("toolbench", 1.0, 30.0, 1)
    req = PlanRequest(llama, sessions, 3, SLO(2.0, 0.05), colocated=False)
    with pytest.raises(PlanError, match=r"^gpus: 3 GPUs cannot hold one prefill and one decode replica"):
        plan(req)
    with pytest.raises(PlanError, match=r"^gpus: must be an integer >= 1"):
        plan(PlanRequest(llama, sessions, 0, SLO(2.0, 0.05)))
    with pytest.raises(PlanError, match=r"^top: "):
        plan(PlanRequest(llama, sessions, 8, SLO(2.0, 0.05), top=0))
    with pytest.raises(PlanError, match=r"^trace: the trace has no sessions"):
        plan(PlanRequest(llama, [], 8, SLO(2.0, 0.05)))
    with pytest.raises(PlanError, match=r"^policy: unknown policy 'nope'"):
        plan(PlanRequest(llama, sessions, 8, SLO(2.0, 0.05), policy="nope"))


def test_plan_checks_and_ranks_candidates_by_simulation():
    prof = load_profile("qwen3-32b@h20")
    sessions = generate("toolbench", 1.0, 60.0, 2)
    cache = EstimateCache()
    req = PlanRequest(prof, sessions, 4, SLO(1.5, 0.05), top=2, candidates=3, sample_sessions=16)
    res = plan(req, cache=cache)
    # the 3 best over the space, plus each family's best if they lack it
    assert 3 <= res.candidates + res.skipped <= 5 and len(res.top) == 2
    atts = [e.slo_attainment for e in res.top]
    assert atts == sorted(atts, reverse=True)
    for e in res.top:
        assert 0.0 <= e.slo_attainment <= 1.0 and e.p95_s > 0 and e.deployment.gpus <= 4
    out = res.to_json(1.25)
    assert out["gpus"] == 4 and out["seconds"] == 1.25
    assert set(out["top"][0]) >= {"prefill", "decode", "p95_s", "slo_attainment"}
    assert out["solver"] == "scip" and out["solver_calls"] == len(out["solves"]) >= 3  # one per finalist at least
    assert out["colocated_form"] == "ampd-colocated"
    assert all(x["status"] in ("optimal", "infeasible") and x["seconds"] >= 0 for x in out["solves"])
    assert out["timings"]["simulations"] == res.candidates and out["timings"]["simulations_s"] > 0
    n = len(cache)
    assert n == res.candidates and cache.misses == n
    again = plan(req, cache=cache)  # the same trace again: every check comes from the cache
    assert len(cache) == n and cache.hits == n and again.simulations == 0
    assert [(e.deployment, e.slo_attainment) for e in again.top] == [(e.deployment, e.slo_attainment) for e in res.top]


def test_space_size_counts_the_enumeration():
    for gpus in range(1, 21):
        for degrees in ((1, 2, 4, 8), (2, 4, 8), (4,)):
            degs = tuple(n for n in degrees if n <= gpus)
            for space in ({}, {"mixed": False}, {"colocated": False}, {"disaggregated": False},
                          {"all_gpus": True}, {"all_gpus": True, "mixed": False, "colocated": False}):
                want = sum(1 for _ in enumerate_deployments(gpus, degs, **space)) if degs else 0
                assert space_size(gpus, degs, **space) == want, (gpus, degs, space)


@pytest.mark.parametrize("gpus", [4, 8, 16])
def test_scip_solves_every_size(gpus):
    """Small spaces too: every candidate comes from a SCIP solve (one per deployment found, each
    logged with its status), equal to the enumeration oracle."""
    profile = load_profile("qwen3-32b@h20")
    degrees = feasible_degrees(profile, gpus, 1000)
    est = _random_estimates(profile, degrees, gpus * 0.1, gpus)
    fam = {"disaggregated": True, "colocated": False}
    log: list = []
    got = best_deployments(est, gpus, degrees, 4, log=log, **fam)
    want = brute_force_top(est, gpus, degrees, 4, **fam)
    assert [v for v, _ in got] == pytest.approx([v for v, _ in want], abs=1e-6)
    assert [x["status"] for x in log[:len(got)]] == ["optimal"] * len(got)
    assert all(x["family"] == "disaggregated" and x["seconds"] > 0 for x in log)


def test_enumeration_breaks_ties_by_the_worst_utilisation():
    """Past saturation a whole level shares one tau, so many deployments tie; the oracle's enumeration
    puts the one whose bottleneck carries the least excess load first."""
    from ampd.planner.objective import worst_utilisation

    profile = load_profile("llama3.1-70b@h20")
    degrees = (2, 4, 8)
    sample = sample_sessions(generate("toolbench", 1.0, 60.0, 1), 16)
    cap = capacities(profile, sample, degrees, 0.05)
    tau = {kind: {n: tuple(_flat(kind, saturated(r) if math.isfinite(r) else OVERLOAD) for r in LEVELS)
                  for n in degrees} for kind in cap}
    rate = 1.3 * 16 * max(cap["colocated"][n] / n for n in degrees)  # every 16-GPU deployment at level 1.5
    est = Estimates(rate=rate, levels=LEVELS, capacity=cap, tau=tau)
    top = brute_force_top(est, 16, degrees, 6, disaggregated=False, all_gpus=True)
    assert len({round(v, 9) for v, _ in top}) == 1  # all tied on the objective
    utils = [worst_utilisation(d, est) for _, d in top]
    assert utils == sorted(utils)
    everything = enumerate_deployments(16, degrees, disaggregated=False, all_gpus=True)
    assert utils[0] == pytest.approx(min(worst_utilisation(d, est) for d in everything))


def test_a_candidate_a_weaker_one_holds_is_skipped():
    from ampd.planner.plan import PlanEntry, check_order, holds, skippable

    big, small = Deployment.of({4: 1}, {2: 2}), Deployment.of({4: 1}, {2: 1})
    assert holds(big, small) and not holds(small, big) and not holds(big, big)
    assert not holds(Deployment.of({}, {4: 1, 2: 2}), Deployment.of({4: 1}, {2: 1}))  # another family
    assert not holds(Deployment.of({4: 1}, {4: 1}), small)  # a tp4 replica does not hold a tp2 one
    other = Deployment.of({2: 2}, {4: 1})
    cands = [(1.0, small), (1.1, other), (1.2, big)]
    assert check_order(cands) == [1, 2, 0]  # small after big, which holds it

    def entry(dep, att):
        return PlanEntry(dep, "ampd", att, 1.0, 0.01, 1.0)
    assert skippable(small, [entry(other, 0.9), entry(big, 0.8)], top=1)      # big < the best: so is small
    assert not skippable(small, [entry(other, 0.9), entry(big, 0.8)], top=2)  # big is 2nd: small may be too
    assert not skippable(small, [entry(other, 0.8), entry(big, 0.8)], top=1)  # a tie could go either way
    assert not skippable(small, [entry(other, 0.9)], top=1)                   # nothing holds it


def test_skipping_keeps_the_plan():
    """The plan with the skipped candidates simulated after all is the same plan."""
    from dataclasses import replace

    prof = load_profile("llama3.1-70b@h20")
    sessions = generate("dureader", 0.6, 120.0, 3)
    req = PlanRequest(prof, sessions, 8, SLO(5.0, 0.05), top=3, candidates=10)
    cache = EstimateCache()
    a = plan(req, cache=cache)
    b = plan(replace(req, skip_dominated=False), cache=cache)
    assert a.skipped > 0 and b.skipped == 0 and a.candidates + a.skipped == b.candidates
    assert [(e.deployment, e.slo_attainment) for e in a.top] == [(e.deployment, e.slo_attainment) for e in b.top]


def test_a_colocated_candidate_runs_the_policys_colocated_form():
    """A co-located deployment is checked under the request policy's co-located form: ampd keeps
    Algorithm 2 there (ampd-colocated), remote falls back to colocated, a co-located policy stays."""
    from ampd.planner.plan import check_policy

    prof = load_profile("qwen3-32b@h20")
    sessions = generate("toolbench", 1.0, 10.0, 2)
    co, dis = Deployment.of({}, {2: 2}), Deployment.of({2: 1}, {2: 1})
    for policy, want in (("ampd", "ampd-colocated"), ("remote", "colocated"), ("continuum", "continuum")):
        req = PlanRequest(prof, sessions, 4, SLO(1.5, 0.05), policy=policy)
        assert check_policy(req, co) == want
        if policy != "continuum":
            assert check_policy(req, dis) == policy


def test_prefill_tail_point_solves_the_tail_exactly():
    """The P95 of wait + service in closed form per quantile segment equals a fine bisection of the
    same tail (random service quantiles, Erlang-C waits, pools of 1 to 8)."""
    from ampd.planner.estimates import _erlang_c, _tail_point

    rnd = random.Random(5)
    for _ in range(300):
        q = sorted(rnd.expovariate(1.0) for _ in range(24))
        es, es2 = sum(q) / 24, sum(x * x for x in q) / 24
        rho, c = rnd.uniform(0.05, 0.97), rnd.choice([1, 2, 4, 8])
        p, theta = _erlang_c(c, rho), es2 / (2.0 * es * c * (1.0 - rho))

        def tail(t):
            return sum(1.0 if t < x else p * math.exp(-(t - x) / theta) for x in q) / len(q)
        lo, hi = 0.0, q[-1] + theta * (math.log(max(p, 0.05) / 0.05) + 1.0)
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if tail(mid) > 0.05 else (lo, mid)
        assert _tail_point(q, p, theta, 0.05) == pytest.approx(hi, rel=1e-7, abs=1e-9)
