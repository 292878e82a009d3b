"""The decode worker's engine loop: it runs what the core schedules (``DecodeCore.schedule``), a
local prefill (or one chunk of it) or one decode step of the batch, on the engine, and reports each
end to the core (``DecodeCore.update``). Sessions that end while a step is in flight are forgotten
by the core after it (``forget``)."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from ampd import tracing
from ampd.engine.base import DecodeSeq
from ampd.kv import KVPoolExhausted
from ampd.v1 import common_pb2, decode_pb2
from ampd.worker import DecodeRun, LocalPrefill
from services.decode.session import emit, FINISH_LENGTH, Session
from services.decode.streamed import stops_of

if TYPE_CHECKING:
    from services.decode.worker import DecodeWorker

log = structlog.get_logger()


class EngineLoop:
    """Runs the core's work on the engine, one item at a time (``start``; ``stop`` cancels it)."""

    def __init__(self, w: DecodeWorker) -> None:
        self.w = w
        self.core = w.core
        self.wake = asyncio.Event()  # work for the core: the loop schedules again
        self.stepping = False  # a decode step is in flight: the core forgets sessions after it
        self.after_step: list[tuple[Session, str]] = []  # (session, error) to end after the step
        # the local prefill (or chunk) the engine runs now: a cancel stops it (see cancel_prefill)
        self.prefilling: tuple[Session, asyncio.Future] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="decode-loop")
        self._task.add_done_callback(_died)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.stepping = False

    def forget(self, s: Session) -> None:
        """The session ended: the core forgets it now, or after the step in flight."""
        if self.stepping:
            self.after_step.append((s, ""))
        else:
            self.core.drop(s.core)

    def cancel_prefill(self, s: Session) -> bool:
        """True when the session's local prefill is running: it is stopped now (an engine whose
        prefill can be cancelled, like the mock, stops at once; another finishes its pass). The
        engine may still write the session's blocks until then, so ``_prefill`` frees them when it
        lets go."""
        running = self.prefilling
        if running is None or running[0] is not s:
            return False
        if self.w.engine.capabilities.cancellable_prefill:
            running[1].cancel()
        return True

    async def _loop(self) -> None:
        while True:
            work = self.core.schedule(time.time())
            if work is None:
                self.wake.clear()
                await self.wake.wait()
            elif isinstance(work, LocalPrefill):
                await self._prefill(work)
            else:
                await self._step(work)  # the core plans one step (step_by_step)

    async def _prefill(self, work: LocalPrefill) -> None:
        """One local prefill, or one chunk of it (the core chose it)."""
        w = self.w
        s = w.sessions.get(work.session.session_id)
        if s is None or s.core is not work.session:  # cannot happen: drop() unqueues a closed session
            self.core.update(work, time.time())
            return
        w.rt.changed()  # the queue and busy_until moved
        start = s.l_hist + s.prefilled
        # the core chunks the round's new tokens; the last piece also holds the previous round's
        # last output token (see begin_round)
        n = s.l_incr - s.prefilled if work.last else work.tokens
        chunk = not (work.last and s.prefilled == 0)
        segs = s.kv.segments(start, n) if chunk else s.dest
        extra = {"history_ids": s.tokens} if w.token_ids else {}
        if tracing.on and not s.prefill_at:
            s.prefill_at = time.time()
        if w.streams and work.last:
            extra["stops"] = stops_of(s, w.engine)  # the round's request: prefill, then its decode
        if s.prefix_tokens and w.engine.capabilities.patterned_kv:  # --prefix-sharing: the mock's KV pattern
            extra["prefix_tokens"] = s.prefix_tokens
        run = asyncio.ensure_future(w.engine.prefill(
            s.session_id, start, n, w.rt.pool, segs, token_ids=s.tokens[start:start + n],
            history_kv=s.kv.segments(0, start) if w.history_kv else (), sampling=s.sampling, **extra))
        self.prefilling = (s, run)
        try:
            token = await run
        except asyncio.CancelledError:
            if not s.closed or asyncio.current_task().cancelling():
                raise  # the worker stops
            token = -1  # the session was cancelled: its prefill stopped (close)
        finally:
            self.prefilling = None
            if s.closed:  # the blocks close() left to the prefill
                s.kv.release(w.rt.pool)
        if s.closed:
            self.core.update(work, time.time())
            w.rt.changed()
            w.kv.admit_waiting()
            return
        s.prefilled += n
        w.metrics["local_prefill_tokens"] += n
        if chunk:
            w.metrics["prefill_chunks"] += 1
        done = self.core.update(work, time.time())
        w.rt.changed()
        if done and not s.closed:
            w.metrics["prefills_local"] += 1
            w.first_token(s, token, time.time(), True, w.rt.cfg.worker_id)

    async def _step(self, work: DecodeRun) -> None:
        """One decode step of the core's batch."""
        w = self.w
        pool = w.rt.pool
        seqs = []
        for c in self.core.batch():
            s = w.sessions.get(c.session_id)
            if s is None:
                continue
            try:
                segs = s.kv.reserve(pool, 1)
            except KVPoolExhausted as exc:
                self.after_step.append((s, f"KV exhausted on {w.rt.cfg.worker_id}: {exc}"))
                continue
            pos = len(s.tokens) - 1
            seqs.append((s, DecodeSeq(s.session_id, pos, s.tokens[pos], segs, pos + 1,
                                      s.kv.segments(0, pos) if w.history_kv else [], s.sampling,
                                      s.tokens if w.token_ids else ())))
        self.stepping = True
        try:
            tokens = await w.engine.decode_step(pool, [d for _, d in seqs]) if seqs else []
        finally:
            self.stepping = False
        now = time.time()
        ended = {id(c) for c in self.core.update(work, now)}
        live = 0
        finished: list[tuple[Session, str]] = []
        for (s, _), tok in zip(seqs, tokens):
            if s.closed:
                continue
            s.kv.commit(1)
            s.tokens.append(tok)
            live += 1
            t = s.timing
            t.last_token = now
            t.tokens += 1
            emit(s, decode_pb2.DecodeEvent(tokens=common_pb2.Tokens(
                round=s.round, position=len(s.tokens) - 1, token_ids=[tok], times=[now])))
            reason = s.finish(tok, w.engine)
            if id(s.core) in ended:
                finished.append((s, reason or FINISH_LENGTH))
            elif reason:
                self.core.stop_early(s.core, len(s.tokens) - s.out_start)
                finished.append((s, reason))
        # sessions closed or out of KV during the step: the core forgets them now
        after, self.after_step = self.after_step, []
        gone = {id(s.core) for s, _ in after}
        for s, reason in finished:
            if id(s.core) not in gone and w.sessions.get(s.session_id) is s:
                w.end_round(s, now, reason)
        stopped = ended | {id(s.core) for s, _ in finished}
        for s, error in after:
            if id(s.core) in stopped:
                self.core.round_end(s.core, True)  # its round ended with this step: its whole charge goes
            if error:
                w.fail(s, error)
            else:
                self.core.drop(s.core)
        if after:
            w.kv.admit_waiting()
        w.metrics["decode_steps"] += 1
        w.metrics["tokens"] += live
        w.rt.changed()


def _died(task: asyncio.Task) -> None:
    """The loop ends only when the worker stops; anything else is a bug that would hang every session
    silently: it is logged with its traceback."""
    if not task.cancelled() and task.exception() is not None:
        log.error("decode loop died: no session here makes progress", exc_info=task.exception())
