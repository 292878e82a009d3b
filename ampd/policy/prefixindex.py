"""Prefix sharing on one decode worker: the index of shared prompt blocks, the one piece of code the
live worker (``services/decode/prefix.py``, ``--prefix-sharing``) and the simulator
(``ampd/sim/prefixing.py``) both keep their books with.

A block is named by a chained hash (``block_hashes``): block i's hash covers block i's tokens and
block i-1's hash, so equal hashes mean equal whole prefixes, never merely equal blocks (the function
lives with the binding policy: the coordinator hashes a new session's prompt to match it). Imported
traces name blocks by their own hash ids (Mooncake's ``hash_ids``); the index takes any int.

The index keeps hash -> block, a reference count a block, the leading blocks each session holds
through it (in position order), and the cache of indexed blocks nobody references (their KV intact,
least recently released first). Life of a session's prompt blocks, live::

    share(sid, hashes)           before its first round is admitted: the longest indexed prefix of the
                                 prompt's full blocks (their ``prefix_hashes``, one token always left
                                 to prefill; the driver hashes once, for its own checks too) is
                                 shared, a reference each; its KV is there already, so the round
                                 prefills only the rest
    publish(sid, tokens, blocks) its first prefill wrote its own full prompt blocks: they enter the
                                 index up to the first whose hash is indexed already, held by the
                                 index from then on (the rest stay the session's own)

and in the simulator, where the index also hands out the fresh blocks::

    acquire(sid, hashes, pool)   the longest indexed prefix shared, fresh blocks from ``pool`` after
                                 it (held through the index, not indexed yet)
    commit(sid)                  its prefill wrote them: those whose hash is not indexed enter it

then, both::

    truncate(sid, tokens)  an edited conversation keeps fewer tokens: the index lets go of the blocks
                           past them; a kept partial block is the session's own from then on
                           (copy-on-write: a ``CopyOp`` when another session still reads it)
    unpin(sid, n)          the session keeps only its first n blocks in the index (the host tier
                           moved the rest of its KV to host)
    release(sid)           the session ended: its references go; an indexed block nobody references
                           stays cached until ``reclaim`` takes it, least recently released first;
                           sharing it again revives it

Only full blocks are shared and shared blocks are read-only: a session writes only from its first
non-shared block on, so nothing is written into a block another session reads. Pure accounting: the
index never frees a block; each change returns the blocks that go back to the pool, and the driver
frees them (and copies bytes for a ``CopyOp``). ``changes`` counts every hash that enters or leaves
the index (what the live worker publishes for binding changes exactly when it moves).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import KeysView, Sequence
from dataclasses import dataclass
from typing import Protocol

from .prefixbind import block_hashes, prefix_hashes

__all__ = ["block_hashes", "prefix_hashes", "BlockSource", "PrefixIndex", "Shared", "Grant", "CopyOp"]


class BlockSource(Protocol):
    """Where ``acquire``'s fresh blocks come from (``ampd.kv.pool.KVPool`` is one)."""

    def alloc(self, n_blocks: int) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Shared:
    """What ``share`` gave a session: ``blocks`` in position order, holding ``tokens`` tokens of KV."""

    blocks: tuple[int, ...]
    tokens: int


@dataclass(slots=True)
class Grant:
    """What ``acquire`` gave a session: its prompt blocks in position order; the first ``shared``
    hold KV already (shared), the rest are fresh, for its prefill to write."""

    blocks: list[int]
    shared: int

    @property
    def fresh(self) -> list[int]:
        return self.blocks[self.shared:]


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy-on-write: copy the first ``tokens`` token slots of block ``src`` (others still read it)
    into a fresh block of the session's own, which replaces ``src`` in its blocks."""

    src: int
    tokens: int


