"""The decode worker's publisher of the prefix blocks it holds (``--prefix-sharing``): the hashes in
its prefix index (``ampd.policy.prefixindex.PrefixIndex``) go to its `{ns}:prefix:{wid}` set
(``ampd.state.prefixes``), so that a coordinator binds a new session to the worker holding the
longest prefix of its prompt without a call to each worker.

Batched: every ``PUBLISH_S`` the index's change count (``PrefixIndex.changes``: every hash that
entered or left it, so a swap that keeps its size counts too) is compared with the last write's; on
a change (and at least every third of the liveness TTL, which renews the key) what changed since the
last write (``prefix_delta``) is written in one transaction. The first write of each
registration replaces the set (a restarted Redis, or a worker back under its id, starts clean). The
worker's runtime stops this loop before it deregisters, which deletes the key; a worker that dies
leaves it to its TTL.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from ampd.state.prefixes import PrefixSets, prefix_delta
from ampd.state.store import REDIS_ERRORS
from ampd.policy.prefixindex import PrefixIndex

if TYPE_CHECKING:
    from ampd.runtime import WorkerRuntime

__all__ = ["PrefixPublisher", "PUBLISH_S"]

log = structlog.get_logger()

PUBLISH_S = 0.05  # a change of the index reaches Redis within this (plus the write)


class PrefixPublisher:
    """``run`` is the loop (``WorkerRuntime.loops``); ``flush`` one step of it."""

    def __init__(self, rt: WorkerRuntime, index: PrefixIndex) -> None:
        self.rt = rt
        self.index = index
        self.sets = PrefixSets(rt.store.r, rt.store.ns)
        self.published: set[int] = set()
        self.registration = -1  # rt.registrations at the last write (another: the set is replaced)
        self.seen = -1  # the index's change count at the last write
        self.renewed = 0.0  # monotonic time of the last write (the key's TTL renewed)
        self.writes = 0

    async def run(self) -> None:
        failed = False
        while True:
            await asyncio.sleep(PUBLISH_S)
            try:
                await self.flush()
                failed = False
            except REDIS_ERRORS as exc:  # tried again next step; the heartbeat deals with a lost Redis
                if not failed:
                    log.warning("publishing the prefix blocks failed", error=str(exc) or type(exc).__name__)
                failed = True

    async def flush(self) -> bool:
        """Writes what changed, if anything did or the key's TTL is due; True when it wrote."""
        ix, rt, now = self.index, self.rt, time.monotonic()
        ttl = rt.cfg.liveness_ttl_s
        full = rt.registrations != self.registration
        seen = ix.changes
        if not full and seen == self.seen and now - self.renewed < ttl / 3:
            return False
        current = set(ix.hashes())
        add, remove = prefix_delta(set() if full else self.published, current)
        if not (full or add or remove or current):  # nothing held, nothing published: no key to renew
            self.seen, self.renewed = seen, now
            return False
        if not await self.sets.write(rt.cfg.worker_id, add, remove, ttl, full):
            # not registered (it left, or a fence or Redis lost it): its next registration writes it all,
            # and until then this is not sent again each step
            self.seen, self.renewed = seen, now
            return False
        self.published, self.registration, self.seen, self.renewed = current, rt.registrations, seen, now
        self.writes += 1
        return True
