"""Prefill worker core: its queue (Algorithm 2), the task in service, the KV read ahead, its view.

Pure: no I/O, no clock; every call takes the time. A driver (the live prefill service, the simulator)
runs what the core says and reports back::

    core.schedule(now)            -> PrefillWork | None   idle: the task to run now, or None
    core.update(work, now)        -> PrefillTask     ``work`` ended: its new KV is written back (the
                                                     TTFT sample)

and events::

    core.submit(task, now)        -> KvRead | None   queue a task (with the overlap, a read may start)
    core.compute_started(now)     -> KvRead | None   its compute begins (after its history read):
                                                     with the overlap, the next task is popped and its
                                                     history KV read starts now
    core.abort(now)               -> PrefillTask     live: it failed (no sample)
    core.replan(compute_at, busy_until)              a driver that knows better (the simulator's NIC
                                                     contention) moves the task's compute and end
    core.read_ahead_until(end)                       ... and the end of the read ahead
    core.view(now)                -> WorkerView      what the coordinator sees

A task's life: history KV in (``read_s``), compute (``compute_s``), new KV back (``write_s``),
timed by ``ampd.policy.remote_parts`` (Eq. 2's terms). The read is lazy: a task's history moves only
once it leaves the queue. With ``kv_overlap`` (the paper's section 6) the next task leaves the queue
when the current one starts computing, and its read runs while the current task computes and writes
back (at most one read ahead); a task that arrives while the worker computes and nothing is read ahead
starts its read at once. Without it, the worker reads, computes and writes one task at a time.

Published queue (``WorkerView.queue_predicted_s``): the queued tasks' predicted times plus the
remaining time of the task in service. With the overlap, each queued task counts its compute, its
write-back and the part of its read that the task before it (at push time: the last queued task, or
the one read ahead) does not hide, and the task read ahead counts its compute, its write-back and
whatever of its read outlasts the task in service; Algorithm 2 orders the queue by these same times,
counted from when the popped task can start (a read ahead pops while the task in service still has
its compute and write-back to go).
Without the overlap, a queued task counts its compute only (the paper's Eq. 2 queue term).
"""
from __future__ import annotations

from dataclasses import dataclass

from ampd.policy.cost import remote_parts
from ampd.policy.reorder import PrefillQueue
from ampd.policy.types import CostModel, PrefillTask, WorkerView
from ampd.window import STATS_WINDOW_S, WindowedMean

__all__ = ["PrefillCore", "PrefillWork", "KvRead"]


@dataclass(slots=True, init=False)
class PrefillWork:
    """Run ``task`` now: ``read_s`` of history KV still to read (0 when it was read ahead, or has no
    history), then ``compute_s``, then ``write_s`` to write its new KV back. ``total_s`` is their sum
    (Eq. 2 less its queue term when nothing was read ahead). ``was_ahead``: its read started earlier
    (the overlap's read ahead) and ``read_s`` is what is left of it."""

    task: PrefillTask
    read_s: float
    compute_s: float
    write_s: float
    total_s: float
    was_ahead: bool = False

    # (written out: compiled, a dataclass's generated __init__ runs as interpreted Python; tests/unit/test_inits.py
    # holds it to the fields)
    def __init__(self, task: PrefillTask, read_s: float, compute_s: float, write_s: float, total_s: float,
                 was_ahead: bool = False) -> None:
        self.task = task
        self.read_s = read_s
        self.compute_s = compute_s
        self.write_s = write_s
        self.total_s = total_s
        self.was_ahead = was_ahead


@dataclass(slots=True, init=False)
class KvRead:
    """Start reading ``task``'s history KV now (``seconds`` long): the read ahead of the overlap."""

    task: PrefillTask
    seconds: float

    # (written out: compiled, a dataclass's generated __init__ runs as interpreted Python; tests/unit/test_inits.py
    # holds it to the fields)
    def __init__(self, task: PrefillTask, seconds: float) -> None:
        self.task = task
        self.seconds = seconds


