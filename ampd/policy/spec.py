"""The policy registry: each policy name -> its router, its queues, which workers it runs.

Every tool (`ampd up`, `ampd simulate`, the services, the benchmarks) resolves a policy name here;
nothing else branches on policy names."""

from __future__ import annotations

from typing import Final
from dataclasses import dataclass, replace

from .reorder import QUEUES
from .route import ALPHA, BETA, ROUTERS, SLACK_RULES, THRESHOLD_TOKENS, Router, build_router
from .types import SLO, CostModel

__all__ = ["PolicySpec", "POLICIES", "policy_spec", "register_policy", "make_router", "CONTINUUM_KV_PIN_TTL_S"]

# How long Continuum keeps a session's KV pinned on its worker after a round ends, waiting for
# the tool result. Continuum derives its TTL from the tool-call latency distribution; 5 s covers
# the bulk of tool/retrieval calls in the shipped presets. Override with policy_spec(..., kv_pin_ttl_s=).
CONTINUUM_KV_PIN_TTL_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """How a policy is deployed: one entry of the policy registry.

    ``router``: a router name (``ampd.policy.route.ROUTERS``). ``prefill_queue``: queue of prefill
    workers (``None`` when the policy runs none). ``decode_queue``: queue of each decode worker's
    local prefills (``ampd.policy.reorder.QUEUES``). ``uses_prefill_workers``: False for the
    co-located baselines (all GPUs are decode workers that also prefill). ``kv_pin_ttl_s``: seconds a
    finished round's KV stays pinned waiting for the next round (Continuum), ``None`` = no TTL
    pinning (the session's KV stays on its decode worker for the session's life). ``slack``:
    Algorithm 1's slack rule (``ampd.policy.route.SLACK_RULES``) when the router is adaptive.
    Chunked local prefill is a worker option (``chunked_prefill``), not a policy's.
    ``colocated_form``: the policy a deployment with no prefill workers runs in place of this one
    (see :meth:`on_colocated`); empty: ``colocated``.
    """

    name: str
    router: str
    prefill_queue: str | None
    decode_queue: str
    uses_prefill_workers: bool
    kv_pin_ttl_s: float | None = None
    description: str = ""
    slack: str = "window"
    colocated_form: str = ""

    @property
    def needs_prefill_workers(self) -> bool:
        """Its router sends prefills to prefill workers (``local`` runs them idle, by design)."""
        return self.uses_prefill_workers and self.router != "local"

    def on_colocated(self) -> str:
        """The policy this one becomes on a deployment with no prefill workers: itself when it is
        co-located, else its ``colocated_form`` (``colocated`` when it names none). AMPD's is
        ``ampd-colocated``: its router then routes every prefill locally and its decode workers keep
        Algorithm 2's order, which plain ``colocated`` (FCFS) would drop."""
        if not self.uses_prefill_workers:
            return self.name
        return self.colocated_form or "colocated"


_SPECS: dict[str, PolicySpec] = {}


def register_policy(spec: PolicySpec) -> PolicySpec:
    """Adds ``spec`` to the registry; its router, queues and slack rule must exist."""
    problems = []
    if spec.router not in ROUTERS:
        problems.append(f"router {spec.router!r} (valid: {', '.join(ROUTERS)})")
    for q in (spec.prefill_queue, spec.decode_queue):
        if q is not None and q not in QUEUES:
            problems.append(f"queue {q!r} (valid: {', '.join(QUEUES)})")
    if spec.slack not in SLACK_RULES:
        problems.append(f"slack {spec.slack!r} (valid: {', '.join(SLACK_RULES)})")
    if spec.uses_prefill_workers != (spec.prefill_queue is not None):
        problems.append("a policy has a prefill queue exactly when it uses prefill workers")
    form = _SPECS.get(spec.colocated_form) if spec.colocated_form else None
    if spec.colocated_form and (form is None or form.uses_prefill_workers):
        problems.append(f"colocated_form {spec.colocated_form!r} must name a co-located policy registered before it")
    if problems:
        raise ValueError(f"policy {spec.name!r}: " + "; ".join(problems))
    _SPECS[spec.name] = spec
    return spec


