"""The prefix blocks each decode worker holds, published for the coordinators' binding
(``--prefix-sharing``; docs/kv.md "Prefix sharing").

Keys (ampd.state.store's schema):
- `{ns}:prefix:{wid}`  set of the chained block hashes (``ampd.policy.prefixbind.block_hashes``, the
                       worker's block size and ``WorkerInfo.prefix_seed``) of the blocks its prefix
                       index holds, shared or cached; a TTL (the liveness TTL) that the worker renews
                       while it lives, deleted when it deregisters

The worker writes what changed since its last write (``prefix_delta``, pure), batched: a change of
its index is published within ``PUBLISH_S``. A coordinator reads every worker's match for one prompt
in one pipelined round trip (``PrefixSets.matches``).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set

import redis.asyncio as aioredis

from ampd.policy.prefixbind import leading

__all__ = ["PrefixSets", "prefix_delta", "prefix_key"]


def prefix_key(namespace: str, worker_id: str) -> str:
    return f"{namespace}:prefix:{worker_id}"


def prefix_delta(published: Set[int], current: Iterable[int]) -> tuple[list[int], list[int]]:
    """(hashes to add, hashes to remove) that turn the set ``published`` into ``current``. Pure."""
    now = set(current)
    return sorted(now - published), sorted(published - now)


class PrefixSets:
    """The ``{ns}:prefix:{wid}`` sets: the worker's writes, the coordinator's reads."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.r = client
        self.ns = namespace

    async def write(self, worker_id: str, add: Sequence[int], remove: Sequence[int], ttl_s: float,
                    full: bool = False) -> None:
        """One transaction: ``full`` (the worker's first write, or the first after it registered
        again): the set is replaced by ``add``; else ``remove`` leaves it and ``add`` joins it. The
        TTL is renewed (an empty set is no key at all)."""
        key = prefix_key(self.ns, worker_id)
        async with self.r.pipeline(transaction=True) as p:
            if full:
                p.delete(key)
            elif remove:
                p.srem(key, *remove)
            if add:
                p.sadd(key, *add)
            p.pexpire(key, max(1, int(ttl_s * 1000)))
            await p.execute()

    async def matches(self, hashes: Mapping[str, Sequence[int]]) -> dict[str, int]:
        """worker id -> how many leading blocks of ``hashes[worker id]`` (a prompt's block hashes in
        that worker's block size and seed) it holds: one pipelined round trip for all."""
        ids = [w for w, hs in hashes.items() if hs]
        if not ids:
            return {}
        async with self.r.pipeline(transaction=False) as p:
            for w in ids:
                p.smismember(prefix_key(self.ns, w), list(hashes[w]))
            found = await p.execute()
        return {w: leading(f) for w, f in zip(ids, found)}
