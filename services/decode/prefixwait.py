"""A first round that waits for prefix blocks another session's prefill is writing on this decode
worker (``--prefix-sharing``; the decision and the books: ``ampd.policy.prefixwait``).

A session's first round here that writes prompt blocks the index does not hold is a writer from its
beginning (``LivePrefix.share``) to its first token, when they enter the index (``published``), or
its end.
A session whose first round here begins (``begin_round``) while a writer is writing more leading
blocks of its prompt than the index holds waits, once, when ``wait_until`` says the blocks land
before its own prefill of them would be done, within its TTFT SLO (times from the worker's cost model, ``DecodeCore.cost``): its round is deferred,
holding nothing (``input_ready`` kept: its TTFT counts the wait), and begins again when the writer's blocks land, when the writer fails or ends, or
at the bound; ``LivePrefix.share`` then shares whatever the index holds, so waiting changes no
token, only what is prefilled. Cancelling or closing a waiting session drops its wait.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from ampd.policy.prefixindex import prefix_hashes
from ampd.policy.prefixwait import Landing, wait_until
from ampd.v1 import common_pb2

if TYPE_CHECKING:
    from services.decode.session import Session
    from services.decode.worker import DecodeWorker

__all__ = ["PrefixWaits"]

log = structlog.get_logger()


@dataclass
class _Deferred:
    s: Session
    params: common_pb2.SamplingParams
    new: int
    input_ready: float
    timer: asyncio.TimerHandle | None = None


class PrefixWaits:
    """The worker's ``Landing`` and the rounds deferred on it (keyed by ``SharedKV.session_id``: ``on``,
    every session's KV is a ``SharedKV``)."""

    def __init__(self, w: DecodeWorker, on: bool) -> None:
        self.w, self.on = w, on
        self.landing = Landing()
        self.deferred: dict[str, _Deferred] = {}

    def defer(self, s: Session, params: common_pb2.SamplingParams, new: int, input_ready: float) -> bool:
        """At ``begin_round``: True when the round waits for arriving blocks (deferred, begun again later)."""
        kv = s.kv
        if (not self.on or not self.landing.writers or s.prefix_waited or s.recovering
                or kv.tokens or kv.blocks or s.session_id in self.w.core.sessions):
            return False
        w = self.w
        bt = w.rt.pool.block_tokens
        first = prefix_hashes(s.tokens[:bt + 1], bt, s.scoped_seed)
        if not first or not any(x.hashes[0] == first[0] for x in self.landing.writers.values()):
            return False  # (no writer of its first block: its whole prompt is not hashed again)
        hashes = prefix_hashes(s.tokens, bt, s.scoped_seed)
        best = self.landing.longest(hashes)
        held = w.prefix.index.match(hashes)
        if best is None or best[1] <= held:
            return False
        writer, n, lands_at = best
        cost, tp, total = w.core.cost, w.core.tp, len(s.tokens)
        now = time.monotonic()
        until = wait_until(now, lands_at, cost.t_pre(tp, held * bt, total - held * bt),
                           cost.t_pre(tp, n * bt, total - n * bt), w.rt.cfg.ttft_slo_s - (time.time() - input_ready))
        if until is None:
            return False
        s.prefix_waited = True
        self.landing.wait(kv.session_id, writer)
        d = _Deferred(s, params, new, input_ready)
        d.timer = asyncio.get_running_loop().call_later(until - now, self._bound, kv.session_id)
        self.deferred[kv.session_id] = d
        w.metrics["prefix_waits"] += 1
        log.info("round waits for arriving prefix blocks", session=s.session_id, blocks=n, held_blocks=held,
                 lands_in_s=round(lands_at - now, 3), bound_s=round(until - now, 3))
        return True

    def writing(self, s: Session, shared: int) -> None:
        """A first round here begins with ``shared`` tokens found indexed: its prefill writes the rest
        of its prompt blocks, due by the cost model's prefill time."""
        if s.prefix_tokens <= shared:
            return
        w = self.w
        hashes = prefix_hashes(s.tokens[:s.prefix_tokens + 1], w.rt.pool.block_tokens, s.scoped_seed)
        lands_at = time.monotonic() + w.core.cost.t_pre(w.core.tp, shared, len(s.tokens) - shared)
        self.landing.writing(s.kv.session_id, hashes, lands_at)

    def done(self, s: Session) -> None:
        """Its blocks landed (first token, after ``published``) or it ended: its waiters begin again
        (soon: not inside the caller's step), and it waits no more."""
        if not self.on:
            return
        key = s.kv.session_id
        d = self.deferred.pop(key, None)
        if d is not None and d.timer is not None:
            d.timer.cancel()
        waiters = self.landing.done(key)
        if waiters:
            loop = asyncio.get_running_loop()
            for k in waiters:
                loop.call_soon(self._retry, k)

    def _bound(self, key: str) -> None:
        if self.landing.gone(key):
            self._retry(key)

    def _retry(self, key: str) -> None:
        d = self.deferred.pop(key, None)
        if d is None:
            return
        if d.timer is not None:
            d.timer.cancel()
        s = d.s
        if s.closed or s.turn is None:
            return
        try:
            self.w.begin_round(s, d.params, d.new, d.input_ready)
        except Exception as exc:  # (a callback: nobody above it would fail the session)
            self.w.fail(s, f"round after a prefix wait: {exc}")
