"""Offline deployment planner: how many prefill and decode replicas at which TP degree.

Pure (no I/O): the search space (``space``), the per-replica latency estimates in closed form under
the policy that will run (``estimates``), the ILP solved with SCIP at every size (``ilp``) and the
plan that checks its finalists with whole-deployment simulations (``plan``). docs/planner.md has the
formulation.
"""
from .estimates import EstimateCache, Estimates, build_estimates, capacities
from .ilp import solve_top
from .objective import brute_force_top, surrogate
from .plan import PlanEntry, PlanRequest, PlanResult, default_slo, plan
from .space import DEGREES, Deployment, PlanError, feasible_degrees

__all__ = ["DEGREES", "Deployment", "PlanError", "feasible_degrees", "Estimates", "EstimateCache",
           "build_estimates", "capacities", "solve_top", "surrogate", "brute_force_top", "PlanEntry",
           "PlanRequest", "PlanResult", "default_slo", "plan"]
