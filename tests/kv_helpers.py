"""Helpers shared by the KV transport tests (the loopback's in tests/unit, NIXL's in tests/integration)."""
from __future__ import annotations

import asyncio
import random

from ampd.kv.pool import KVPool


def scatter(pool: KVPool, rng: random.Random) -> KVPool:
    """Leaves the pool's free list shuffled, so that sessions get scattered, unordered blocks."""
    blocks = pool.alloc(pool.free_blocks)
    rng.shuffle(blocks)
    pool.free(blocks)
    return pool


async def until(pred, timeout_s: float = 20.0, what: str = "condition"):
    """``pred()``'s first true value, polled every millisecond; AssertionError naming ``what`` after
    ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        r = pred()
        if r:
            return r
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)