_BUILTIN = (
    PolicySpec("ampd", "adaptive", "ttft-aware", "ttft-aware", True, slack="queue", colocated_form="ampd-colocated",
               description="AMPD: adaptive routing (Alg. 1, queue-aware slack) + TTFT-aware reordering "
                           "(Alg. 2) on every queue"),
    PolicySpec("ampd-window", "adaptive", "ttft-aware", "ttft-aware", True, slack="window",
               colocated_form="ampd-colocated",
               description="AMPD as the paper writes it: Alg. 1 with the windowed-mean slack rule + Alg. 2"),
    PolicySpec("ampd-noreorder", "adaptive", "fcfs", "fcfs", True, slack="queue",
               description="AMPD routing (Alg. 1, queue-aware slack) with FCFS queues (ablation)"),
    PolicySpec("ampd-margin", "margin", "ttft-aware", "ttft-aware", True, colocated_form="ampd-colocated",
               description="AMPD with margin routing: local or remote by the SLO margin each leaves (TTFT on "
                           "both sides, ITL on the decode worker) + TTFT-aware reordering (Alg. 2)"),
    PolicySpec("remote", "remote", "fcfs", "fcfs", True,
               description="Dynamo-style disaggregation: every prefill on the least-loaded prefill worker, FCFS"),
    PolicySpec("local", "local", "fcfs", "fcfs", True,
               description="every prefill on the session's decode worker, FCFS (prefill workers idle)"),
    PolicySpec("threshold", "threshold", "fcfs", "fcfs", True,
               description="conditional disaggregation: local when l_incr < threshold_tokens, else least-loaded remote"),
    PolicySpec("colocated", "local", None, "fcfs", False,
               description="vLLM-style co-location: no prefill workers, prefill-priority continuous batching, FCFS"),
    PolicySpec("continuum", "local", None, "continuum", False, kv_pin_ttl_s=CONTINUUM_KV_PIN_TTL_S,
               description="vLLM-Continuum: co-located, KV pinned through tool calls for a TTL, running sessions first"),
    # AMPD's router with no prefill workers to route to: every prefill runs on the session's decode
    # worker, whose queue keeps Algorithm 2. The planner's co-located candidates run it under ampd
    # (benchmarks/results/never_lose.json: toolbench 2.4/s, lenient ITL, none|tp8*2: FCFS
    # colocated 60.3 %, continuum 62.9 %, this 70.7 % on the held-out trace).
    PolicySpec("ampd-colocated", "adaptive", None, "ttft-aware", False, slack="queue",
               description="AMPD on a co-located deployment (no prefill workers): every prefill local, "
                           "TTFT-aware reordering (Alg. 2) on each worker's queue"),
)
# a co-located form is registered before the policies that name it; the registry lists them as above
for _spec in sorted(_BUILTIN, key=lambda s: s.uses_prefill_workers):
    register_policy(_spec)
_SPECS = {s.name: _SPECS[s.name] for s in _BUILTIN}

POLICIES: tuple[str, ...] = tuple(_SPECS)


def policy_spec(name: str, *, kv_pin_ttl_s: float | None = None) -> PolicySpec:
    """The deployment shape of policy ``name``; ``kv_pin_ttl_s`` overrides the TTL of a policy
    that pins KV. Unknown names raise ``ValueError`` listing the valid ones."""
    try:
        spec = _SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(_SPECS)}") from None
    if kv_pin_ttl_s is not None:
        if spec.kv_pin_ttl_s is None:
            raise ValueError(f"policy {name!r} does not pin KV; kv_pin_ttl_s applies to: "
                             + ", ".join(n for n, s in _SPECS.items() if s.kv_pin_ttl_s is not None))
        if not kv_pin_ttl_s >= 0:
            raise ValueError(f"kv_pin_ttl_s must be >= 0, got {kv_pin_ttl_s!r}")
        spec = replace(spec, kv_pin_ttl_s=float(kv_pin_ttl_s))
    return spec


def make_router(
    name: str,
    cost: CostModel,
    slo: SLO,
    *,
    seed: int = 0,
    alpha: float = ALPHA,
    beta: float = BETA,
    threshold_tokens: int = THRESHOLD_TOKENS,
    slack: str | None = None,
    **opts: object,
) -> Router:
    """Build a router by router name (``ROUTERS``) or by policy name (``POLICIES``, resolved
    through the policy registry; the policy also sets the default ``slack`` rule).
    Unknown names or options raise ``ValueError``."""
    if opts:
        raise ValueError(f"make_router: unknown option(s) {', '.join(sorted(opts))}")
    kind = name
    if kind not in ROUTERS:
        if kind not in POLICIES:
            raise ValueError(
                f"unknown router {name!r}; valid routers: {', '.join(ROUTERS)}; "
                f"valid policies: {', '.join(POLICIES)}"
            )
        spec = policy_spec(kind)
        kind = spec.router
        if slack is None:
            slack = spec.slack
    return build_router(kind, cost, slo, seed=seed, alpha=alpha, beta=beta, threshold_tokens=threshold_tokens,
                        slack=slack)
