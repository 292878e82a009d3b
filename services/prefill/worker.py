"""Prefill worker service: drives the pure prefill core (``ampd.worker.PrefillCore``) with the
engine, the KV pool and NIXL.

The core decides which task runs next (Algorithm 2's queue), when a history read starts and what is
published. This module moves the bytes: a task's history KV is read from its decode worker (lazily:
only once the task leaves the queue), computed, and its new KV written back with a NIXL notification.
With ``kv_overlap`` the core starts the next task's history read when the current task starts
computing (``KvRead``, at most one read ahead); it runs here as its own asyncio task and the next task
awaits what is left of it. Without it, one task at a time: read, compute, write.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

import structlog

from ampd import tracing
from ampd.engine.base import Engine
from ampd.kv import PatternCache, Segment, SessionKV
from ampd.policy import PrefillTask, WorkerView
from ampd.runtime import WorkerRuntime, sampling_of
from ampd.v1 import common_pb2, prefill_pb2
from ampd.worker import KvRead, PrefillCore, PrefillWork

log = structlog.get_logger()


@dataclass(eq=False)
class _Job:
    """One task's I/O: its KV here, the decode worker's NIXL agent, when its history read ran."""

    task: common_pb2.PrefillTask
    kv: SessionKV
    peer: str = ""
    read_start: float = 0.0
    read_end: float = 0.0
    reading: asyncio.Task | None = None  # its history read, when it runs ahead
    history: list[Segment] = dataclasses.field(default_factory=list)  # its history KV here


class PrefillWorker:
    def __init__(self, rt: WorkerRuntime, engine: Engine, core: PrefillCore) -> None:
        self.rt = rt
        self.engine = engine
        self.core = core
        self.tasks: dict[tuple[str, int], common_pb2.PrefillTask] = {}  # queued in the core
        self.ahead: _Job | None = None  # the task whose history is read while another computes
        self.running: _Job | None = None  # the task in service
        self.wake = asyncio.Event()
        self.metrics: dict[str, float] = {
            "tasks_submitted": 0, "tasks_done": 0, "tasks_failed": 0,
            "kv_bytes_verified": 0, "kv_bytes_mismatched": 0,
            "history_tokens_read": 0, "history_tokens_read_host": 0, "new_tokens_written": 0,
            # the overlap: history reads started while another task was in service, and the
            # seconds of them that ran before that task left service (hidden behind it)
            "kv_reads_ahead": 0, "kv_read_hidden_s": 0.0,
        }
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # hand-backs in flight (cancelled on stop)
        self.patterns = PatternCache()  # the mock's KV of sessions' first positions, for the check
        # tasks taken before a coordinator fenced this worker out: handed back, never written
        self.dropped: set[tuple[str, int]] = set()
        # When this worker last came back from a silence or a fence (unix time): a task whose input
        # was ready before then was sent while it was stopped, and its sender has given it up since
        self.resumed_at = 0.0
        self.enqueued: dict[tuple[str, int], float] = {}  # when each task came (its spans; tracing on only)
        rt.published = self.published
        rt.on_fenced = self.fenced
        rt.on_silent = lambda _silence: self.fenced()  # its rounds may have been re-routed meanwhile

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="prefill-loop")

    def _spawn(self, coro) -> None:
        """Runs ``coro`` in the background; ``stop`` cancels and awaits it."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stop(self) -> None:
        """Stops at once; every task queued or running here is handed back to its decode worker
        (a PrefillDone with an error: the decode worker runs the round locally)."""
        running = self.running  # the loop's cancel releases its KV
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        background = list(self._background)  # hand-backs in flight (a lost one is bounded: _hand_back)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        unfinished = list(self.tasks.values()) + ([running.task] if running is not None else [])
        self.tasks.clear()
        job, self.ahead = self.ahead, None
        if job is not None:
            unfinished.append(job.task)
            job.reading.cancel()
            await asyncio.gather(job.reading, return_exceptions=True)
            job.kv.release(self.rt.pool)
        for task in unfinished:
            await self._hand_back(task, f"prefill worker {self.rt.cfg.worker_id} shutting down")

    async def _hand_back(self, task, error: str, peer: str = "") -> None:
        """Tells the task's decode worker that this worker will not write its KV (it runs the round
        itself, or frees the blocks of an ended session). The task's token proves the notification
        is about that task. A lost notification is bounded too: the decode worker's own wait for
        it ends (DecodeWorker.remote_wait_s)."""
        done = prefill_pb2.PrefillDone(session_id=task.session_id, round=task.round, task_token=task.task_token,
                                       prefill_worker=self.rt.cfg.worker_id, error=error)
        try:
            peer = peer or self.rt.known_peer(task.decode_worker) or await asyncio.wait_for(
                self.rt.ensure_peer(task.decode_worker), 2.0)
            await self.rt.transport.send_notif(peer, done.SerializeToString())
        except Exception as exc:  # noqa: BLE001 - the coordinator re-routes it when this worker is gone
            log.warning("hand-back notification lost", session=task.session_id, error=str(exc))

    async def fenced(self) -> None:
        """A coordinator fenced this worker out while it was stopped (``WorkerRuntime.on_fenced``): it
        already gave every round submitted here to its decode worker, so none of them is written: the
        queued ones, the one read ahead and the one in service are each handed back as they come up."""
        self.resumed_at = time.time()
        self.dropped.update(self.tasks)
        for job in (self.ahead, self.running):
            if job is not None:
                self.dropped.add(self._key(job.task))

    def published(self, now: float) -> tuple[WorkerView, float]:
        core = self.core
        v = dataclasses.replace(core.view(now), kv_free_tokens=self.rt.pool.free_tokens)
        return v, (core.busy_until if core.busy else 0.0)

    def submit(self, task: common_pb2.PrefillTask) -> None:
        key = (task.session_id, task.round)
        if key in self.tasks or (self.ahead is not None and self._key(self.ahead.task) == key):
            raise ValueError(f"session {task.session_id!r} round {task.round} is already queued here")
        if task.input_ready <= self.resumed_at:
            # Sent before this worker resumed (buffered while it was stopped): its sender gave it to
            # the decode worker meanwhile, so it is never run here, only handed back.
            log.warning("task sent while this worker was stopped; handed back", session=task.session_id,
                        round=task.round)
            self._spawn(self._hand_back(task, "sent while the prefill worker was stopped"))
            return
        self.tasks[key] = task
        if tracing.on:
            self.enqueued[key] = time.time()
        # The queue sees the time the round's input became ready: TTFT runs from there (a yielding
        # turn's queue_yield_s only orders it later).
        read = self.core.submit(PrefillTask(task.session_id, task.round, task.l_hist, task.l_incr,
                                            task.input_ready, task.decode_worker, task.decode_tp,
                                            queue_yield_s=task.queue_yield_s), time.time())
        self._read_ahead(read)
        self.metrics["tasks_submitted"] += 1
        self.rt.took(task.session_id, task.round)
        self.wake.set()

    @staticmethod
    def _key(task) -> tuple[str, int]:
        return task.session_id, task.round

    # ------------------------------------------------------------------------------- the loop
    async def _loop(self) -> None:
        while True:
            work = self.core.schedule(time.time())
            if work is None:
                self.wake.clear()
                await self.wake.wait()
                continue
            self.rt.changed()
            await self._run(work)

    def _read_ahead(self, read: KvRead | None) -> None:
        """The core started a read ahead: run it while the task in service computes."""
        if read is None:
            return
        job = _Job(self.tasks.pop(self._key(read.task)), SessionKV(self.rt.pool.block_tokens))
        job.reading = asyncio.create_task(self._read(job), name="kv-read-ahead")
        self.ahead = job
        if job.task.l_hist:
            self.metrics["kv_reads_ahead"] += 1

    def _take(self, work: PrefillWork) -> _Job:
        """The job of the task the core put in service (the one read ahead, or a new one)."""
        job = self.ahead
        if job is not None and self._key(job.task) == self._key(work.task):
            self.ahead = None
            now = time.time()
            # the part of its read that ran before the task before it left service
            self.metrics["kv_read_hidden_s"] += max(0.0, min(job.read_end or now, now) - job.read_start)
            return job
        return _Job(self.tasks.pop(self._key(work.task)), SessionKV(self.rt.pool.block_tokens))

    async def _read(self, job: _Job) -> None:
        """Lazy read: the history KV moves only now that the task left the queue."""
        rt, task = self.rt, job.task
        job.read_start = time.time()
        # the read and its check are the task's path: a stats publication waits for them
        with rt.urgent():
            job.peer = await rt.ensure_peer(task.decode_worker)
            local_hist = job.history = job.kv.reserve(rt.pool, task.l_hist)
            if task.l_hist:
                started = time.monotonic()
                # a history on host: from the decode worker's host tier (its fetch back runs meanwhile)
                src = rt.host_agent(task.decode_worker) if task.history_on_host else job.peer
                await rt.transport.read(src, task.history, local_hist)
                # a read that ends after this worker was stopped or fenced out is not checked: the decode
                # worker may have reused its blocks meanwhile, and stale bytes are not corruption
                self._check_current(task)
                if self.engine.capabilities.patterned_kv:  # the mock's KV is a function of (session, position): check it
                    data = rt.pool.read(local_hist, copy=False)
                    bad = self.patterns.verify(task.session_id, data, rt.pool.layout.bytes_per_token,
                                               task.prefix_tokens)
                    self.metrics["kv_bytes_verified"] += data.size
                    self.metrics["kv_bytes_mismatched"] += bad
                    if bad:
                        raise RuntimeError(f"history KV read from {task.decode_worker} has {bad} wrong bytes")
        if task.l_hist:
            await self.engine.pace_transfer(started, task.l_hist, task.decode_tp, rt.cfg.tp)
            self.metrics["history_tokens_read"] += task.l_hist
            if task.history_on_host:
                self.metrics["history_tokens_read_host"] += task.l_hist
        job.kv.commit(task.l_hist)
        job.read_end = time.time()

    async def _run(self, work: PrefillWork) -> None:
        # The task's path, from taking it to its notification: a stats publication waits for its
        # end, at most PUBLISH_HOLD_S (a long prefill publishes during its compute).
        with self.rt.urgent():
            await self._serve(work)

    async def _serve(self, work: PrefillWork) -> None:
        rt = self.rt
        job = self.running = self._take(work)
        task = job.task
        # started: when the task left the queue (a task read ahead left it when its read began)
        done = prefill_pb2.PrefillDone(session_id=task.session_id, round=task.round, task_token=task.task_token,
                                       prefill_worker=rt.cfg.worker_id, started=job.read_start or time.time())
        try:
            self._check_current(task)
            if job.reading is not None:
                await job.reading  # what is left of its read ahead (raises what the read raised)
            else:
                await self._read(job)
            computing = time.time()
            self._read_ahead(self.core.compute_started(computing))
            local_new = job.kv.reserve(rt.pool, task.l_incr)
            # an engine that keeps the KV itself (sglang) gets the history's ids instead of reading them
            extra = {"history_ids": task.history_token_ids} if task.history_token_ids else {}
            if task.prefix_tokens and self.engine.capabilities.patterned_kv:  # --prefix-sharing
                extra["prefix_tokens"] = task.prefix_tokens
            done.first_token = await self.engine.prefill(
                task.session_id, task.l_hist, task.l_incr, rt.pool, local_new, token_ids=task.token_ids,
                history_kv=job.history, sampling=sampling_of(task.sampling), **extra)
            if task.history_token_ids:
                self.engine.forget(task.session_id)  # the session lives on its decode worker
            started = time.monotonic()
            await self.engine.pace_transfer(started, task.l_incr, rt.cfg.tp, task.decode_tp)
            done.finished = time.time()
            self._check_current(task)  # the write is what a fenced worker must never do
            done.kv_bytes = await rt.transport.write(
                job.peer, local_new, task.dest, done.SerializeToString())
            self.metrics["new_tokens_written"] += task.l_incr
            self.metrics["tasks_done"] += 1
            written = time.time()
            self.core.update(work, written)
            if tracing.on:
                _task_spans(rt.cfg.worker_id, task, self.enqueued.pop(self._key(task), done.started), job,
                            computing, done.finished, written)
        except Exception as exc:  # noqa: BLE001 - any failure ends this task, never the worker
            self.core.abort(time.time())
            self.metrics["tasks_failed"] += 1
            log.warning("prefill failed", session=task.session_id, round=task.round, error=str(exc))
            if tracing.on:
                tracing.record("prefill", self.enqueued.pop(self._key(task), done.started), time.time(),
                               tracing.round_context(task.session_id, task.round),
                               {"ampd.worker": rt.cfg.worker_id, "ampd.round": task.round}, error=str(exc))
            await self._hand_back(task, str(exc) or type(exc).__name__, job.peer)
        finally:
            self.dropped.discard(self._key(task))
            job.kv.release(rt.pool)
            self.running = None
            rt.changed()

    def _check_current(self, task) -> None:
        """Raises when this worker may no longer write ``task``'s KV: it was fenced out since taking
        it, or it has been silent past its liveness TTL (stopped: the coordinator may have given the
        round to its decode worker already). Its decode worker then runs the round (the hand-back)."""
        silent = self.rt.silent()
        if silent:
            raise RuntimeError(f"prefill worker {self.rt.cfg.worker_id} was silent for {silent:.1f} s (stopped?); "
                               "the round runs on its decode worker")
        if self._key(task) in self.dropped:
            raise RuntimeError(f"prefill worker {self.rt.cfg.worker_id} was fenced out or silent since it took "
                               "the task; the round runs on its decode worker")


def _task_spans(worker: str, task, enqueued: float, job: _Job, computing: float, computed: float,
                written: float) -> None:
    """A remote prefill's spans (tracing on), under its round's: its wait in the queue (Algorithm 2),
    the read of its history KV over NIXL, its compute and the write of its new KV back."""
    base = {"ampd.session_id": task.session_id, "ampd.round": task.round, "ampd.worker": worker}
    left = job.read_start or computing  # it left the queue when its read began
    span = tracing.record("prefill", enqueued, written, tracing.round_context(task.session_id, task.round), {
        **base, "ampd.route.local": False, "ampd.l_hist": task.l_hist, "ampd.l_incr": task.l_incr,
        "ampd.decode_worker": task.decode_worker})
    tracing.record("queue_wait", enqueued, left, span, base)
    tracing.record("kv_read", left, job.read_end or left, span, {**base, "ampd.kv.tokens": task.l_hist})
    tracing.record("compute", computing, computed, span, base)
    tracing.record("kv_write", computed, written, span, {**base, "ampd.kv.tokens": task.l_incr})
