"""Prefix sharing on the live decode worker (``--prefix-sharing``; its books: ``ampd.policy.prefixindex.PrefixIndex``,
the same index the simulator keeps).

Off (``--no-prefix-sharing``) nothing here runs. On (the default), a session whose KV is empty when a
round begins (its first round, or its first here after a move) shares the longest indexed prefix of
its prompt's full blocks before the core admits the round: those blocks are its first KV blocks, the
round's history is their tokens (``RoundTiming.prefix_shared_tokens``), and the core charges and the
prefill computes only the rest. When that prefill's first token comes, the session's own full prompt blocks enter the
index for later sessions. The session's blocks (``SharedKV``) free only what the index does not hold;
the index keeps released prompt blocks cached, and the pool takes them back (least recently released
first) before an allocation would fail, and counts them as free KV for admission (``KvSync.sync``),
so sharing never refuses or delays a round that would have fitted without it. With the host tier
that count includes room promised to running rounds' output not made yet: a share first lets the
cache give way as far as that promise needs (``_revive_room``), so it never revives cached blocks
into it.

With the host tier a session's index-held blocks stay on the device when the rest of its KV goes to
host (``SharedKV.pinned``, ``keep_pinned``, overriding ``SessionKV``'s, which pin nothing); a session
whose KV was dropped shares again before its next round (``share``).

Blocks are shared only within a session's prefix scope (``OpenSession.prefix_scope``; the OpenAI
front's tenant): its hashes are seeded with the model's seed mixed with the scope (``seed_of``,
``ampd.policy.prefixbind.scoped_seed``), the same seed the coordinator's binding hashes with.

The mock engine's KV of a session's prefix positions (``Session.prefix_tokens``) is keyed by position
alone (``ampd.kv.pattern``), so a shared block passes every byte check of another session's reads.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import structlog

from ampd.kv import KVPool, SessionKV
from ampd.policy.prefixbind import scoped_seed
from ampd.policy.prefixindex import PrefixIndex, prefix_hashes

if TYPE_CHECKING:
    from services.decode.session import Session
    from services.decode.worker import DecodeWorker

__all__ = ["LivePrefix", "SharedKV"]

log = structlog.get_logger()


_KEYS = itertools.count()


class SharedKV(SessionKV):
    """A session's blocks whose first ``index.held(key)`` the prefix index holds: releasing,
    trimming or truncating leaves those to the index. ``key`` names these blocks in the index (a
    session opened again under its id while its old blocks wait for a prefill worker has other ones)."""

    def __init__(self, block_tokens: int, index: PrefixIndex, session_id: str) -> None:
        super().__init__(block_tokens)
        self.index = index
        self.session_id = f"{session_id}#{next(_KEYS)}"
        self.pin = 0  # leading blocks the host tier leaves on the device (``choose_pin``)
        self.shared_in = 0  # leading blocks it found indexed (``LivePrefix.share``)

    def choose_pin(self) -> int:
        """As the session pauses (the host tier may move its KV): its pinned prefix is its shared
        blocks, those it found indexed and those another session also references now (they stay on
        the device either way). Its other indexed blocks, its own prompt's, move with its own KV
        (the index keeps them cached meanwhile), so a session that shares nothing pins nothing.
        Returns the pinned tokens."""
        self.pin = max(self.shared_in, self.index.shared_run(self.session_id))
        return self.pinned

    @property
    def pinned(self) -> int:
        """Leading tokens in pinned blocks (full blocks): the host tier leaves them on the device,
        and the session keeps its references to them, when the rest of its KV goes to host."""
        return min(min(self.pin, self.index.held(self.session_id)) * (self.block_tokens or 0), self.tokens)

    @property
    def pinned_own(self) -> int:
        """Of the pinned tokens, those in blocks no other session references now: what dropping
        this session would free (the others' blocks stay, read by them)."""
        bt, pinned = self.block_tokens or 0, self.pinned
        own = self.index.own_leading(self.session_id, min(self.pin, self.index.held(self.session_id)))
        return sum(max(0, min(bt, pinned - i * bt)) for i, mine in enumerate(own) if mine)

    def keep_pinned(self, pool: KVPool) -> None:
        """Only the pinned blocks stay (the rest of its KV went to host, or is lost): its other
        indexed blocks go to the index (cached once nobody references them), its own to the pool."""
        held = self.index.held(self.session_id)
        keep = min(self.pin, held)
        tokens = self.pinned
        pool.free(self.index.unpin(self.session_id, keep) + self.blocks[held:])
        del self.blocks[keep:]
        self.tokens, self.reserved = tokens, 0

    def release(self, pool: KVPool) -> None:
        held = self.index.held(self.session_id)
        own = self.blocks[held:]
        gone = self.index.release(self.session_id)
        self.blocks, self.tokens, self.reserved, self.pin, self.shared_in = [], 0, 0, 0, 0
        pool.free(gone + own)

    def trim(self, pool: KVPool) -> None:
        self.reserved = 0
        keep = max(pool.blocks_for(self.tokens), self.index.held(self.session_id))
        if len(self.blocks) > keep:
            pool.free(self.blocks[keep:])
            del self.blocks[keep:]

    def truncate(self, pool: KVPool, n: int) -> None:
        held = self.index.held(self.session_id)
        if n >= held * pool.block_tokens or not 0 <= n <= self.tokens:
            super().truncate(pool, n)
            return
        gone, copy = self.index.truncate(self.session_id, n)
        keep = pool.blocks_for(n)
        pool.free(gone + self.blocks[held:])
        if copy is not None:  # copy-on-write: the kept part of a block others still read
            (own,) = pool.alloc(1)
            bt, bpt = pool.block_tokens, pool.bytes_per_token
            src, dst = copy.src * bt * bpt, own * bt * bpt
            pool.buffer[dst:dst + copy.tokens * bpt] = pool.buffer[src:src + copy.tokens * bpt]
            self.blocks[keep - 1] = own
        del self.blocks[keep:]
        self.tokens, self.reserved = n, 0


class LivePrefix:
    """The decode worker's prefix index and its hooks: ``new_kv`` (open), ``share`` (a round
    begins), ``published`` (its first token), ``rewound`` (an edited conversation). Off
    (``on`` False) each hook does nothing."""

    def __init__(self, w: DecodeWorker, on: bool, seed: int = 0) -> None:
        self.w = w
        self.on = on
        pool = w.rt.pool
        self.index = PrefixIndex(pool.block_tokens, seed)  # seed: the model's (its published hashes')
        if on:
            pool.reclaimer = self.index

    def seed_of(self, scope: str) -> int:
        """The hash seed of a session in prefix scope ``scope`` (OpenSession.prefix_scope): the model's
        mixed with the scope, so sessions of different scopes (tenants) never share a block here."""
        return scoped_seed(self.index.seed, scope)

    def new_kv(self, session_id: str) -> SessionKV:
        bt = self.w.rt.pool.block_tokens
        return SharedKV(bt, self.index, session_id) if self.on else SessionKV(bt)

    def share(self, s: Session) -> int:
        """Before the core admits a round of a session with no KV here: share the longest indexed
        prefix of its prompt. Its first round: returns the shared tokens (the round's history, not
        its input). A session whose KV was dropped (evicted, or the tier's drop) shares again what
        is still indexed of its prompt: history it does not prefill again; returns 0."""
        kv = s.kv
        if not isinstance(kv, SharedKV) or kv.tokens or kv.blocks or self.index.held(kv.session_id):
            return 0
        again = s.session_id in self.w.core.sessions
        if again and not s.core.evicted:  # (one rewound to nothing keeps its own blocks)
            return 0
        bt = self.w.rt.pool.block_tokens
        if again:
            hashes = prefix_hashes(s.tokens[:s.prefix_tokens + 1], bt, s.scoped_seed)
        else:  # its first round: its prefix is all its prompt's shareable blocks
            hashes = prefix_hashes(s.tokens, bt, s.scoped_seed)
            s.prefix_tokens = len(hashes) * bt
        self._revive_room(hashes)  # (hashed once, here: the index's share takes the same hashes)
        got = self.index.share(kv.session_id, hashes)
        s.shared_tokens = got.tokens
        if got.tokens:
            s.kv.blocks, s.kv.tokens, kv.shared_in = list(got.blocks), got.tokens, len(got.blocks)
            self.w.core.shared_history(s.core, got.tokens)
            self.w.metrics["prefix_shared_tokens"] += got.tokens
            s.recompute = max(0, s.recompute - got.tokens)
        return 0 if again else got.tokens

    def _revive_room(self, hashes: list[int]) -> None:
        """With the host tier, before sharing revives cached blocks: the core admits by the pool's
        available space (free and cached blocks) less the running rounds' due output, so cached
        blocks may be that output's room until it is written; reviving them there would leave a
        running round no block for a later token (KV exhausted). The cache gives way first, least
        recently released first, as far as the core's charges say (``DecodeCore.revive_cut``, the
        simulator's ``Prefixing.prefix_revive``): what is still indexed then revives within room
        nobody was promised, and the session shares less (its prefill computes the rest)."""
        w = self.w
        if w.tier is None or not self.index.cached_blocks:
            return
        pool = w.rt.pool
        bt = pool.block_tokens
        n = self.index.revives(hashes)
        if not n:
            return
        w.kv.sync()
        cut = w.core.revive_cut(n * bt, self.index.cached_blocks * bt)
        if cut > 0:
            pool.free(self.index.reclaim(-(-cut // bt)))

    def published(self, s: Session) -> None:
        """A round's prefill committed (its first token): the session's own full prompt blocks not
        yet indexed enter the index."""
        s.shared_tokens = 0
        kv = s.kv
        if isinstance(kv, SharedKV) and self.index.held(kv.session_id) * self.w.rt.pool.block_tokens < s.prefix_tokens:
            self.index.publish(kv.session_id, s.tokens[:s.prefix_tokens + 1], kv.blocks, s.scoped_seed)

    def own_pins(self) -> None:
        """Before the core decides by the pool (``KvSync.sync``): each idle session with a pinned
        prefix learns how much of it only it holds (``DecodeSession.pin_own``), so the core's pressure
        order does not drop a session whose prefix others still read (that frees nothing, and loses
        its host copy) while another victim frees blocks. The counts move as sessions share and let
        go, so they are taken afresh at each sync."""
        if not self.on:
            return
        sessions = self.w.sessions
        for c in self.w.core.evictable:
            s = sessions.get(c.session_id)
            if c.pinned and s is not None and s.core is c and isinstance(s.kv, SharedKV):
                c.pin_own = s.kv.pinned_own

    def rewound(self, s: Session, tokens: int) -> None:
        s.prefix_tokens = min(s.prefix_tokens, tokens)

    def gauges(self) -> dict[str, float]:
        return {"prefix_cached_tokens": self.index.cached_blocks * self.w.rt.pool.block_tokens}
