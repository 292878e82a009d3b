"""Prefix sharing in the simulator (``--prefix-sharing``): a session's first round whose prompt
blocks (the trace's ``hash_ids``) a live session on its decode worker committed shares their KV,
prefills only the rest and holds only its own blocks.

Each decode worker has an ``ampd.policy.prefixindex.PrefixIndex`` (the live worker's index; hash
blocks of ``HASH_BLOCK_TOKENS`` tokens, block ids from one counter a run, ``BlockIds``). The decode
core is not changed: a sharing session starts its first round with ``l_hist`` = the shared tokens
(charged to nobody new) and ``l_incr`` = the rest, so the core prefills and charges only the rest.
When a session ends the core subtracts its whole history; the index says which prompt blocks nobody
holds any more (a shared block goes when its last holder does), and ``kv_used`` is corrected by the
difference. Such blocks stay indexed in the worker's free KV (as a prefix cache keeps freed blocks
until their space is taken): sharing one again charges it again; the cache is cut to the KV free
(less what waiting rounds need; with the host tier, of the KV written, ``prefix_trim``), least
recently released first (``PrefixIndex.reclaim``), before
each match and whenever a round or a new session takes KV (an approximation: decode tokens grow into
it between rounds). Binding (``bind_prefix``) prefers the worker with the longest prefix when it
fits and meets the ITL SLO. Rounds without ``hash_ids`` behave as without sharing.

With KV that leaves the device while sessions idle in tool calls (``kv_evict``, the host tier,
a KV-pinning policy: ``_Run.prefix_kv``) the decode core decides as live, fed as the live worker
feeds it (services/decode/prefix.py, ``KvSync.sync``): as a round ends in a tool call the session's
pinned prefix (``prefix_pin``: with the tier ``SharedKV.choose_pin``'s blocks, which stay on the
device while its own KV goes to host, taken again before each decision while its KV is on the
device; without it every block the index holds for it), and before each admission decision how
much of each idle session's pinned prefix it alone holds (``prefix_own``: ``pin_own``,
``LivePrefix.own_pins``). After the call (``prefix_sync``) the index
lets go of what the core moved or dropped: a session moved to host keeps only its pinned blocks
(``unpin``; its own indexed ones are cached), one evicted or dropped releases them all; the blocks
other sessions still hold are charged back, and the core's capacity is the device's again (the
index's exact count replaces ``_unpin``'s estimate, as the live pool's count does at a sync). A
dropped session shares again, before its next round, what is still indexed of its prompt
(``prefix_again``: ``DecodeCore.shared_history``; those tokens are counted already, so
``prefix_admitted`` takes the core's charge for them off). The cache of blocks nobody holds is cut
to the free KV before each match and each round's admission, so it gives way first.
"""
from __future__ import annotations

from typing import Final, TYPE_CHECKING

from ampd.policy.admit import AdmissionBook
from ampd.policy.prefixindex import PrefixIndex
from ampd.policy.prefixbind import MOVE_MIN_BLOCKS, rebind_prefix
from ampd.worker import ADMITTED, TO_HOST
from ampd.workload.mooncake import HASH_BLOCK_TOKENS

from .workers import Decode, Sess

if TYPE_CHECKING:  # (a cycle: ampd.sim.loop builds _Run from this mixin)
    from .loop import Simulator

__all__ = ["Prefixing", "BlockIds", "prefix_indexes", "MOVE_MIN_BLOCKS"]

WAITING_DROP: Final = "drop:waiting-drop"  # (``HostTier.decisions``' key: ``TierMixin._tier_unblock``)


class BlockIds:
    """Block ids for the workers' indexes (``PrefixIndex.acquire``'s pool), never reused: the KV
    itself is counted by the decode core, so a block that goes back needs no freeing here."""

    __slots__ = ("next_id",)

    def __init__(self) -> None:
        self.next_id = 0

    def alloc(self, n_blocks: int) -> list[int]:
        out = list(range(self.next_id, self.next_id + n_blocks))
        self.next_id += n_blocks
        return out