class PrefillCore:
    """State of one prefill worker (see the module docstring for the protocol).

    ``busy_until`` is the predicted end of the task in service and ``compute_at`` when its compute
    starts; a driver that knows better (the simulator's NIC contention) moves them with ``replan``,
    and ``ahead_read_end`` (the read ahead's end) with ``read_ahead_until``. A task submitted once
    ``compute_at`` has passed starts its read ahead even if ``compute_started`` was not called (it
    only matters when tasks wait in the queue at that moment)."""

    __slots__ = ("worker_id", "tp", "cost", "queue", "window", "kv_overlap", "kv_capacity_tokens",
                 "current", "computing", "compute_at", "busy_until", "ahead", "ahead_parts", "ahead_read_end",
                 "_tail_cw", "_parts", "tasks", "queue_ver", "queue_len",
                 "view_queue_ver", "view_queue", "view_queue_s", "last_view", "view_tasks")

    def __init__(self, worker_id: str, tp: int, cost: CostModel, queue: PrefillQueue, *,
                 window_s: float = STATS_WINDOW_S, kv_overlap: bool = True, kv_capacity_tokens: int = 0):
        self.worker_id = worker_id
        self.tp = tp
        self.cost = cost
        self.queue = queue
        self.window = WindowedMean(window_s)
        self.kv_overlap = kv_overlap
        self.kv_capacity_tokens = kv_capacity_tokens
        self.current: PrefillTask | None = None  # the task in service (reading, computing, writing)
        self.computing = False  # the task in service has finished its history read
        self.compute_at = 0.0  # when the task in service starts computing (its read's end)
        self.busy_until = 0.0
        self.ahead: PrefillTask | None = None  # the next task, its history read under way
        self.ahead_parts = (0.0, 0.0, 0.0)
        self.ahead_read_end = 0.0
        self._tail_cw = 0.0  # compute + write of the last queued task (what hides the next read)
        self._parts: dict[int, tuple[float, float, float]] = {}  # id(queued task) -> its Eq. (2) terms
        self.tasks = 0
        self.queue_ver = 0  # pushes + pops of the queue (the view's queue copy is rebuilt when it moves)
        self.queue_len = 0
        # the view's cache: the queue copy (rebuilt when queue_ver moved) and the last view
        self.view_queue_ver = -1
        self.view_queue: tuple = ()
        self.view_queue_s = 0.0  # the copied queue's predicted total
        self.last_view: WorkerView | None = None
        # views carry a copy of the queued tasks (WorkerView.queue); a driver whose readers use only
        # queue_predicted_s (the simulator) sets False and views carry ()
        self.view_tasks = True

    # ----------------------------------------------------------------------------- the protocol
    def submit(self, task: PrefillTask, now: float) -> KvRead | None:
        """Queue ``task``. With the overlap, a task arriving while the worker computes with nothing
        read ahead leaves the queue at once and its read starts (returned)."""
        if not self.kv_overlap:
            self.queue.push(task)
        else:
            parts = remote_parts(self.cost, task.l_hist, task.l_incr, task.decode_tp, self.tp)
            self._parts[id(task)] = parts  # a queued task is alive, so its id is unique meanwhile
            read, comp, write = parts
            if self.queue_len:
                hide = self._tail_cw
            elif self.ahead is not None:
                hide = self.ahead_parts[1] + self.ahead_parts[2]
            else:
                hide = 0.0
            exposed = read - hide if read > hide else 0.0
            self._tail_cw = comp + write
            self.queue.push(task, comp + write + exposed)
        self.queue_ver += 1
        self.queue_len += 1
        if self.kv_overlap and self.ahead is None and self.current is not None and (
                self.computing or now >= self.compute_at):
            return self._read_ahead(now)
        return None

    def schedule(self, now: float) -> PrefillWork | None:
        """When idle: the task to run now (the one read ahead, else Algorithm 2's pick), or None."""
        if self.current is not None:
            return None
        if self.ahead is not None:
            task = self.ahead
            read, comp, write = self.ahead_parts
            read = self.ahead_read_end - now if self.ahead_read_end > now else 0.0
            self.ahead = None
            was_ahead = True
        elif self.queue_len:
            task = self.queue.pop(now)
            self.queue_ver += 1
            self.queue_len -= 1
            read, comp, write = self._parts_of(task)
            was_ahead = False
        else:
            return None
        self.current = task
        self.computing = False
        self.tasks += 1
        total = comp + read + write  # remote_prefill_s's order: the same float as Eq. (2)
        self.busy_until = now + total
        self.compute_at = now + read
        # positional, in PrefillWork's field order (one is built per remote prefill)
        return PrefillWork(task, read, comp, write, total, was_ahead)

    def compute_started(self, now: float) -> KvRead | None:
        """The task in service has its history: with the overlap, the next task leaves the queue
        and its history read starts now (returned)."""
        self.computing = True
        if self.kv_overlap and self.ahead is None and self.queue_len:
            return self._read_ahead(now)
        return None

    def update(self, work: PrefillWork, now: float) -> PrefillTask:
        """``work`` (the task in service) wrote its new KV back: its TTFT (from ``enqueued_at``) is
        sampled."""
        task = self.current
        if task is None:
            raise RuntimeError(f"{self.worker_id}: update() with no task in service")
        if task is not work.task:
            raise RuntimeError(f"{self.worker_id}: update() of {work.task.session_id!r}, not the task in service")
        self.current = None
        self.computing = False
        self.window.add(now, now - task.enqueued_at, 1)
        return task

    def replan(self, compute_at: float, busy_until: float) -> None:
        """The task in service computes from ``compute_at`` and ends at ``busy_until`` (a driver
        that times its transfers itself: the simulator's NIC contention)."""
        self.compute_at = compute_at
        self.busy_until = busy_until

    def read_ahead_until(self, end: float) -> None:
        """The read ahead ends at ``end`` (a driver that times its transfers itself)."""
        self.ahead_read_end = end

    def abort(self, now: float) -> PrefillTask:
        """The task in service failed (live: a transfer or the engine): it leaves service with no
        TTFT sample. A task read ahead stays next."""
        task = self.current
        if task is None:
            raise RuntimeError(f"{self.worker_id}: abort() with no task in service")
        self.current = None
        self.computing = False
        return task

    def _read_ahead(self, now: float) -> KvRead:
        # Algorithm 2 scores the window from when the popped task can start computing: after the
        # task in service has computed and written back (issue 26: scoring from now let a fresh
        # task go before one that had waited, and the waiting one missed its TTFT)
        start_in = self.busy_until - now if self.current is not None and self.busy_until > now else 0.0
        task = self.queue.pop(now, start_in)
        self.queue_ver += 1
        self.queue_len -= 1
        parts = self._parts_of(task)
        self.ahead = task
        self.ahead_parts = parts
        self.ahead_read_end = now + parts[0]
        return KvRead(task, parts[0])

    def _parts_of(self, task: PrefillTask) -> tuple[float, float, float]:
        """Eq. (2)'s terms of a task leaving the queue (computed at submit with the overlap)."""
        parts = self._parts.pop(id(task), None)
        if parts is None:
            parts = remote_parts(self.cost, task.l_hist, task.l_incr, task.decode_tp, self.tp)
        return parts

    # ----------------------------------------------------------------------------------- view
    @property
    def busy(self) -> bool:
        return self.current is not None

    def view(self, now: float) -> WorkerView:
        """The published view: windowed TTFT, the queue, and ``queue_predicted_s`` (the module
        docstring says what it counts). The same object is returned while nothing in it changed."""
        mean = self.window.mean(now)
        residual = self.busy_until - now if self.current is not None and self.busy_until > now else 0.0
        if self.view_queue_ver != self.queue_ver:  # the queue changed: copy it once, not per view
            if self.view_tasks:
                self.view_queue = self.queue.tasks()
            self.view_queue_s = self.queue.predicted_total()
            self.view_queue_ver = self.queue_ver
        pred = self.view_queue_s + residual
        if self.ahead is not None:
            _, comp, write = self.ahead_parts
            late = self.ahead_read_end - (self.busy_until if self.current is not None else now)
            pred += comp + write + (late if late > 0.0 else 0.0)
        v = self.last_view
        # the last view holds while everything it shows is unchanged, its predicted queue included
        # (a view cached during a service must not outlive the service's residual time)
        if v is not None and v.queue is self.view_queue and mean == v.window_mean_s and pred == v.queue_predicted_s:
            return v
        # positional, in WorkerView's field order (worker_id, kind, tp, window_mean_s, queue,
        # kv_free_tokens, queue_predicted_s): 174 ns against 535 ns with keywords (timeit); a view
        # is built per change and read per routing decision
        v = self.last_view = WorkerView(self.worker_id, "prefill", self.tp, mean, self.view_queue,
                                        self.kv_capacity_tokens, pred)
        return v
