"""Prefill queues: FCFS, TTFT-aware reordering (Algorithm 2) and Continuum's session priority.

One queue instance per worker (prefill workers and every decode worker's local prefill queue).
Each task's predicted prefill time on this worker (``cost.t_pre(tp, l_hist, l_incr)``) is
computed once at ``push`` and kept beside the task, so ``pop`` and ``predicted_total`` never call
the cost model. ``pop(now, start_in_s)`` takes the time as an argument (and how long until the popped
task can start: a prefill worker with the KV overlap pops the next task while the current one still
computes); nothing reads a clock.

Agent hints: a yielding task (``PrefillTask.queue_yield_s`` > 0, a turn's negative priority) is
queued as if its input were ready that much later (``order_at``): ``push`` puts a task ahead of the
yielding tasks at the tail whose ``order_at`` is later than its own, and Algorithm 2 counts a
yielding task's wait from its ``order_at``. Tasks that do not yield keep their push order among
themselves, so with no hints every queue behaves as without them.

Every queue counts its pops: ``pops_choice`` (pops with two or more tasks queued, where an order had
to be chosen) and ``pops_reordered`` (pops that did not take the head): the reordering ablation's
evidence of how often Algorithm 2 had something to do and did it.
"""

from __future__ import annotations

from collections import deque
from heapq import heappop, heappush
from itertools import permutations

from .cost import pre_s
from .types import SLO, CostModel, PrefillTask

# Algorithm 2's default lookahead w: ampd.config's `reorder_window` (--reorder-window) takes it from here.
REORDER_WINDOW = 3

__all__ = [
    "PrefillQueue",
    "FCFSQueue",
    "TTFTAwareQueue",
    "ContinuumQueue",
    "QUEUES",
    "make_queue",
]

# An entry is a 3-item list [task, predicted t_pre, postponement counter]; lists are the cheapest
# mutable record in CPython and the counter belongs to this queue, not to the task (a value
# nobody assigns to).
_TASK = 0
_TPRE = 1
_POST = 2


def _insert(q: deque, e: list) -> None:
    """Queue entry ``e`` at the tail of ``q``, but ahead of the yielding entries there whose order
    time is later than its own (agent hints; a plain append when nothing yields)."""
    k = len(q)
    if k and q[-1][_TASK].queue_yield_s:
        at = e[_TASK].order_at
        while k and (t := q[k - 1][_TASK]).queue_yield_s and t.order_at > at:
            k -= 1
    if k == len(q):
        q.append(e)
    else:
        q.insert(k, e)


class PrefillQueue:
    """Base: FCFS storage in a deque of entries, running predicted total.

    ``push(task[, predicted_s])``; ``pop(now[, start_in_s]) -> PrefillTask`` (``IndexError`` when
    empty); ``len(q)``; ``tasks()`` in current order; ``predicted_total()`` = sum of predicted t_pre
    of queued tasks (what the worker publishes as ``WorkerView.queue_predicted_s``); ``predict(task)``.
    """

    __slots__ = ("name", "cost", "slo", "tp", "_q", "_total", "pops_choice", "pops_reordered")
    name: str  # set by each queue class

    def __init__(self, cost: CostModel, slo: SLO, tp: int):
        self.cost = cost
        self.slo = slo
        self.tp = tp
        self._q: deque[list] = deque()
        self._total = 0.0
        self.pops_choice = 0
        self.pops_reordered = 0

    def predict(self, task: PrefillTask) -> float:
        """Predicted prefill time of ``task`` on this queue's worker."""
        return pre_s(self.cost, self.tp, task.l_hist, task.l_incr)

    def push(self, task: PrefillTask, predicted_s: float | None = None) -> None:
        """Queue ``task``; ``predicted_s`` is its predicted time on this worker (default: its
        ``t_pre``; a prefill worker with the KV overlap passes compute + the transfers it still pays)."""
        t = pre_s(self.cost, self.tp, task.l_hist, task.l_incr) if predicted_s is None else predicted_s
        _insert(self._q, [task, t, 0])
        self._total += t

    def _take(self, e: list) -> PrefillTask:
        """Account for an entry that has just left ``self._q`` and return its task."""
        if self._q:
            self._total -= e[_TPRE]
        else:
            self._total = 0.0  # drop accumulated rounding error whenever the queue drains
        return e[_TASK]

    def pop(self, now: float, start_in_s: float = 0.0) -> PrefillTask:
        """The next task to run; it can start ``start_in_s`` seconds after ``now``."""
        if not self._q:
            raise IndexError(f"pop from an empty {self.name} prefill queue")
        if len(self._q) > 1:
            self.pops_choice += 1
        return self._take(self._q.popleft())

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def tasks(self) -> tuple[PrefillTask, ...]:
        return tuple(e[_TASK] for e in self._q)

    def discard(self, session_id: str, round: int) -> bool:
        """Remove the queued task of round ``round`` of ``session_id`` (its session ended while the
        task waited, a live worker's cancel); False when none is queued."""
        for q in self._deques():
            for e in q:
                t = e[_TASK]
                if t.session_id == session_id and t.round == round:
                    q.remove(e)
                    self._total = self._total - e[_TPRE] if len(self) else 0.0
                    return True
        return False

    def _deques(self) -> tuple[deque, ...]:
        return (self._q,)

    def predicted_total(self) -> float:
        t = self._total
        return t if t > 0.0 else 0.0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} tp={self.tp} len={len(self)} predicted={self.predicted_total():.4g}s>"


