"""Prefix sharing on one decode worker (``--prefix-sharing``): sessions whose prompts start with the
same full token blocks hold the same device blocks.

A block is named by a chained hash (``block_hashes``): block i's hash covers block i's tokens and
block i-1's hash, so equal hashes mean equal whole prefixes, never merely equal blocks (the function
lives with the binding policy: the coordinator hashes a new session's prompt to match it). Imported
traces name blocks by their own hash ids (Mooncake's ``hash_ids``); the index takes any int.

Life of a session's prompt blocks::

    acquire(sid, hashes)  the longest indexed prefix is shared (a reference each); from the first
                          differing block on, fresh blocks come from the pool, private to sid
    commit(sid)           its prefill wrote them: they enter the index, others may share them
    truncate(sid, n)      the history shrinks to n tokens; a shared block the session would write
                          into again is copied first (copy-on-write: a ``CopyOp`` for the driver)
    release(sid)          its references go; a block nobody references goes back to the pool
                          (``retain``: it stays indexed, cached, until ``evict`` takes it, least
                          recently released first; sharing it again revives it)

Only full blocks are shared and shared blocks are read-only: a session appends after its prompt in
blocks of its own, so nothing is written into a block another session reads. Pure accounting: the
driver copies bytes for a ``CopyOp``. Every block returns to the pool once every session is
released (``empty``).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Iterable, Protocol

from .prefixbind import block_hashes

__all__ = ["block_hashes", "BlockSource", "PrefixIndex", "Grant", "CopyOp"]


class BlockSource(Protocol):
    """Where blocks come from (``ampd.kv.pool.KVPool`` is one)."""

    def alloc(self, n_blocks: int) -> list[int]: ...

    def free(self, blocks: Iterable[int]) -> None: ...


@dataclass(slots=True)
class Grant:
    """A session's prompt blocks, in position order: the first ``shared`` hold KV already (shared);
    the rest are fresh, for its prefill to write."""

    blocks: list[int]
    shared: int

    @property
    def fresh(self) -> list[int]:
        return self.blocks[self.shared:]


@dataclass(slots=True)
class CopyOp:
    """Copy the first ``tokens`` token slots of block ``src`` into block ``dst`` (copy-on-write)."""

    src: int
    dst: int
    tokens: int


@dataclass(slots=True)
class _Held:
    blocks: list[int]
    hashes: list[int | None]  # None: a block cut short by truncate (never indexed again)
    committed: int  # leading blocks that hold KV (shared, or written and committed by this session)


class PrefixIndex:
    """Shared prompt blocks of one worker's pool: hash -> block, and a reference count a block."""

    def __init__(self, pool: BlockSource, block_tokens: int, retain: bool = False):
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.pool = pool
        self.block_tokens = block_tokens
        self.retain = retain
        self._cached: OrderedDict[int, None] = OrderedDict()  # retain: indexed blocks nobody references, LRU first
        self.revived = 0  # cached blocks the last acquire shared again
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        self._held: dict[str, _Held] = {}
        self.shared_blocks = 0  # blocks handed out shared, over the index's life (cached_tokens / block_tokens)

    # --- reading ------------------------------------------------------------------------------
    @property
    def empty(self) -> bool:
        """No session holds a block and the index is empty (every block went back)."""
        return not self._held and not self._refs and not self._by_hash and not self._cached

    @property
    def cached_blocks(self) -> int:
        """Indexed blocks nobody references (``retain``), ``evict`` frees them."""
        return len(self._cached)

    @property
    def blocks_held(self) -> int:
        """Distinct pool blocks the index's sessions hold."""
        return len(self._refs)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are indexed here (the longest shared prefix)."""
        n = 0
        for h in hashes:
            if h not in self._by_hash:
                break
            n += 1
        return n

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def blocks(self, session_id: str) -> list[int]:
        return list(self._held[session_id].blocks)

    # --- changes ------------------------------------------------------------------------------
    def acquire(self, session_id: str, hashes: Sequence[int]) -> Grant:
        """Blocks for a new session's prompt of ``len(hashes)`` full blocks: the longest indexed
        prefix shared, fresh blocks from the pool after it (all or nothing: the pool's exhaustion
        propagates and nothing is held)."""
        if session_id in self._held:
            raise ValueError(f"acquire {session_id!r}: it holds prompt blocks already")
        shared = [self._by_hash[h] for h in hashes[:self.match(hashes)]]
        fresh = self.pool.alloc(len(hashes) - len(shared))
        self.revived = 0
        for b in shared:
            if b in self._cached:
                del self._cached[b]
                self._refs[b] = 1
                self.revived += 1
            else:
                self._refs[b] += 1
        for b in fresh:
            self._refs[b] = 1
        self.shared_blocks += len(shared)
        self._held[session_id] = _Held(shared + fresh, list(hashes), len(shared))
        return Grant(shared + fresh, len(shared))

    def commit(self, session_id: str) -> int:
        """The session's prefill wrote its fresh blocks: index them; returns how many entered. A
        hash indexed meanwhile by another session keeps the other's block (this one stays private)."""
        held = self._held[session_id]
        added = 0
        for i in range(held.committed, len(held.blocks)):
            b, h = held.blocks[i], held.hashes[i]
            if h is None or h in self._by_hash:
                continue
            self._by_hash[h] = b
            self._hash_of[b] = h
            added += 1
        held.committed = len(held.blocks)
        return added

    def truncate(self, session_id: str, tokens: int) -> CopyOp | None:
        """Keep only the session's first ``tokens`` prompt tokens (an edited conversation). Blocks
        wholly past them are released. A partly kept block becomes the session's own to write into:
        one it alone holds leaves the index; one another session also holds is replaced by a private
        copy (copy-on-write), returned for the driver to copy ``tokens % block_tokens`` slots."""
        held = self._held[session_id]
        full, part = divmod(max(tokens, 0), self.block_tokens)
        keep = min(full + (1 if part else 0), len(held.blocks))
        self._unref(held.blocks[keep:])
        del held.blocks[keep:], held.hashes[keep:]
        held.committed = min(held.committed, keep)
        if not part or keep <= full:
            return None
        i = keep - 1
        last = held.blocks[i]
        held.hashes[i] = None  # a partial block is no prefix block any more
        if self._refs[last] == 1:
            h = self._hash_of.pop(last, None)
            if h is not None:
                del self._by_hash[h]
            return None
        (dst,) = self.pool.alloc(1)
        self._refs[dst] = 1
        self._unref([last])
        held.blocks[i] = dst
        return CopyOp(last, dst, part)

    def release(self, session_id: str) -> int:
        """The session ended: drop its references; unreferenced blocks go back to the pool (or, with
        ``retain``, indexed ones into the cache). Returns how many blocks nobody references now."""
        held = self._held.pop(session_id, None)
        if held is not None:
            return self._unref(held.blocks)
        return 0

    def evict(self, n_blocks: int) -> int:
        """Free up to ``n_blocks`` cached blocks to the pool, least recently released first."""
        gone = []
        while self._cached and len(gone) < n_blocks:
            b, _ = self._cached.popitem(last=False)
            del self._by_hash[self._hash_of.pop(b)]
            gone.append(b)
        if gone:
            self.pool.free(gone)
        return len(gone)

    def _unref(self, blocks: Sequence[int]) -> int:
        gone = []
        dropped = 0
        for b in blocks:
            r = self._refs[b] - 1
            if r:
                self._refs[b] = r
                continue
            del self._refs[b]
            dropped += 1
            if self.retain and b in self._hash_of:
                self._cached[b] = None
                continue
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._by_hash[h]
            gone.append(b)
        self.pool.free(gone)
        return dropped
