"""Routing: where one prefill task runs (the session's decode worker, or a prefill worker).

``AdaptiveRouter`` is the paper's Algorithm 1; the others are the baselines' rules. All routers
are pure: the caller passes worker snapshots and the time; the only state is the adaptive
router's own seeded ``random.Random``, so a seeded sequence of decisions repeats exactly.
Reason strings and estimate keys are documented in docs/policies.md.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Final, Protocol

from ampd.window import STATS_WINDOW_S

from .cost import pre_s, remote_prefill_s, t_local
from .order import before
from .types import KV_RESIDENT, SLO, CostModel, PrefillTask, RouteDecision, WorkerView

__all__ = [
    "Router",
    "AdaptiveRouter",
    "RemoteRouter",
    "LocalRouter",
    "ThresholdRouter",
    "MarginRouter",
    "remote_after_fetch",
    "ROUTERS",
    "SLACK_RULES",
    "build_router",
    "kv_noted",
    # reason strings
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

PREFILL_SLACK: Final = "prefill-slack"
DECODE_SLACK: Final = "decode-slack"
COST_MODEL: Final = "cost-model"
NO_PREFILL_WORKERS: Final = "no-prefill-workers"
POLICY_REMOTE: Final = "policy-remote"
POLICY_LOCAL: Final = "policy-local"
THRESHOLD_LOCAL: Final = "threshold-local"
THRESHOLD_REMOTE: Final = "threshold-remote"
MARGIN_LOCAL: Final = "margin-local"
MARGIN_REMOTE: Final = "margin-remote"

# How Algorithm 1's first two rungs judge slack: "window" (the paper: windowed means only) or
# "queue" (also the task's own predicted TTFT from the published queues; docs/policies.md).
SLACK_RULES = ("window", "queue")

# Algorithm 1's slack factors (the paper's values): a prefill worker has TTFT slack when its windowed
# TTFT <= ALPHA * TTFT SLO, a decode worker ITL slack when its windowed ITL <= BETA * ITL SLO.
ALPHA = 0.9
BETA = 0.85
THRESHOLD_TOKENS = 1000  # the threshold baseline's limit (Dynamo's default)
# The margin router spreads a local prefill's decode stall over this many seconds of decoding when it
# predicts the decode worker's ITL (a stall of s seconds raises the mean ITL over a span of H seconds
# by the factor 1 + s / H). It equals the default span of the workers' ITL window (ampd.config
# `stats_window`) but is a constant of the router: the coordinator does not read
# `--stats-window` (a worker setting), so a deployment that changes the window still predicts over
# the default span. `MarginRouter(horizon_s=)` sets it explicitly.
MARGIN_HORIZON_S = STATS_WINDOW_S


class Router(Protocol):
    name: str

    def route(
        self,
        req: PrefillTask,
        decode: WorkerView,
        prefills: Sequence[WorkerView],
        now: float,
    ) -> RouteDecision: ...


def _check_binding(req: PrefillTask, decode: WorkerView) -> None:
    if req.decode_worker != decode.worker_id:
        raise ValueError(
            f"route: request of session {req.session_id!r} is bound to {req.decode_worker!r} "
            f"but the decode view is {decode.worker_id!r}"
        )


def kv_noted(dec: RouteDecision, req: PrefillTask) -> RouteDecision:
    """``dec`` with the task's KV location in its reason when the history is not resident on the
    decode worker (``cost-model+kv-host``, ``decode-slack+kv-gone``) and the fetch it waited for in
    its estimates (``kv_fetch_s``, and ``kv_fetch_first`` 1.0 when counted serially); ``dec`` itself
    when neither applies."""
    state, f = req.kv_state, req.kv_fetch_s
    if state == KV_RESIDENT and not f:
        return dec
    est = dec.estimates
    if f:
        est["kv_fetch_s"] = f
    if req.kv_fetch_first:
        est["kv_fetch_first"] = 1.0
    return RouteDecision(dec.target, dec.local, dec.reason if state == KV_RESIDENT else f"{dec.reason}+kv-{state}",
                         est)


def remote_after_fetch(t_remote: float, kv_fetch_s: float, fetch_first: bool = False) -> float:
    """Eq. (2) ``t_remote`` of a task whose history is off the decode worker's device for
    ``kv_fetch_s`` seconds: the prefill worker reads the history from the host copy while the decode
    worker fetches it back to its device (live: services/decode/hostread.py; the simulator the same),
    so the round's first token comes at the later of the two. ``fetch_first``
    (``PrefillTask.kv_fetch_first``): the host copy cannot be read by a prefill worker, the task goes
    out once the fetch ended, so the two add up. The routers inline this sum: a call per prefill
    worker cost 5-10 % of route()'s instructions on resident KV (callgrind, 4 prefill workers), and
    guarding it with ``if kv_fetch_s`` would stop clamping a negative Eq. (2) (a fitted profile's
    negative intercept) at 0."""
    if fetch_first:
        return t_remote + kv_fetch_s
    return kv_fetch_s if kv_fetch_s > t_remote else t_remote


def _least_loaded(prefills: Sequence[WorkerView], est: dict[str, float]) -> str:
    """Prefill worker with the smallest ``queue_predicted_s``; ties -> the first in the worker order (``ampd.policy.order``).

    Records every compared queue as ``est["queue_s:<id>"]``.
    """
    best_id = ""
    best_q = 0.0
    first = True
    for p in prefills:
        q = p.queue_predicted_s
        wid = p.worker_id
        est["queue_s:" + wid] = q
        if first or q < best_q or (q == best_q and before(wid, best_id)):
            best_q = q
            best_id = wid
            first = False
    return best_id


class AdaptiveRouter:
    """Algorithm 1 (adaptive routing).

    1. Visit prefill workers in a seeded random order; the first whose windowed TTFT is
       ``<= alpha * slo.ttft_s`` wins (``prefill-slack``). A ``None`` window (no samples) is slack.
    2. Else, if the bound decode worker's windowed ITL is ``<= beta * slo.itl_s`` (``None`` is
       slack), run locally (``decode-slack``).
    3. Else take the argmin of Eq. (1) ``t_local`` and Eq. (2) ``t_remote:<id>`` (``cost-model``);
       ties go to local, then to the first in the worker order (``ampd.policy.order``).
    With no prefill workers at all the prefill runs locally (``no-prefill-workers``).

    ``slack="queue"`` (our extension, see docs/policies.md) also asks each slack test for the
    task's own predicted TTFT: a prefill worker has slack only if Eq. (2) ``t_remote`` is within
    ``alpha * slo.ttft_s`` too, and the decode worker only if Eq. (1) ``t_local`` is. The windowed
    means see finished tasks of the last window only, so under a growing backlog they lag; the
    queues the workers publish do not. ``slack="window"`` is the paper's rule exactly.

    The random order is drawn lazily (a Fisher-Yates shuffle stopped at the first slack worker),
    over the positions of ``prefills``: callers pass workers in the worker order (``ampd.policy.order.in_worker_order``)
    so that a seed reproduces the same decisions live and in the simulator.
    """

    __slots__ = ("name", "cost", "slo", "alpha", "beta", "seed", "slack", "_rng", "_ttft_limit", "_itl_limit",
                 "_keys")

    def __init__(self, cost: CostModel, slo: SLO, *, seed: int = 0, alpha: float = ALPHA, beta: float = BETA,
                 slack: str = "window"):
        if slack not in SLACK_RULES:
            raise ValueError(f"slack must be one of {', '.join(SLACK_RULES)}, got {slack!r}")
        self.slack = slack
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha!r}")
        if not beta > 0:
            raise ValueError(f"beta must be > 0, got {beta!r}")
        self.name = "adaptive"
        self.cost = cost
        self.slo = slo
        self.alpha = alpha
        self.beta = beta
        self.seed = seed
        self._rng = random.Random(seed)
        self._ttft_limit = alpha * slo.ttft_s
        self._itl_limit = beta * slo.itl_s
        self._keys: dict[str, tuple[str, str]] = {}  # worker id -> its estimate keys (built once)

    def route(
        self,
        req: PrefillTask,
        decode: WorkerView,
        prefills: Sequence[WorkerView],
        now: float,
    ) -> RouteDecision:
        if req.decode_worker != decode.worker_id:
            _check_binding(req, decode)
        est: dict[str, float] = {}
        if not prefills:
            dec = RouteDecision(decode.worker_id, True, NO_PREFILL_WORKERS, est)
        else:
            base: dict[int, float] = {}  # prefill tp -> Eq. (2) less its queue term (rungs 1 and 3 share it)
            dec = (self._prefill_slack(req, decode, prefills, est, base)
                   or self._decode_slack(req, decode, est)
                   or self._cost_model(req, decode, prefills, est, base))
        if req.kv_fetch_s or req.kv_state != KV_RESIDENT:
            return kv_noted(dec, req)
        return dec

    def _prefill_slack(self, req: PrefillTask, decode: WorkerView, prefills: Sequence[WorkerView],
                       est: dict[str, float], base: dict[int, float]) -> RouteDecision | None:
        """Rung 1: the first prefill worker with TTFT slack, in a seeded random visiting order."""
        n = len(prefills)
        limit = self._ttft_limit
        queue_rule = self.slack == "queue"
        est["ttft_limit"] = limit
        rand = self._rng.random
        pos = list(range(n))
        for i in range(n):
            j = i + int(rand() * (n - i))
            if j != i:
                pos[i], pos[j] = pos[j], pos[i]
            p = prefills[pos[i]]
            w = p.window_mean_s
            keys = self._keys.get(p.worker_id)
            if keys is None:
                keys = self._keys[p.worker_id] = ("ttft_window:" + p.worker_id, "t_remote:" + p.worker_id)
            if w is not None:
                est[keys[0]] = w
            if w is None or w <= limit:
                if not queue_rule:
                    return RouteDecision(p.worker_id, False, PREFILL_SLACK, est)
                ptp = p.tp
                b = base.get(ptp)
                if b is None:
                    b = remote_prefill_s(self.cost, req.l_hist, req.l_incr, decode.tp, ptp)
                    base[ptp] = b
                t = b + p.queue_predicted_s  # t_remote's sum, the same float
                f = req.kv_fetch_s  # the history reaches the decode worker's device after (remote_after_fetch)
                if req.kv_fetch_first:
                    t += f
                elif f > t:
                    t = f
                est[keys[1]] = t
                if t <= limit:
                    return RouteDecision(p.worker_id, False, PREFILL_SLACK, est)
        return None

    def _decode_slack(self, req: PrefillTask, decode: WorkerView, est: dict[str, float]) -> RouteDecision | None:
        """Rung 2: the bound decode worker has ITL slack."""
        est["itl_limit"] = self._itl_limit
        w = decode.window_mean_s
        if w is not None:
            est["itl_window"] = w
        if w is None or w <= self._itl_limit:
            f = req.kv_fetch_s
            if self.slack != "queue" and not f:
                return RouteDecision(decode.worker_id, True, DECODE_SLACK, est)
            # the KV off the device (host tier): a local prefill first waits for its fetch, so the
            # decode worker's ITL slack holds only if the TTFT does too (else rung 3 weighs a remote
            # prefill, which overlaps the fetch unless kv_fetch_first)
            t_loc = t_local(self.cost, req.l_hist, req.l_incr, decode.tp, decode.queue_predicted_s) + f
            est["t_local"] = t_loc
            if t_loc <= self._ttft_limit:
                return RouteDecision(decode.worker_id, True, DECODE_SLACK, est)
        return None

    def _cost_model(self, req: PrefillTask, decode: WorkerView, prefills: Sequence[WorkerView],
                    est: dict[str, float], base: dict[int, float]) -> RouteDecision:
        """Rung 3: the cost model, Eq. (1) against Eq. (2) for every prefill worker."""
        cost, l_hist, l_incr, dtp = self.cost, req.l_hist, req.l_incr, decode.tp
        f = req.kv_fetch_s
        serial = req.kv_fetch_first  # the copy unreadable remotely: Eq. (2) after the fetch too
        t_loc = t_local(cost, l_hist, l_incr, dtp, decode.queue_predicted_s) + f  # Eq. (1) after the fetch
        est["t_local"] = t_loc
        best_t = t_loc
        best_id = decode.worker_id
        best_local = True
        for p in prefills:
            ptp = p.tp
            b = base.get(ptp)
            if b is None:
                b = remote_prefill_s(cost, l_hist, l_incr, dtp, ptp)  # Eq. (2) less its queue term
                base[ptp] = b
            t = b + p.queue_predicted_s
            if serial:
                t += f
            elif f > t:  # Eq. (2) from the host copy: the fetch to the device runs meanwhile (remote_after_fetch)
                t = f
            wid = p.worker_id
            est["t_remote:" + wid] = t
            if t < best_t or (t == best_t and not best_local and before(wid, best_id)):
                best_t = t
                best_id = wid
                best_local = False
        return RouteDecision(best_id, best_local, COST_MODEL, est)


class RemoteRouter:
    """Dynamo-style disaggregation: every prefill goes to the prefill worker with the smallest
    ``queue_predicted_s`` (ties -> the first in the worker order), reason ``policy-remote``. With no prefill worker
    the prefill runs locally (``no-prefill-workers``)."""

    __slots__ = ("name",)

    def __init__(self) -> None:
        self.name = "remote"

    def route(self, req: PrefillTask, decode: WorkerView, prefills: Sequence[WorkerView],
              now: float) -> RouteDecision:
        if req.decode_worker != decode.worker_id:
            _check_binding(req, decode)
        est: dict[str, float] = {}
        if not prefills:
            return kv_noted(RouteDecision(decode.worker_id, True, NO_PREFILL_WORKERS, est), req)
        return kv_noted(RouteDecision(_least_loaded(prefills, est), False, POLICY_REMOTE, est), req)


class LocalRouter:
    """Every prefill on the session's decode worker (``policy-local``); also the router of the
    co-located baselines, which have no prefill workers."""

    __slots__ = ("name",)

    def __init__(self) -> None:
        self.name = "local"

    def route(self, req: PrefillTask, decode: WorkerView, prefills: Sequence[WorkerView],
              now: float) -> RouteDecision:
        if req.decode_worker != decode.worker_id:
            _check_binding(req, decode)
        return kv_noted(RouteDecision(decode.worker_id, True, POLICY_LOCAL, {}), req)


class ThresholdRouter:
    """Conditional disaggregation (Dynamo ``max_local_prefill_length``, TensorRT-LLM
    ``ConditionalDisaggConfig``): local when the uncached length at the decode worker, which holds
    the whole history, i.e. ``l_incr``, is ``< threshold_tokens`` (``threshold-local``); otherwise
    the least-loaded prefill worker as in ``RemoteRouter`` (``threshold-remote``)."""

    __slots__ = ("name", "threshold_tokens")

    def __init__(self, threshold_tokens: int = THRESHOLD_TOKENS) -> None:
        if threshold_tokens < 0:
            raise ValueError(f"threshold_tokens must be >= 0, got {threshold_tokens!r}")
        self.name = "threshold"
        self.threshold_tokens = threshold_tokens

    def route(self, req: PrefillTask, decode: WorkerView, prefills: Sequence[WorkerView],
              now: float) -> RouteDecision:
        if req.decode_worker != decode.worker_id:
            _check_binding(req, decode)
        est: dict[str, float] = {"l_incr": float(req.l_incr), "threshold_tokens": float(self.threshold_tokens)}
        if req.l_incr < self.threshold_tokens:
            return kv_noted(RouteDecision(decode.worker_id, True, THRESHOLD_LOCAL, est), req)
        if not prefills:
            return kv_noted(RouteDecision(decode.worker_id, True, NO_PREFILL_WORKERS, est), req)
        return kv_noted(RouteDecision(_least_loaded(prefills, est), False, THRESHOLD_REMOTE, est), req)


class MarginRouter:
    """Margin routing (ours; docs/policies.md): weigh the SLO margin each placement leaves, on both
    sides, instead of trying the prefill workers first.

    - Local costs TTFT ``t_local`` (Eq. 1) and ITL on the decode worker: a prefill stalls every
      session decoding there for its run time, so its windowed ITL becomes about
      ``itl_window * (1 + (local queue + t_pre) / horizon_s)`` (``itl_after``).
    - Remote on worker p costs TTFT ``t_remote:p`` (Eq. 2) and no decode time.
    1. While ``itl_after <= beta * slo.itl_s`` (local costs no ITL the SLO counts), the prefill goes to
       the placement with the smallest predicted TTFT, local or the best prefill worker; ties go local
       (no KV moves): ``margin-local`` / ``margin-remote``.
    2. Otherwise the best prefill worker, if its ``t_remote <= alpha * slo.ttft_s``
       (``margin-remote``).
    3. Otherwise both sides are short: the placement whose smaller normalised margin is largest, local
       ``min(1 - t_local / ttft_slo, 1 - itl_after / itl_slo)`` against remote ``1 - t_remote / ttft_slo``
       (``cost-model``); ties go local.
    With no prefill workers the prefill runs locally (``no-prefill-workers``). Deterministic.
    """

    __slots__ = ("name", "cost", "slo", "alpha", "beta", "horizon_s")

    def __init__(self, cost: CostModel, slo: SLO, *, alpha: float = ALPHA, beta: float = BETA,
                 horizon_s: float = MARGIN_HORIZON_S):
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha!r}")
        if not beta > 0:
            raise ValueError(f"beta must be > 0, got {beta!r}")
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s!r}")
        self.name = "margin"
        self.cost, self.slo, self.alpha, self.beta, self.horizon_s = cost, slo, alpha, beta, horizon_s

    def route(self, req: PrefillTask, decode: WorkerView, prefills: Sequence[WorkerView],
              now: float) -> RouteDecision:
        if req.decode_worker != decode.worker_id:
            _check_binding(req, decode)
        dec = self._decide(req, decode, prefills)
        return kv_noted(dec, req) if req.kv_fetch_s or req.kv_state != KV_RESIDENT else dec

    def _decide(self, req: PrefillTask, decode: WorkerView, prefills: Sequence[WorkerView]) -> RouteDecision:
        est: dict[str, float] = {}
        if not prefills:
            return RouteDecision(decode.worker_id, True, NO_PREFILL_WORKERS, est)
        cost, slo = self.cost, self.slo
        l_hist, l_incr, dtp = req.l_hist, req.l_incr, decode.tp
        t_pre = pre_s(cost, dtp, l_hist, l_incr)
        f = req.kv_fetch_s  # the KV off the device: local waits for its fetch, remote overlaps it
        serial = req.kv_fetch_first  # (unless the host copy is not readable remotely)
        t_loc = t_pre + decode.queue_predicted_s + f  # Eq. (1), the same sum as t_local
        est["t_local"] = t_loc
        w = decode.window_mean_s
        itl_after = 0.0 if w is None else w * (1.0 + (decode.queue_predicted_s + t_pre) / self.horizon_s)
        est["itl_after"] = itl_after
        best_t, best_id = 0.0, ""
        base: dict[int, float] = {}
        for p in prefills:
            b = base.get(p.tp)
            if b is None:
                b = base[p.tp] = remote_prefill_s(cost, l_hist, l_incr, dtp, p.tp)
            t = b + p.queue_predicted_s
            if serial:  # (remote_after_fetch)
                t += f
            elif f > t:
                t = f
            est["t_remote:" + p.worker_id] = t
            if not best_id or t < best_t or (t == best_t and before(p.worker_id, best_id)):
                best_t, best_id = t, p.worker_id
        if itl_after <= self.beta * slo.itl_s:
            if t_loc <= best_t:
                return RouteDecision(decode.worker_id, True, MARGIN_LOCAL, est)
            return RouteDecision(best_id, False, MARGIN_REMOTE, est)
        if best_t <= self.alpha * slo.ttft_s:
            return RouteDecision(best_id, False, MARGIN_REMOTE, est)
        m_loc = min(1.0 - t_loc / slo.ttft_s, 1.0 - itl_after / slo.itl_s)
        m_rem = 1.0 - best_t / slo.ttft_s
        est["margin_local"], est["margin_remote"] = m_loc, m_rem
        if m_loc >= m_rem:
            return RouteDecision(decode.worker_id, True, COST_MODEL, est)
        return RouteDecision(best_id, False, COST_MODEL, est)


# The router registry: name -> builder(cost, slo, seed, alpha, beta, threshold_tokens, slack).
_ROUTER_BUILDERS: dict[str, Callable[..., Router]] = {
    "adaptive": lambda cost, slo, seed, alpha, beta, threshold_tokens, slack: AdaptiveRouter(
        cost, slo, seed=seed, alpha=alpha, beta=beta, slack=slack or "window"),
    "remote": lambda *_: RemoteRouter(),
    "local": lambda *_: LocalRouter(),
    "threshold": lambda cost, slo, seed, alpha, beta, threshold_tokens, slack: ThresholdRouter(
        threshold_tokens),
    "margin": lambda cost, slo, seed, alpha, beta, threshold_tokens, slack: MarginRouter(
        cost, slo, alpha=alpha, beta=beta),
}
ROUTERS: tuple[str, ...] = tuple(_ROUTER_BUILDERS)


def build_router(
    kind: str,
    cost: CostModel,
    slo: SLO,
    *,
    seed: int = 0,
    alpha: float = ALPHA,
    beta: float = BETA,
    threshold_tokens: int = THRESHOLD_TOKENS,
    slack: str | None = None,
) -> Router:
    """Build a router by router name (``ROUTERS``). Policy names resolve to a router in
    ``ampd.policy.spec.make_router``, the entry point the tools use."""
    return _ROUTER_BUILDERS[kind](cost, slo, seed, alpha, beta, threshold_tokens, slack)