class FCFSQueue(PrefillQueue):
    """First come, first served (push order)."""

    __slots__ = ()

    def __init__(self, cost: CostModel, slo: SLO, tp: int):
        super().__init__(cost, slo, tp)
        self.name = "fcfs"


def _plans(n: int) -> tuple[tuple[tuple[int, ...], int, tuple[int, ...]], ...]:
    """Every ordering of a window of ``n`` tasks, identity first, as
    ``(order, postponed_mask, postponed_indices)``.

    ``order[k]`` is the window index placed at position ``k``. Window index ``i`` is *postponed*
    by an ordering when it lands at a later position than it holds now (``order.index(i) > i``).
    """
    out = []
    for order in permutations(range(n)):
        post = tuple(i for i in range(n) if order.index(i) > i)
        mask = 0
        for i in post:
            mask |= 1 << i
        out.append((order, mask, post))
    return tuple(out)


def _max_on_time(tpre: list[float], slack: list[float]) -> int:
    """Most tasks that can finish within their slack in any order (Moore-Hodgson: earliest
    deadline first, dropping the longest task whenever one runs late). Deadlines are relaxed by
    1 ns so that float rounding can only raise the bound, never lower it below an ordering's S."""
    c = 0.0
    kept: list[float] = []
    for d, t in sorted(zip(slack, tpre)):
        heappush(kept, -t)
        c += t
        if c > d + 1e-9:
            c += heappop(kept)
    return len(kept)


class TTFTAwareQueue(PrefillQueue):
    """Algorithm 2: TTFT-aware reordering inside a lookahead window, with a postponement cap.

    At each ``pop(now, start_in_s)`` the window ``W`` is the first ``min(w, len)`` tasks. Every
    ordering of ``W`` is scored ``S = #{k : (now - enqueued_at(k)) + start_in_s + C(k) <= slo.ttft_s}``,
    with ``C`` the prefix sums of predicted prefill times in that order (``enqueued_at``: the task's
    ``order_at``, later for a yielding task): completion times count from
    when the popped task can start (Eq. 3 measured from the worker's next free moment, so a pop made
    while the task in service still computes, the KV overlap's read ahead, scores the same window the
    same way as a pop made when the worker is idle). Orderings are enumerated identity first and
    only a strictly larger ``S`` replaces the best so far, so ties keep FCFS. An ordering is skipped
    when it would postpone a task whose counter already equals ``w``.

    *Postponed* (the definition this project uses): a task is postponed by the chosen ordering
    when it is placed at a later position in the window than the one it holds now. Each postponed
    task's counter is incremented, so no task is ever postponed more than ``w`` times. The chosen
    ordering replaces the window and its head is dequeued.
    """

    __slots__ = ("window", "pops_on_time", "_plans")

    def __init__(self, cost: CostModel, slo: SLO, tp: int, *, window: int = REORDER_WINDOW):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        super().__init__(cost, slo, tp)
        self.name = "ttft-aware"
        self.window = window
        # pops with a choice where the FCFS order already meets every window task's TTFT: nothing
        # for Algorithm 2 to gain there
        self.pops_on_time = 0
        # plans per window size n (1..window); index 0, 1 unused (no enumeration needed)
        self._plans = [()] * 2 + [_plans(n) for n in range(2, window + 1)]

    def pop(self, now: float, start_in_s: float = 0.0) -> PrefillTask:
        q = self._q
        size = len(q)
        if size <= 1 or self.window == 1:
            if not size:
                raise IndexError("pop from an empty ttft-aware prefill queue")
            if size > 1:
                self.pops_choice += 1
            return self._take(q.popleft())
        self.pops_choice += 1
        n = self.window if size > self.window else size
        win = [q[k] for k in range(n)]
        ttft = self.slo.ttft_s
        cap = self.window
        # waited[i]: how long task i will have waited when the popped task starts; it meets TTFT
        # when waited[i] + C <= ttft (Eq. 4)
        at = now + start_in_s
        # (from each task's order time: a yielding task counts as ready queue_yield_s later)
        waited = [at - (t.enqueued_at + t.queue_yield_s) for t in (e[_TASK] for e in win)]
        tpre = [e[_TPRE] for e in win]
        capped = 0
        for i in range(n):
            if win[i][_POST] >= cap:
                capped |= 1 << i
        # Stop at the first ordering that reaches an upper bound on S: with a small window that
        # is all n; with a larger one, the Moore-Hodgson optimum (a bound, as caps only remove
        # orderings). Stopping there returns the same ordering as the full enumeration.
        ub = n if n <= 3 else _max_on_time(tpre, [ttft - x for x in waited])
        best = -1
        best_order: tuple[int, ...] = ()
        best_post: tuple[int, ...] = ()
        first = True
        for order, mask, post in self._plans[n]:
            if mask & capped:
                continue
            c = 0.0
            s = 0
            for i in order:
                c += tpre[i]
                if waited[i] + c <= ttft:
                    s += 1
            if first:  # the identity (FCFS): caps never skip it, it postpones nobody
                first = False
                if s == n:
                    self.pops_on_time += 1
            if s > best:
                best = s
                best_order = order
                best_post = post
                if s >= ub:
                    break
        if not best_post:  # identity (FCFS) chosen
            return self._take(q.popleft())
        self.pops_reordered += 1
        for i in best_post:
            win[i][_POST] += 1
        for _ in range(n):
            q.popleft()
        for k in range(n - 1, 0, -1):
            q.appendleft(win[best_order[k]])
        return self._take(win[best_order[0]])

    def postponements(self) -> tuple[int, ...]:
        """Postponement counter of every queued task, in current order."""
        return tuple(e[_POST] for e in self._q)


