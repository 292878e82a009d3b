"""Prefill worker core: one task at a time, lazily reading the history KV at dequeue."""
from __future__ import annotations

import asyncio
import time

import structlog

from ampd.engine.base import Engine
from ampd.kv import Segment, SessionKV, verify_pattern
from ampd.policy import QueuedTask
from ampd.v1 import common_pb2, prefill_pb2
from ampd.runtime import WorkerRuntime

log = structlog.get_logger()


def segs(pb) -> list[Segment]:
    return [Segment(s.block, s.offset, s.tokens) for s in pb]


class PrefillCore:
    def __init__(self, rt: WorkerRuntime, engine: Engine, cost=None) -> None:
        self.rt = rt
        self.engine = engine
        self.cost = cost  # the profile: predicts the task in service (queue_predicted_s)
        self.tasks: dict[tuple[str, int], common_pb2.PrefillTask] = {}
        self.wake = asyncio.Event()
        self.metrics: dict[str, float] = {
            "tasks_submitted": 0, "tasks_done": 0, "tasks_failed": 0,
            "kv_bytes_verified": 0, "kv_bytes_mismatched": 0,
            "history_tokens_read": 0, "new_tokens_written": 0,
        }
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="prefill-loop")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submit(self, task: common_pb2.PrefillTask) -> None:
        key = (task.session_id, task.round)
        if key in self.tasks:
            raise ValueError(f"session {task.session_id!r} round {task.round} is already queued here")
        self.tasks[key] = task
        # The queue sees the time the round's input became ready: TTFT runs from there.
        self.rt.queue.push(QueuedTask(task.session_id, task.round, task.l_hist, task.l_incr, task.input_ready))
        self.metrics["tasks_submitted"] += 1
        self.rt.changed()
        self.wake.set()

    async def _loop(self) -> None:
        while True:
            if not len(self.rt.queue):
                self.wake.clear()
                await self.wake.wait()
                continue
            q = self.rt.queue.pop(time.time())
            self.rt.changed()
            task = self.tasks.pop((q.session_id, q.round))
            if self.cost is not None:
                c = self.cost
                self.rt.busy_until = time.time() + c.t_pre(self.rt.cfg.tp, task.l_hist, task.l_incr) + (
                    c.t_kv(task.l_hist, task.decode_tp, self.rt.cfg.tp) if task.l_hist else 0.0) + (
                    c.t_kv(task.l_incr, self.rt.cfg.tp, task.decode_tp))
            try:
                await self._run(task)
            finally:
                self.rt.busy_until = 0.0

    async def _run(self, task: common_pb2.PrefillTask) -> None:
        rt = self.rt
        kv = SessionKV(rt.pool.block_tokens)
        done = prefill_pb2.PrefillDone(session_id=task.session_id, round=task.round,
                                       prefill_worker=rt.cfg.worker_id, started=time.time())
        peer = ""
        try:
            peer = await rt.ensure_peer(task.decode_worker)
            # Lazy read: the history KV moves only now that the task runs.
            local_hist = kv.reserve(rt.pool, task.l_hist)
            if task.l_hist:
                started = time.monotonic()
                await rt.transport.read(peer, segs(task.history), local_hist)
                await self.engine.pace_transfer(started, task.l_hist, task.decode_tp, rt.cfg.tp)
                data = rt.pool.read(local_hist)
                bad = verify_pattern(task.session_id, 0, data, rt.pool.layout.bytes_per_token)
                self.metrics["kv_bytes_verified"] += data.size
                self.metrics["kv_bytes_mismatched"] += bad
                self.metrics["history_tokens_read"] += task.l_hist
                if bad:
                    raise RuntimeError(f"history KV read from {task.decode_worker} has {bad} wrong bytes")
            kv.commit(task.l_hist)
            local_new = kv.reserve(rt.pool, task.l_incr)
            done.first_token = await self.engine.prefill(
                task.session_id, task.l_hist, task.l_incr, rt.pool, local_new)
            started = time.monotonic()
            await self.engine.pace_transfer(started, task.l_incr, rt.cfg.tp, task.decode_tp)
            done.finished = time.time()
            done.kv_bytes = await rt.transport.write(
                peer, local_new, segs(task.dest), done.SerializeToString())
            self.metrics["new_tokens_written"] += task.l_incr
            self.metrics["tasks_done"] += 1
            rt.window.add(time.time(), time.time() - task.input_ready)
        except Exception as exc:  # noqa: BLE001 - any failure ends this task, never the worker
            self.metrics["tasks_failed"] += 1
            log.warning("prefill failed", session=task.session_id, round=task.round, error=str(exc))
            if peer:
                done.error = str(exc) or type(exc).__name__
                try:
                    await rt.transport.send_notif(peer, done.SerializeToString())
                except Exception as exc2:
                    log.warning("failure notification lost", session=task.session_id, error=str(exc2))
        finally:
            kv.release(rt.pool)
            rt.changed()
