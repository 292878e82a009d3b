"""Pure decision cores: binding, routing (Algorithm 1 and baselines), prefill queues
(Algorithm 2 and baselines) and the policy registry (name -> router, queues, workers). No I/O, no clock.
See docs/policies.md."""

from .bind import bind
from .order import before, in_worker_order, worker_key
from .reorder import QUEUES, ContinuumQueue, FCFSQueue, PrefillQueue, TTFTAwareQueue, make_queue
from .route import (
    COST_MODEL,
    DECODE_SLACK,
    MARGIN_LOCAL,
    MARGIN_REMOTE,
    NO_PREFILL_WORKERS,
    POLICY_LOCAL,
    POLICY_REMOTE,
    PREFILL_SLACK,
    ROUTERS,
    THRESHOLD_LOCAL,
    THRESHOLD_REMOTE,
    AdaptiveRouter,
    LocalRouter,
    MarginRouter,
    RemoteRouter,
    Router,
    ThresholdRouter,
)
from .spec import POLICIES, PolicySpec, make_router, policy_spec, register_policy
from .cost import remote_parts, t_local, t_remote
from .types import SLO, CostModel, PrefillTask, RouteDecision, WorkerView

__all__ = [
    "CostModel",
    "SLO",
    "PrefillTask",
    "WorkerView",
    "remote_parts",
    "t_local",
    "t_remote",
    "RouteDecision",
    "Router",
    "AdaptiveRouter",
    "RemoteRouter",
    "LocalRouter",
    "ThresholdRouter",
    "MarginRouter",
    "ROUTERS",
    "make_router",
    "bind",
    "before",
    "in_worker_order",
    "worker_key",
    "PrefillQueue",
    "FCFSQueue",
    "TTFTAwareQueue",
    "ContinuumQueue",
    "QUEUES",
    "make_queue",
    "PolicySpec",
    "POLICIES",
    "policy_spec",
    "register_policy",
    "PREFILL_SLACK",
    "DECODE_SLACK",
    "COST_MODEL",
    "NO_PREFILL_WORKERS",
    "POLICY_REMOTE",
    "POLICY_LOCAL",
    "THRESHOLD_LOCAL",
    "THRESHOLD_REMOTE",
    "MARGIN_LOCAL",
    "MARGIN_REMOTE",
]
