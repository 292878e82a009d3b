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
from ampd.state.store import registry_key

__all__ = ["PrefixSets", "prefix_delta", "prefix_key"]


# A worker's write of its set, atomic and only while it is registered. KEYS: its set, the registry;
# ARGV: worker id, TTL (ms), full (1: replace the set), how many hashes leave, those, then those that
# join. In slices: unpack's stack is bounded.
_WRITE = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return 0 end
if ARGV[3] == '1' then redis.call('DEL', KEYS[1]) end
local function each(cmd, first, last)
  for i = first, last, 1000 do
    redis.call(cmd, KEYS[1], unpack(ARGV, i, math.min(i + 999, last)))
  end
end
local gone = 4 + tonumber(ARGV[4])
each('SREM', 5, gone)
each('SADD', gone + 1, #ARGV)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


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
        self.k_workers = registry_key(namespace)
        self._write = client.register_script(_WRITE)  # EVALSHA, loaded again on a Redis without it

    async def write(self, worker_id: str, add: Sequence[int], remove: Sequence[int], ttl_s: float,
                    full: bool = False) -> bool:
        """One atomic step (_WRITE), only while the worker is registered: a write still on its way
        when the worker deregistered (its publisher cut off as it stopped) must not bring back the
        key the deregistration deleted. ``full`` (the worker's first write, or the first after it
        registered again): the set is replaced by ``add``; else ``remove`` leaves it and ``add``
        joins it. The TTL is renewed (an empty set is no key at all). False: not registered,
        nothing written."""
        args = (worker_id, max(1, int(ttl_s * 1000)), int(full), 0 if full else len(remove),
                *(() if full else remove), *add)
        return bool(await self._write(keys=(prefix_key(self.ns, worker_id), self.k_workers), args=args))

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