class PrefixIndex:
    """The shared prompt blocks of one decode worker's pool: hash -> block, a reference count a
    block, the leading blocks each session holds through the index, and the cache of released ones."""

    def __init__(self, block_tokens: int, seed: int = 0) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.block_tokens = block_tokens
        self.seed = seed  # of ``share``/``publish``'s hashes (the model's); ``acquire`` takes hashes
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        self._held: dict[str, list[int]] = {}
        self._fresh: dict[str, tuple[int, Sequence[int]]] = {}  # acquire: (first fresh, hashes) until commit
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.changes = 0  # hashes that entered or left the index, over its life
        self.shared_blocks = 0  # blocks handed out shared, over the index's life
        self.revived = 0  # cached blocks the last share or acquire shared again
        self.reclaimed_blocks = 0

    # --- reading ------------------------------------------------------------------------------
    @property
    def cached_blocks(self) -> int:
        """Indexed blocks nobody references: free KV that still holds a prefix (``reclaim`` frees them)."""
        return len(self._cached)

    @property
    def held_blocks(self) -> int:
        """Distinct blocks sessions hold through the index."""
        return len(self._refs)

    @property
    def shared_tokens(self) -> int:
        """Tokens handed out shared, over the index's life."""
        return self.shared_blocks * self.block_tokens

    @property
    def empty(self) -> bool:
        """No session holds a block and nothing is indexed (every block went back)."""
        return not (self._by_hash or self._refs or self._held or self._cached)

    def hashes(self) -> KeysView[int]:
        """The hashes of the indexed blocks, held or cached (what the worker publishes for binding)."""
        return self._by_hash.keys()

    def held(self, session_id: str) -> int:
        """How many leading blocks of the session the index holds (0: none)."""
        return len(self._held.get(session_id, ()))

    def blocks(self, session_id: str) -> list[int]:
        return list(self._held.get(session_id, ()))

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def shared_run(self, session_id: str) -> int:
        """How many leading blocks the index holds for the session that another session also
        references (the host tier leaves those on the device: moving them would free nothing)."""
        n = 0
        for b in self._held.get(session_id, ()):
            if self._refs[b] < 2:
                break
            n += 1
        return n

    def own_leading(self, session_id: str, blocks: int) -> list[bool]:
        """For each of the session's first ``blocks`` held blocks: whether no other session
        references it (releasing it would free it: cached, reclaimable)."""
        return [self._refs[b] < 2 for b in self._held.get(session_id, ())[:max(blocks, 0)]]

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are indexed here (the longest shared prefix)."""
        n = 0
        for h in hashes:
            if h not in self._by_hash:
                break
            n += 1
        return n

    def revives(self, hashes: Sequence[int]) -> int:
        """How many of the indexed leading blocks of ``hashes`` are cached: sharing them revives
        them (they take KV again)."""
        n = 0
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            n += b in self._cached
        return n

    # --- changes: live ------------------------------------------------------------------------
    def share(self, session_id: str, hashes: Sequence[int]) -> Shared:
        """The longest indexed prefix of a new session's prompt, a reference each (none: empty).
        ``hashes``: its ``prefix_hashes``, seeded with its prefix scope's seed
        (``prefixbind.scoped_seed``; the index's own ``seed`` when it has no scope)."""
        self._new(session_id)
        blocks = self._take(hashes[:self.match(hashes)])
        if blocks:
            self._held[session_id] = blocks
        return Shared(tuple(blocks), len(blocks) * self.block_tokens)

    def publish(self, session_id: str, tokens: Sequence[int], blocks: Sequence[int], seed: int | None = None) -> int:
        """The session's first prefill wrote the KV of ``tokens`` (its prompt) into ``blocks`` (its
        blocks in position order, the shared ones first): its own full prompt blocks enter the index
        up to the first whose prefix another block already holds (that one and the rest stay the
        session's own). Returns how many leading blocks the index now holds for it. ``seed``: its hashes'
        (its prefix scope's, ``prefixbind.scoped_seed``); None: the index's."""
        held = self._held.setdefault(session_id, [])
        hashes = prefix_hashes(tokens, self.block_tokens, self.seed if seed is None else seed)
        for i in range(len(held), min(len(hashes), len(blocks))):
            h, b = hashes[i], blocks[i]
            if h in self._by_hash or b in self._refs:
                break
            self._add(h, b)
            self._refs[b] = 1
            held.append(b)
        if not held:
            del self._held[session_id]
        return len(held)

    # --- changes: the simulator ---------------------------------------------------------------
    def acquire(self, session_id: str, hashes: Sequence[int], pool: BlockSource) -> Grant:
        """Blocks for a new session's prompt of ``len(hashes)`` full blocks: the longest indexed
        prefix shared, fresh blocks from ``pool`` after it, all held through the index (all or
        nothing: the pool's exhaustion propagates and nothing is held)."""
        self._new(session_id)
        n = self.match(hashes)
        fresh = pool.alloc(len(hashes) - n)
        blocks = self._take(hashes[:n])
        for b in fresh:
            self._refs[b] = 1
        blocks += fresh
        self._held[session_id] = blocks
        self._fresh[session_id] = (n, hashes)
        return Grant(list(blocks), n)

    def commit(self, session_id: str) -> int:
        """The session's prefill wrote the fresh blocks ``acquire`` gave it: index them; returns how
        many entered. A hash indexed meanwhile by another session keeps the other's block (this one
        stays the session's, held through the index, not indexed)."""
        first, hashes = self._fresh.pop(session_id, (0, ()))
        blocks = self._held.get(session_id, ())
        by_hash, hash_of = self._by_hash, self._hash_of  # (``_add``, inlined: once a new session)
        added = 0
        for i in range(first, min(len(blocks), len(hashes))):
            h = hashes[i]
            if h not in by_hash:
                b = blocks[i]
                by_hash[h] = b
                hash_of[b] = h
                added += 1
        self.changes += added
        return added

    # --- changes: both ------------------------------------------------------------------------
    def truncate(self, session_id: str, tokens: int) -> tuple[list[int], CopyOp | None]:
        """The session keeps only its first ``tokens`` tokens. Returns (blocks the index no longer
        holds for it that go back to the pool, a copy for a kept partial block others still read).
        A kept partial block leaves the index (the session will write into it): one it alone holds
        becomes its own block; one others hold too stays theirs and the session gets a copy."""
        held = self._held.get(session_id)
        if not held:
            return [], None
        full, part = divmod(max(tokens, 0), self.block_tokens)
        gone = self._unref(held[full:], cache=False)
        kept_part = held[full] if part and full < len(held) else None
        del held[full:]
        copy = None
        if kept_part is not None:
            if gone and gone[0] == kept_part:
                gone.pop(0)  # it alone held it: out of the index, the session's own block now
            else:
                copy = CopyOp(kept_part, part)
        if not held:
            del self._held[session_id]
        return gone, copy

    def unpin(self, session_id: str, blocks: int) -> list[int]:
        """The session keeps only its first ``blocks`` blocks in the index (the host tier moved the
        rest of its KV to host): its references to the others go, and an indexed block nobody
        references is cached (its KV intact, shareable, reclaimable). Returns the blocks that go back
        to the pool (those not indexed)."""
        held = self._held.get(session_id)
        if not held or blocks >= len(held):
            return []
        gone = self._unref(held[max(blocks, 0):], cache=True)
        del held[max(blocks, 0):]
        if not held:
            del self._held[session_id]
        return gone

    def release(self, session_id: str) -> list[int]:
        """The session ended: its references go; indexed blocks nobody references are cached.
        Returns the blocks that go back to the pool (those not indexed)."""
        self._fresh.pop(session_id, None)
        held = self._held.pop(session_id, None)
        return self._unref(held, cache=True) if held else []

    def reclaim(self, n_blocks: int) -> list[int]:
        """Up to ``n_blocks`` cached blocks, least recently released first, out of the index: the
        pool takes them back."""
        gone: list[int] = []
        while self._cached and len(gone) < n_blocks:
            b, _ = self._cached.popitem(last=False)
            self._drop(b)
            gone.append(b)
        self.reclaimed_blocks += len(gone)
        return gone

    # --- the bookkeeping ----------------------------------------------------------------------
    def _new(self, session_id: str) -> None:
        if session_id in self._held:
            raise ValueError(f"session {session_id!r} holds prefix blocks already")

    def _take(self, hashes: Sequence[int]) -> list[int]:
        """The indexed blocks of ``hashes`` (all indexed), a reference each (a cached one revived)."""
        blocks = [self._by_hash[h] for h in hashes]
        revived = 0
        for b in blocks:
            if b in self._cached:
                del self._cached[b]
                self._refs[b] = 1
                revived += 1
            else:
                self._refs[b] += 1
        self.revived = revived
        self.shared_blocks += len(blocks)
        return blocks

    def _add(self, h: int, b: int) -> None:
        self._by_hash[h] = b
        self._hash_of[b] = h
        self.changes += 1

    def _drop(self, b: int) -> None:
        del self._by_hash[self._hash_of.pop(b)]
        self.changes += 1

    def _unref(self, blocks: Sequence[int], cache: bool) -> list[int]:
        """A reference less to each block; those nobody references leave the session's hold:
        indexed ones are cached (``cache``) or leave the index. Returns those that go to the pool."""
        gone: list[int] = []
        for b in blocks:
            r = self._refs[b] - 1
            if r:
                self._refs[b] = r
                continue
            del self._refs[b]
            if b in self._hash_of:
                if cache:
                    self._cached[b] = None
                    continue
                self._drop(b)
            gone.append(b)
        return gone