class ContinuumQueue(PrefillQueue):
    """Continuum-style session priority: tasks of sessions already running (``round >= 1``:
    their KV is resident, pinned through the tool call) go before new sessions' initial prefills
    (``round == 0``); FCFS within each class."""

    __slots__ = ("_new", "_seq")

    def __init__(self, cost: CostModel, slo: SLO, tp: int):
        super().__init__(cost, slo, tp)
        self.name = "continuum"
        self._seq = 0
        self._new: deque[list] = deque()  # round-0 tasks; self._q holds round >= 1 tasks

    def push(self, task: PrefillTask, predicted_s: float | None = None) -> None:
        t = pre_s(self.cost, self.tp, task.l_hist, task.l_incr) if predicted_s is None else predicted_s
        # the third slot (no postponement here) holds the push order, to count the overtakes
        self._seq += 1
        _insert(self._q if task.round >= 1 else self._new, [task, t, self._seq])
        self._total += t

    def pop(self, now: float, start_in_s: float = 0.0) -> PrefillTask:
        n = len(self._q) + len(self._new)
        if n > 1:
            self.pops_choice += 1
        if self._q:
            if self._new and self._new[0][_POST] < self._q[0][_POST]:
                self.pops_reordered += 1  # a running session's task overtakes an older new one
            e = self._q.popleft()
        elif self._new:
            e = self._new.popleft()
        else:
            raise IndexError("pop from an empty continuum prefill queue")
        self._total -= e[_TPRE]
        if not self._q and not self._new:
            self._total = 0.0
        return e[_TASK]

    def __len__(self) -> int:
        return len(self._q) + len(self._new)

    def __bool__(self) -> bool:
        return bool(self._q) or bool(self._new)

    def tasks(self) -> tuple[PrefillTask, ...]:
        return tuple(e[_TASK] for e in self._q) + tuple(e[_TASK] for e in self._new)

    def _deques(self) -> tuple[deque, ...]:
        return (self._q, self._new)


# The queue registry: name -> builder(cost, slo, tp, window). Policies name their queues here.
_QUEUE_BUILDERS = {
    "fcfs": lambda cost, slo, tp, window: FCFSQueue(cost, slo, tp),
    "ttft-aware": lambda cost, slo, tp, window: TTFTAwareQueue(cost, slo, tp, window=window),
    "continuum": lambda cost, slo, tp, window: ContinuumQueue(cost, slo, tp),
}
QUEUES: tuple[str, ...] = tuple(_QUEUE_BUILDERS)


def make_queue(name: str, cost: CostModel, slo: SLO, tp: int, *, window: int = REORDER_WINDOW) -> PrefillQueue:
    """Build a prefill queue for a worker of degree ``tp``: ``"fcfs"``, ``"ttft-aware"``
    (Algorithm 2 with lookahead ``window``) or ``"continuum"``. Unknown names raise ``ValueError``."""
    build = _QUEUE_BUILDERS.get(name)
    if build is None:
        raise ValueError(f"unknown prefill queue {name!r}; valid queues: {', '.join(QUEUES)}")
    return build(cost, slo, tp, window)