def prefix_indexes(cfg, decodes) -> dict[str, PrefixIndex] | None:
    """worker id -> PrefixIndex with sharing on, else None."""
    if not cfg.prefix_sharing:
        return None
    return {d.worker_id: PrefixIndex(HASH_BLOCK_TOKENS) for d in decodes}


class Prefixing:
    """Prefix-sharing handlers of ``ampd.sim.loop._Run``, the base of its chain of handler classes
    (``Prefixing`` <- ``Tiering`` <- ``RemotePrefilling`` <- ``Admitting`` <- ``_Run``: single
    inheritance, each class holding the slots it is the first to use; ``prefix``: worker id ->
    index or None, ``prefix_ids``: their ``BlockIds``, ``prefix_held``: session id -> [prompt blocks,
    shared tokens, fresh blocks, tokens shared again that the core will charge], ``prefix_saved``, ``prefix_blocks``, ``prefix_sessions``, ``prefix_revived``,
    ``prefix_evicted``; with KV moves (``prefix_kv``): ``prefix_cap``, each decode worker's capacity,
    ``prefix_wdrops``, its tier's waiting-drops seen, and ``prefix_let``, blocks let go of by moves)."""

    __slots__ = ("sim", "live", "decodes", "book", "tier", "kv_evict", "pin_ttl", "prefix", "prefix_parked",
                 "prefix_kv", "prefix_ids", "prefix_held", "prefix_cap", "prefix_wdrops", "prefix_saved",
                 "prefix_blocks", "prefix_sessions", "prefix_revived", "prefix_evicted", "prefix_let")
    sim: Simulator
    live: dict[str, Sess]
    decodes: list[Decode]
    book: AdmissionBook
    tier: bool
    kv_evict: bool
    pin_ttl: float | None
    prefix: dict[str, PrefixIndex] | None
    prefix_parked: tuple[dict[str, PrefixIndex], bool] | None
    prefix_kv: bool
    prefix_ids: BlockIds
    prefix_held: dict[str, list[int]]
    prefix_cap: list[int]
    prefix_wdrops: list[int]
    prefix_saved: int
    prefix_blocks: int
    prefix_sessions: int
    prefix_revived: int
    prefix_evicted: int
    prefix_let: int

    def prefix_bind(self, w, bound: str, decode) -> str:
        """The worker for new session ``w`` that admission bound to ``bound``: the one holding the
        longest prefix of its prompt when that fits and meets the ITL SLO (the promise moves); the
        bound worker stays when it holds as long a prefix as any (a prefix every worker holds, such
        as a system prompt, does not pull every session onto one worker)."""
        hashes = w.s.rounds[0].hash_ids
        if not hashes:
            return bound
        for d in self.decodes:
            self.prefix_trim(d)
        matched = {wid: ix.match(hashes) for wid, ix in self.prefix.items()}  # type: ignore[union-attr]  # (sharing on)
        book = self.book
        wid, _ = rebind_prefix(bound, decode, matched, HASH_BLOCK_TOKENS, book.promised, w.need, self.sim.slo.itl_s)
        if wid == bound:  # (MOVE_MIN_BLOCKS: a prefix every worker holds is not worth leaving admission's choice)
            return bound
        book.promised[bound] -= w.need
        book.sessions[bound] -= 1
        book.promised[wid] += w.need
        book.sessions[wid] += 1
        return wid

    def prefix_acquire(self, st) -> None:
        """The session is bound: its prompt's full blocks (all but the last token's) are held."""
        rnd = st.rounds[0]
        if not rnd.hash_ids:
            return
        n = min(len(rnd.hash_ids), (int(rnd.input) - 1) // HASH_BLOCK_TOKENS)
        if n <= 0:
            return
        ix = self.prefix_revive(st.dw, rnd.hash_ids[:n])
        g = ix.acquire(st.session_id, rnd.hash_ids[:n], self.prefix_ids)
        st.dw.kv_used += ix.revived * HASH_BLOCK_TOKENS  # cached blocks held again: charged to this session
        self.prefix_revived += ix.revived
        self.prefix_trim(st.dw)  # its fresh blocks take cached blocks' space first
        shared = g.shared * HASH_BLOCK_TOKENS
        self.prefix_held[st.session_id] = [n, shared, n - g.shared, 0]
        if g.shared:
            self.prefix_saved += shared
            self.prefix_blocks += g.shared
            self.prefix_sessions += 1

    def prefix_first(self, st) -> None:
        """Round 0's input is set: the shared tokens are history already (not prefilled, not charged)."""
        h = self.prefix_held.get(st.session_id)
        if h is not None and h[1]:
            st.l_hist = h[1]
            st.l_incr -= h[1]

    def prefix_commit(self, st) -> None:
        """Round 0's prefill is done (its first token): its prompt blocks hold KV, others may share them."""
        if st.session_id in self.prefix_held:
            self.prefix[st.dw.worker_id].commit(st.session_id)  # type: ignore[index]  # (sharing on)

    def prefix_release(self, st, charged: bool) -> None:
        """The session ended (``charged``: the core subtracted its whole history, shared tokens
        included; else it was never admitted there): its blocks go back as the index says."""
        h = self.prefix_held.pop(st.session_id, None)
        if h is None:
            return
        if h[3]:  # shared again after its KV was dropped, and its round never admitted: nothing charged
            charged = False
        ix = self.prefix[st.dw.worker_id]  # type: ignore[index]  # (sharing on)
        held = ix.held_blocks
        mine = ix.held(st.session_id)  # (fewer than its prompt blocks once its KV moved: prefix_let_go)
        ix.release(st.session_id)  # (the blocks it returns need no freeing: ids are not reused)
        dropped = held - ix.held_blocks  # nobody holds them now (indexed ones cached)
        bt = HASH_BLOCK_TOKENS
        st.dw.kv_used += (mine - dropped) * bt if charged else -(dropped - h[2]) * bt

    def prefix_init(self, cfg) -> None:
        self.prefix = prefix_indexes(cfg, self.decodes)  # None: prefix sharing off (or parked: prefix_park)
        self.prefix_parked = None
        # sharing with KV that leaves the device while sessions idle (the module doc)
        self.prefix_kv = self.prefix is not None and bool(self.kv_evict or self.tier or self.pin_ttl is not None)
        self.prefix_cap = [d.kv_cap for d in self.decodes]
        self.prefix_wdrops = [0] * len(self.decodes)
        self.prefix_let = 0
        self.prefix_ids = BlockIds()
        self.prefix_held = {}
        self.prefix_saved = self.prefix_blocks = self.prefix_sessions = self.prefix_revived = self.prefix_evicted = 0

    def prefix_park(self, sessions) -> None:
        """Sharing is on but no session's first round has ``hash_ids`` (a synthetic preset's trace):
        nothing is ever indexed, so every prefix call would leave the empty indexes, the sessions'
        pins (0) and the cores as they are. The run skips them (``prefix`` None, as with sharing
        off: 9-11 % of a GAIA run's simulate instructions, callgrind); ``prefix_stats`` reads them where
        they are parked."""
        self.prefix_parked = None
        if self.prefix is not None and not any(s.rounds and s.rounds[0].hash_ids for s in sessions):
            self.prefix_parked = (self.prefix, self.prefix_kv)
            self.prefix, self.prefix_kv = None, False

    # --- with kv_evict, the host tier or a KV-pinning policy (``prefix_kv``) ----------------------
    def prefix_round_ready(self, st, now: float) -> int:
        """``DecodeCore.round_ready`` fed and followed as the live worker does (the module doc)."""
        d = st.dw
        if st.evicted:
            self.prefix_again(st)
        self.prefix_own(d)
        code = d.round_ready(st, now)
        self.prefix_sync(d)
        if code == ADMITTED:
            self.prefix_admitted(st)
        return code

    def prefix_admit_next(self, d, now: float):
        """``DecodeCore.admit_next``, fed and followed the same way."""
        self.prefix_own(d)
        st = d.admit_next(now)
        self.prefix_sync(d)
        if st is not None:
            self.prefix_admitted(st)
        return st

    def prefix_pin(self, st) -> None:
        """A round of ``st`` ended in a tool call (before ``tool_call``/``tier_pause``): its pinned
        prefix (``DecodeSession.pinned``). With the host tier, as live (``SharedKV.choose_pin``): the
        blocks it found indexed and those another session also holds now, which stay on the device
        when its own KV goes to host. Without it: every block the index holds for it, so that an
        eviction frees only those no other session holds (``pin_own``)."""
        ix = self.prefix[st.dw.worker_id]  # type: ignore[index]  # (sharing on)
        sid = st.session_id
        held = ix.held(sid)
        if held and self.tier:
            h = self.prefix_held.get(sid)
            held = min(max(h[1] // HASH_BLOCK_TOKENS if h else 0, ix.shared_run(sid)), held)
        st.pinned = min(held * HASH_BLOCK_TOKENS, st.l_hist)

    def prefix_again(self, st) -> None:
        """Before the next round of ``st``, whose KV was dropped (evicted, or the tier's drop): as live
        (``LivePrefix.share``), it shares again what is still indexed of its prompt's blocks; those
        tokens are history it does not prefill again (``DecodeCore.shared_history``). The core
        charges them when it admits the round; they are counted already (other sessions hold them,
        or ``acquire`` revived them from the cache and they are charged here), so ``prefix_admitted``
        takes them off. Its prompt blocks past them are its own from then on (not indexed again)."""
        h = self.prefix_held.get(st.session_id)
        if h is None or not h[0]:
            return
        d = st.dw
        hashes = st.rounds[0].hash_ids[:h[0]]
        ix = self.prefix_revive(d, hashes)
        m = ix.match(hashes)
        tokens = min(m * HASH_BLOCK_TOKENS, st.l_hist)
        if tokens < HASH_BLOCK_TOKENS:
            return
        m = tokens // HASH_BLOCK_TOKENS
        ix.acquire(st.session_id, hashes[:m], self.prefix_ids)
        d.kv_used += ix.revived * HASH_BLOCK_TOKENS
        self.prefix_revived += ix.revived
        self.prefix_trim(d)
        d.shared_history(st, tokens)
        h[1], h[2], h[3] = tokens, 0, tokens  # (live: ``SharedKV.shared_in``, which its next pin keeps)
        self.prefix_saved += tokens
        self.prefix_blocks += m

    def prefix_admitted(self, st) -> None:
        """The core admitted the round of ``st`` (charged): tokens it shared again are counted already."""
        h = self.prefix_held.get(st.session_id)
        if h is not None and h[3]:
            st.dw.kv_used -= h[3]
            h[3] = 0

    def prefix_own(self, d) -> None:
        """Before the core decides by its KV (as the live ``KvSync.sync`` does, ``LivePrefix.own_pins``):
        each idle session with a pinned prefix learns how much of it only it holds (``pin_own``)."""
        ix = self.prefix[d.worker_id]  # type: ignore[index]  # (sharing on)
        bt = HASH_BLOCK_TOKENS
        tier = self.tier
        for c in d.evictable:
            if tier and not c.fetch:
                # its KV on the device: its pin is taken again, as sessions may have shared more of
                # its blocks since it paused (live it is the pause's, and the pool frees less than
                # the core counted when the rest moves; ``LiveTier.defer`` then makes more room)
                self.prefix_pin(c)
            if c.pinned:
                c.pin_own = bt * sum(ix.own_leading(c.session_id, c.pinned // bt))

    def prefix_sync(self, d, st=None) -> None:
        """After a core call that may have moved or dropped idle KV (``st``: the session it was
        about, if any): the index lets go of the blocks of each session whose KV the core no longer
        counts on the device (``prefix_let_go``), and the core's KV is the exact count again (its
        capacity back, undoing ``_unpin``'s estimate, which the index's counts replace)."""
        d.kv_cap = self.prefix_cap[d.idx]
        cands = d.take_victims()
        if self.tier:
            live = self.live
            cands += [live[m.session_id] for m in d.tier.moves if m.direction == TO_HOST and m.session_id in live]
            n = d.tier.decisions.get(WAITING_DROP, 0)
            if n != self.prefix_wdrops[d.idx]:  # a waiting round's KV was dropped (no move, no victim)
                self.prefix_wdrops[d.idx] = n
                cands += d.kv_wait
        if st is not None:
            cands.append(st)
        for s in cands:
            self.prefix_let_go(d, s)

    def prefix_let_go(self, d, s) -> None:
        """The core dropped the KV of ``s`` (evicted, the tier's drop: its references go) or moved it
        to host (it keeps only its pinned prefix in the index): what the core uncharged for blocks
        another session still holds is charged back, as they stay on the device."""
        ix = self.prefix[d.worker_id]  # type: ignore[index]  # (sharing on)
        sid = s.session_id
        held = ix.held(sid)
        if not held:
            return
        if s.evicted or (s.round and not s.l_hist):  # (no history: a waiting round's KV dropped)
            keep = 0
        elif s.fetch:
            keep = s.pinned // HASH_BLOCK_TOKENS
        else:
            return
        if keep >= held:
            return
        before = ix.held_blocks
        if keep:
            ix.unpin(sid, keep)  # (indexed blocks nobody holds now are cached: free, as live)
        else:
            ix.release(sid)
        still = held - keep - (before - ix.held_blocks)
        self.prefix_let += held - keep
        d.kv_used += still * HASH_BLOCK_TOKENS

    def prefix_trim(self, d) -> PrefixIndex:
        """Cached blocks (released, still indexed) live in the worker's free KV: those past what is
        free now (less what waiting rounds need) are evicted, least recently released first.
        With the host tier, free of the KV written, as the live pool counts it (it reclaims a cached
        block only when an allocation needs it): the core has charged running rounds' whole output
        at admission, and waiting rounds' with their input, and the cache keeps the room of the
        tokens not made yet until they are. Else free of everything charged."""
        ix = self.prefix[d.worker_id]  # type: ignore[index]  # (sharing on)
        if ix.cached_blocks:
            bt = HASH_BLOCK_TOKENS
            free = d.kv_cap - d.kv_used - d.wait_need
            over = ix.cached_blocks * bt - max(free, 0)
            if over > 0 and d.tier is not None:
                free += d.output_tokens_due() + sum(s.out for s in d.kv_wait) + sum(s.out for s in d.new_wait)
                over = ix.cached_blocks * bt - max(free, 0)
            if over > 0:
                self.prefix_evicted += len(ix.reclaim(-(-over // bt)))
        return ix

    def prefix_revive(self, d, hashes) -> PrefixIndex:
        """Before a session shares the indexed prefix of ``hashes``: reviving a cached block charges
        it again, and with the host tier a cached block may sit in room charged to output not made
        yet (``prefix_trim``). When reviving would take KV past the device by the core's charges,
        the cache first gives way to those charges, least recently released first (as the pool
        would reclaim it while the outputs are made): the blocks revived then all fit, and a running
        round's output never loses its room to a shared prefix."""
        ix = self.prefix_trim(d)
        if ix.cached_blocks:
            bt = HASH_BLOCK_TOKENS
            cut = d.revive_cut(ix.revives(hashes) * bt, ix.cached_blocks * bt)  # (the live pool's: LivePrefix)
            if cut > 0:
                self.prefix_evicted += len(ix.reclaim(-(-cut // bt)))
        return ix

    def prefix_stats(self, stats: dict) -> None:
        """The run's prefix counters (with sharing on, parked or not: ``prefix_park``)."""
        prefix, prefix_kv = self.prefix_parked or (self.prefix, self.prefix_kv)
        if prefix is None:
            return
        stats["prefix_shared_tokens"] = self.prefix_saved  # prefill tokens saved
        stats["prefix_shared_blocks"] = self.prefix_blocks
        stats["prefix_sharing_sessions"] = self.prefix_sessions
        stats["prefix_blocks_held_end"] = sum(ix.held_blocks for ix in prefix.values())
        stats["prefix_blocks_revived"] = self.prefix_revived  # shared again from the cache
        stats["prefix_blocks_evicted"] = self.prefix_evicted  # cache blocks whose space was needed
        stats["prefix_blocks_cached_end"] = sum(ix.cached_blocks for ix in prefix.values())
        if prefix_kv:  # prompt blocks idle sessions let go of as their KV was dropped or moved to host
            stats["prefix_blocks_let_go"] = self.prefix_let
