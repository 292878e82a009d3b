"""Value types shared by the policy cores.

All types are slotted dataclasses, treated as values: nothing assigns to a field after
construction. They are not ``frozen``: a frozen dataclass sets every field through
``object.__setattr__``, which makes construction ~5x slower (1.28 us against 0.23 us for
``PrefillTask``, measured on the dev box), and the simulator builds a task, a decision and a
few views for each of ~1.1M rounds in a 100k-session run. Nothing here does I/O or reads a
clock; times are floats in seconds on whatever clock the caller uses (wall clock live, virtual clock
in the simulator).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Protocol

# One SLO type for the whole tree (ampd.slo); the policies re-export it. SLO(ttft_s, itl_s), both > 0 seconds.
from ampd.slo import SLO

__all__ = [
    "CostModel",
    "DecodeCost",
    "SLO",
    "PrefillTask",
    "WorkerView",
    "RouteDecision",
    "PREFILL",
    "DECODE",
    "KV_RESIDENT",
    "KV_HOST",
    "KV_GONE",
]

PREFILL: Final = "prefill"
DECODE: Final = "decode"
# Where a session's KV is (``PrefillTask.kv_state``): ``ampd.policy.kvtier.KVState``'s values, as strings
# here so that a task stays a plain value (a unit test holds them equal).
KV_RESIDENT: Final = "resident"
KV_HOST: Final = "host"
KV_GONE: Final = "gone"


class CostModel(Protocol):
    """What the policies need from a performance model (``ampd.perf.Profile`` satisfies it)."""

    def t_pre(self, tp: int, l_hist: int, l_incr: int) -> float:
        """Seconds to prefill ``l_incr`` new tokens on top of ``l_hist`` cached ones at degree ``tp``."""
        ...

    def t_kv(self, tokens: int, src_tp: int, dst_tp: int) -> float:
        """Seconds to move ``tokens`` tokens of KV from a ``src_tp`` worker to a ``dst_tp`` worker."""
        ...


class DecodeCost(Protocol):
    """What a decode worker and admission need from the performance model (``ampd.perf.Profile``
    satisfies it): ``CostModel``'s and ``t_dec``. (Not a subclass of ``CostModel``: mypyc 2.4 then
    compiles calls of its inherited methods as direct calls to functions it never defines.)"""

    def t_pre(self, tp: int, l_hist: int, l_incr: int) -> float: ...

    def t_kv(self, tokens: int, src_tp: int, dst_tp: int) -> float: ...

    def t_dec(self, tp: int, batch: int, context_tokens: int) -> float: ...


@dataclass(slots=True, init=False)
class PrefillTask:
    """One prefill task: ``l_incr`` new tokens on ``l_hist`` history tokens of round ``round`` of a
    session, whose KV lives on ``decode_worker`` (its binding, a worker of degree ``decode_tp``).

    The coordinator routes it (Algorithm 1), a worker queues it (Algorithm 2) and a worker core runs
    it. ``enqueued_at`` is the time Algorithm 2 measures waiting from (the paper's ``T_enq``); callers
    that want the queue to optimise true TTFT pass the time the round's input became ready.
    ``decode_tp`` is what a prefill worker needs to time the KV transfers (0 when unknown).

    ``kv_state``: where the session's history KV is when the round is routed (the host KV tier,
    ``ampd.policy.kvtier.KVState``'s values): ``resident`` on the decode worker's device, on ``host``
    (it is being fetched back), or ``gone`` (dropped: ``l_hist`` is 0 and ``l_incr`` counts the
    history again). ``kv_fetch_s``: seconds until the decode worker's device holds the history and
    the room for the new KV (the host fetch, or what is left of a prefetch in flight, and the moves
    queued before it); 0 without a tier. Routing's Eq. (1) and Eq. (2) count them (``ampd.policy.cost``).
    ``kv_fetch_first``: on host, and a prefill worker cannot read the host copy (the decode worker
    could not claim it, docs/kv.md "Not claimed"): a remote prefill, like a local one, comes after
    the fetch (``ampd.policy.route.remote_after_fetch``); False: a remote one overlaps it.

    ``queue_yield_s``: a yielding turn's agent hint (``ampd.policy.hints.queue_yield_s``): the queues
    order the task as if its input were ready this much later (``order_at``); TTFT (a prefill core's
    window) still counts from ``enqueued_at``. 0: no hint.
    """

    session_id: str
    round: int
    l_hist: int
    l_incr: int
    enqueued_at: float = 0.0
    decode_worker: str = ""
    decode_tp: int = 0
    kv_state: str = "resident"
    kv_fetch_s: float = 0.0
    queue_yield_s: float = 0.0
    kv_fetch_first: bool = False

    # (written out: compiled, a dataclass's generated __init__ runs as interpreted Python; tests/unit/test_inits.py
    # holds it to the fields)
    def __init__(self, session_id: str, round: int, l_hist: int, l_incr: int, enqueued_at: float = 0.0,
                 decode_worker: str = "", decode_tp: int = 0, kv_state: str = "resident", kv_fetch_s: float = 0.0,
                 queue_yield_s: float = 0.0, kv_fetch_first: bool = False) -> None:
        self.session_id = session_id
        self.round = round
        self.l_hist = l_hist
        self.l_incr = l_incr
        self.enqueued_at = enqueued_at
        self.decode_worker = decode_worker
        self.decode_tp = decode_tp
        self.kv_state = kv_state
        self.kv_fetch_s = kv_fetch_s
        self.queue_yield_s = queue_yield_s
        self.kv_fetch_first = kv_fetch_first

    @property
    def order_at(self) -> float:
        """The arrival time the prefill queues order this task by."""
        return self.enqueued_at + self.queue_yield_s


@dataclass(slots=True, init=False)
class WorkerView:
    """A snapshot of one worker as the coordinator sees it (read from shared state).

    ``window_mean_s`` is the windowed mean TTFT (prefill workers) or ITL (decode workers); ``None``
    means the window holds no samples, which every policy treats as full slack (an idle worker is
    not congested). ``kv_host_tokens``: a decode worker's host KV tier capacity (0: no tier), KV that
    sessions idle in tool calls can be moved to, which admission may promise beyond the device pool
    (``ampd.policy.admit``). ``queue_predicted_s`` is the sum of predicted prefill times of the tasks queued
    on that worker at its own ``tp`` (``PrefillQueue.predicted_total()``) plus the remaining time of
    the task in service, published by the worker (``ampd.worker`` cores); with the KV overlap on, a
    prefill worker's queued tasks also count the KV transfers they still pay that the overlap does
    not hide.
    """

    worker_id: str
    kind: str
    tp: int
    window_mean_s: float | None
    queue: tuple[PrefillTask, ...] = ()
    kv_free_tokens: int = 0
    queue_predicted_s: float = 0.0
    kv_host_tokens: int = 0

    # (written out: compiled, a dataclass's generated __init__ runs as interpreted Python; tests/unit/test_inits.py
    # holds it to the fields)
    def __init__(self, worker_id: str, kind: str, tp: int, window_mean_s: float | None,
                 queue: tuple[PrefillTask, ...] = (), kv_free_tokens: int = 0, queue_predicted_s: float = 0.0,
                 kv_host_tokens: int = 0) -> None:
        self.worker_id = worker_id
        self.kind = kind
        self.tp = tp
        self.window_mean_s = window_mean_s
        self.queue = queue
        self.kv_free_tokens = kv_free_tokens
        self.queue_predicted_s = queue_predicted_s
        self.kv_host_tokens = kv_host_tokens


@dataclass(slots=True, init=False)
class RouteDecision:
    """Where a prefill runs and why.

    ``target`` is a worker id; ``local`` is True when it is the session's decode worker.
    ``reason`` is one of the reason strings documented in docs/policies.md. ``estimates`` holds the
    numbers the decision compared (windows, thresholds, cost estimates), for logs and metrics.
    """

    target: str
    local: bool
    reason: str
    estimates: dict[str, float] = field(default_factory=dict)

    # (written out: compiled, a dataclass's generated __init__ runs as interpreted Python; tests/unit/test_inits.py
    # holds it to the fields)
    def __init__(self, target: str, local: bool, reason: str, estimates: dict[str, float] | None = None) -> None:
        self.target = target
        self.local = local
        self.reason = reason
        self.estimates = {} if estimates is None else estimates
