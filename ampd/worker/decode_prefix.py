"""Prefix sharing on a live decode worker (``--prefix-sharing``): the pure half.

Sessions whose prompts start with the same full token blocks hold the same pool blocks for them.
A block is named by its chained hash (``ampd.policy.prefixbind.block_hashes``: equal hashes mean
equal whole prefixes). Life of a session's prompt blocks::

    share(sid, tokens)          before its first round is admitted: the longest indexed prefix of the
                                prompt's full blocks (one token always left to prefill) is shared, a
                                reference each; its KV is there already, so the round prefills only
                                the rest (and the decode core charges only the rest)
    publish(sid, tokens, blocks) its first prefill wrote its own full prompt blocks: they enter the
                                index (others may share them), held by the index from now on
    truncate(sid, tokens)       an edited conversation keeps fewer tokens: the index lets go of the
                                blocks past them; a kept partial block is the session's own from then
                                on (copy-on-write: a ``CopyOp`` when another session still reads it)
    release(sid, now)           the session ended: its references go; a block nobody references stays
                                cached (indexed, its KV intact) until ``reclaim`` takes it, least
                                recently released first; sharing it again revives it

Shared blocks are read-only: a session writes only from its first non-shared block on (the first
differing block is its own), so nothing is written into a block another session reads. The driver
(``services/decode/prefix.py``) owns the bytes and the pool; this module owns the references and
says which blocks go back to the pool. Reclaiming cached blocks before a round waits or fails is
what keeps sharing from causing a refusal or a deadlock that would not happen without it: cached
blocks count as free KV (``cached_blocks``) and the pool takes them back when it is short.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import KeysView, Sequence
from dataclasses import dataclass

from ampd.policy.prefixbind import block_hashes

__all__ = ["PrefixShare", "Shared", "CopyOp", "prefix_hashes"]


def prefix_hashes(tokens: Sequence[int], block_tokens: int, seed: int = 0) -> list[int]:
    """Hashes of the prompt blocks a session could share: its full blocks, less any that would
    leave nothing to prefill (a round's prefill computes at least its last input token)."""
    n = max(len(tokens) - 1, 0) // block_tokens
    return block_hashes(tokens[:n * block_tokens], block_tokens, seed)


@dataclass(frozen=True, slots=True)
class Shared:
    """What ``share`` gave a session: ``blocks`` in position order, holding ``tokens`` tokens of KV."""

    blocks: tuple[int, ...]
    tokens: int


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy-on-write: copy the first ``tokens`` token slots of block ``src`` (others still read it)
    into a fresh block of the session's own, which replaces ``src`` in its blocks."""

    src: int
    tokens: int


class PrefixShare:
    """The shared prompt blocks of one decode worker's pool: hash -> block, a reference count a
    block, the blocks each session holds through the index, and the cache of released ones."""

    def __init__(self, block_tokens: int, seed: int = 0) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.block_tokens = block_tokens
        self.seed = seed
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        self._held: dict[str, list[int]] = {}
        self._cached: OrderedDict[int, float] = OrderedDict()  # block -> when released, oldest first
        self.shared_tokens = 0  # tokens handed out shared, over the index's life
        self.reclaimed_blocks = 0

    # --- reading ------------------------------------------------------------------------------
    @property
    def cached_blocks(self) -> int:
        """Indexed blocks nobody references: free KV that still holds a prefix."""
        return len(self._cached)

    @property
    def held_blocks(self) -> int:
        """Distinct blocks sessions hold through the index."""
        return len(self._refs)

    @property
    def empty(self) -> bool:
        return not (self._by_hash or self._refs or self._held or self._cached)

    def hashes(self) -> KeysView[int]:
        """The hashes of the indexed blocks, held or cached (what the worker publishes for binding)."""
        return self._by_hash.keys()

    def held(self, session_id: str) -> int:
        """How many leading blocks of the session the index holds (0: none)."""
        return len(self._held.get(session_id, ()))

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

    def match(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._by_hash:
                break
            n += 1
        return n

    # --- changes ------------------------------------------------------------------------------
    def share(self, session_id: str, tokens: Sequence[int]) -> Shared:
        """The longest indexed prefix of a new session's prompt, a reference each (none: empty)."""
        if session_id in self._held:
            raise ValueError(f"share {session_id!r}: it holds prefix blocks already")
        hashes = prefix_hashes(tokens, self.block_tokens, self.seed)
        blocks = [self._by_hash[h] for h in hashes[:self.match(hashes)]]
        for b in blocks:
            if self._cached.pop(b, None) is not None:
                self._refs[b] = 1
            else:
                self._refs[b] += 1
        if blocks:
            self._held[session_id] = list(blocks)
        n = len(blocks) * self.block_tokens
        self.shared_tokens += n
        return Shared(tuple(blocks), n)

    def publish(self, session_id: str, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """The session's first prefill wrote the KV of ``tokens`` (its prompt) into ``blocks`` (its
        blocks in position order, the shared ones first): its own full prompt blocks enter the index
        up to the first whose prefix another block already holds (that one and the rest stay the
        session's own). Returns how many leading blocks the index now holds for it."""
        held = self._held.setdefault(session_id, [])
        hashes = prefix_hashes(tokens, self.block_tokens, self.seed)
        for i in range(len(held), min(len(hashes), len(blocks))):
            h, b = hashes[i], blocks[i]
            if h in self._by_hash or b in self._refs:
                break
            self._by_hash[h] = b
            self._hash_of[b] = h
            self._refs[b] = 1
            held.append(b)
        if not held:
            del self._held[session_id]
        return len(held)

    def truncate(self, session_id: str, tokens: int) -> tuple[list[int], CopyOp | None]:
        """The session keeps only its first ``tokens`` tokens. Returns (blocks the index no longer
        holds for it that go back to the pool, a copy for a kept partial block others still read).
        A kept partial block leaves the index (the session will write into it): one it alone holds
        becomes its own block; one others hold too stays theirs and the session gets a copy."""
        held = self._held.get(session_id)
        if not held:
            return [], None
        full, part = divmod(max(tokens, 0), self.block_tokens)
        gone = self._unref(held[full:], 0.0, cache=False)
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

    def unpin(self, session_id: str, blocks: int, now: float) -> list[int]:
        """The session keeps only its first ``blocks`` indexed blocks (the host tier moved the rest
        of its KV to host): its references to the others go, and an indexed block nobody references
        is cached (its KV intact, shareable, reclaimable). Returns the blocks that go back to the
        pool (none: indexed blocks are cached)."""
        held = self._held.get(session_id)
        if not held or blocks >= len(held):
            return []
        gone = self._unref(held[max(blocks, 0):], now, cache=True)
        del held[max(blocks, 0):]
        if not held:
            del self._held[session_id]
        return gone

    def release(self, session_id: str, now: float) -> list[int]:
        """The session ended: its references go; indexed blocks nobody references are cached.
        Returns the blocks that go back to the pool (none: all are cached)."""
        held = self._held.pop(session_id, None)
        return self._unref(held, now, cache=True) if held else []

    def reclaim(self, n_blocks: int) -> list[int]:
        """Up to ``n_blocks`` cached blocks, least recently released first, out of the index: the
        pool takes them back."""
        gone: list[int] = []
        while self._cached and len(gone) < n_blocks:
            b, _ = self._cached.popitem(last=False)
            del self._by_hash[self._hash_of.pop(b)]
            gone.append(b)
        self.reclaimed_blocks += len(gone)
        return gone

    def _unref(self, blocks: Sequence[int], now: float, cache: bool) -> list[int]:
        gone: list[int] = []
        for b in blocks:
            r = self._refs[b] - 1
            if r:
                self._refs[b] = r
                continue
            del self._refs[b]
            if cache:
                self._cached[b] = now
                continue
            del self._by_hash[self._hash_of.pop(b)]
            gone.append(b)
        return gone
