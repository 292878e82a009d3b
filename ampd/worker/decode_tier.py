"""The host-memory KV tier of a decode worker (``--kv-host-mb``): the half of ``DecodeCore`` that
decides, when a round ends in a tool call, whether the session's KV stays on the device, moves to the
host pool, or is dropped (``ampd.policy.kvtier.decide``), and brings it back when the next round's
input is ready.

Off (``DecodeCore(tier=None)``, the default) nothing here runs and the core behaves as before.

State: each session's KV is RESIDENT, on HOST or GONE; the host pool (``ampd.policy.hostpool.HostBlocks``)
keeps that state and the host blocks. The core counts tokens; a session whose KV is on host has
``s.fetch`` = the history tokens that are not on the device (0 otherwise), so the device KV charged to
a session between rounds is ``l_hist - fetch`` (0 when ``evicted``).

Moves: the core does the accounting at once and lists each move the driver must perform as a
``KVMove`` (``take_moves``): an offload (device -> host; the device blocks are the driver's to free
once the copy checked out) or a prefetch (host -> device, into blocks the round's admission reserved;
the round runs once it is done). The simulator times them with the profile's ``t_kv``
(``kvtier.host_transfer_s``); a live driver runs them through the KV transport.

Eviction: with the tier on, every session idle in a tool call whose KV is on the device is evictable
(no KV is pinned, so a pool full of idle sessions always makes room: never a deadlock), least recently
used first; a victim goes to the host while it has room (``pressure-offload``), else it is dropped
(``pressure-drop``) and its next round prefills its history again. When every running session waits
for KV, the other waiting sessions' resident KV goes the same way (``waiting-offload``,
``waiting-drop``: ``_tier_unblock``) rather than the head going over capacity.

Prefix sharing (``--prefix-sharing``): the driver sets ``s.pinned`` before ``tier_pause`` to the
history tokens in blocks the prefix index holds. Only the rest moves to host (``s.fetch``); the
pinned prefix stays on the device, charged, and evictable. Pressure order (``_tier_make_room``):
cached prefix blocks first (the live pool counts them free), then idle sessions' own KV to host
(least recently used first), then a pinned prefix left on the device whose blocks are partly the
session's alone (``pin_own``, the driver's count), dropped whole with its host copy, and last, only
when nothing else will free KV, one whose blocks others all still read (dropping it frees nothing);
a dropped session may share its prefix again before its next round (``shared_history``). Nothing
moves when taking every idle session but the last resort's would not make the room (the blocks
others still read are not counted freeable: ``_tier_freeable``).

Admission (``ampd.policy.admit.promise_room``) may promise up to the device pool plus the host pool,
so each round reserves its whole output when it is admitted (``KvAdmission._round_need``): the rounds
running at once never decode past the device pool.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Final, TYPE_CHECKING

from ampd.policy.cost import pre_s
from ampd.policy.hostpool import HostBlocks
from ampd.policy.kvtier import (DROP, OFFLOAD, KVState, KVTierConfig, PoolState, Prefetch, TierDecision, ToolPause,
                                decide_hinted, host_transfer_s, prefetch_plan, should_prefetch)
from ampd.policy.tooldur import ToolDurations
from ampd.policy.types import DecodeCost

if TYPE_CHECKING:  # (decode_kv imports this module: KvAdmission is a TierMixin)
    from .decode_kv import DecodeSession

__all__ = ["HostTier", "KVMove", "TierMixin", "TO_HOST", "FROM_HOST"]

TO_HOST: Final = "to_host"
FROM_HOST: Final = "from_host"


def _pin_only(s: DecodeSession, device_kv: int) -> bool:
    """Of an idle session's ``device_kv`` tokens on the device, only its pinned prefix is left (its
    own KV is on host, or it has none): the tier can only drop it."""
    return s.pinned > 0 and device_kv <= s.pinned


def _others_read(s: DecodeSession, pinned: int) -> int:
    """Of ``pinned`` tokens of ``s``'s pinned prefix, those other sessions still read: dropping ``s``
    frees only the rest (``pin_own``, the driver's count)."""
    return pinned - min(max(s.pin_own, 0), pinned)


@dataclass(slots=True, init=False)
class KVMove:
    """A transfer the driver performs: ``tokens`` of ``session_id``'s KV, ``direction`` TO_HOST or
    FROM_HOST, taking ``seconds`` (the profile's estimate); ``reason`` is the decision's."""

    session_id: str
    direction: str
    tokens: int
    seconds: float
    reason: str

    # (written out: compiled, a dataclass's generated __init__ runs as interpreted Python; tests/unit/test_inits.py
    # holds it to the fields)
    def __init__(self, session_id: str, direction: str, tokens: int, seconds: float, reason: str) -> None:
        self.session_id = session_id
        self.direction = direction
        self.tokens = tokens
        self.seconds = seconds
        self.reason = reason


@dataclass
class HostTier:
    """A decode worker's host tier: its pool, the policy's knobs, the per-tool duration estimates
    (fed by the driver: ``durations.observe``), the moves not yet taken and the counters."""

    host: HostBlocks
    cfg: KVTierConfig = field(default_factory=KVTierConfig)
    durations: ToolDurations = field(default_factory=ToolDurations)
    moves: list[KVMove] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)  # "action:reason" -> count
    plans: dict[str, Prefetch] = field(default_factory=dict)  # session id -> when its KV comes back
    prefetch_early: bool = False  # bring offloaded KV back before the result (at the tool's expected end)
    tokens_to_host: int = 0
    tokens_from_host: int = 0
    # a live driver's offloads not ended yet: the core counted their device KV free when it listed
    # them, the pool frees it as each ends (and the driver admits again then). The simulator's
    # moves free at once: 0 there
    pending_offloads: int = 0
    last: TierDecision | None = None  # the latest ``tier_pause`` decision (a live driver logs its reason)

    @classmethod
    def from_mb(cls, host_mb: float, block_tokens: int, bytes_per_token: int, session_tokens: int,
                cfg: KVTierConfig | None = None, prefetch_early: bool = False) -> "HostTier | None":
        """The tier of ``--kv-host-mb`` MiB (None when 0: off); HostPoolTooSmall when it cannot hold
        one session's KV of ``session_tokens`` tokens."""
        if host_mb == 0:
            return None
        return cls(HostBlocks.from_mb(host_mb, block_tokens, bytes_per_token, session_tokens), cfg or KVTierConfig(),
                   prefetch_early=prefetch_early)

    def count(self, action: str, reason: str) -> None:
        k = f"{action}:{reason}"
        self.decisions[k] = self.decisions.get(k, 0) + 1

    @property
    def host_tokens(self) -> int:
        """The host pool's capacity in tokens (what admission may promise beyond the device)."""
        return self.host.num_blocks * self.host.block_tokens

    @property
    def host_free_tokens(self) -> int:
        return self.host.free_blocks * self.host.block_tokens


class TierMixin:
    """The tier's calls on ``DecodeCore``, and the idle sessions eviction may take (``KvAdmission``
    evicts them too). The base of ``DecodeCore``'s chain (``TierMixin`` <- ``KvAdmission`` <-
    ``RunWindow`` <- ``DecodeCore``: single inheritance, for mypyc), each class holding the slots its
    methods use first; ``DecodeCore.__init__`` sets them all. The tier's methods run only with the
    tier on (``tier_prefetch_at``, ``tier_release`` and ``take_moves`` aside): they assert ``tier`` is
    set, which gives its type (mypy, mypyc)."""

    __slots__ = ("tier", "cost", "tp", "kv_admission", "sessions", "kv_cap", "kv_used", "wait_need", "kv_wait",
                 "new_wait", "evictable", "evictable_kv", "victims", "kv_evictions", "kv_recomputed_tokens",
                 "batch_size", "pending", "queue_len", "in_prefill", "chunk_session")
    tier: HostTier | None
    cost: DecodeCost
    tp: int
    kv_admission: str
    sessions: dict[str, DecodeSession]
    kv_cap: int
    kv_used: int
    wait_need: int
    kv_wait: deque[DecodeSession]
    new_wait: deque[DecodeSession]
    evictable: OrderedDict[DecodeSession, int]
    evictable_kv: int
    victims: list[DecodeSession]
    kv_evictions: int
    kv_recomputed_tokens: int
    batch_size: int
    pending: list[DecodeSession]
    queue_len: int
    in_prefill: DecodeSession | None
    chunk_session: DecodeSession | None

    def _evictable(self, s: DecodeSession) -> None:
        """``s`` joins the idle KV eviction may take, with its KV on the device (its history, less a
        part on host: the pinned prefix of a session offloaded with ``pinned``)."""
        if s not in self.evictable:
            r = s.l_hist - s.fetch
            self.evictable[s] = r
            self.evictable_kv += r

    def _not_evictable(self, s: DecodeSession) -> None:
        r = self.evictable.pop(s, None)
        if r is not None:
            self.evictable_kv -= r
            s.pin_own = 0  # the driver counts it again only while the session is evictable (its syncs)

    def tier_pause(self, s: DecodeSession, now: float, tool: str | None = None, hint_s: float | None = None) -> bool:
        """The session's round ended in a call to ``tool`` (instead of ``tool_call``): keep, offload or
        drop its KV (``kvtier.decide_hinted``: the tool's windowed duration, and the agent's
        ``expected_tool_s`` hint ``hint_s`` where it holds no more room); kept KV is evictable. True
        when KV freed or became evictable
        while rounds wait for KV (loop on ``admit_next``)."""
        t = self.tier
        assert t is not None
        t.last = None
        s.in_tool = True
        if s.evicted or s.fetch:
            return False
        s.pinned = min(max(s.pinned, 0), s.l_hist)
        kv = s.l_hist - s.pinned  # what can move: a pinned shared prefix stays on the device
        move_s = host_transfer_s(self.cost, kv, self.tp)
        pause = ToolPause(s.session_id, tool or "", t.durations.expected_s(tool or "", now),
                          kv, move_s, move_s, pre_s(self.cost, self.tp, s.pinned, kv) if kv > 0 else 0.0)
        pool = PoolState(self.kv_cap, self.kv_used, self.wait_need, t.host_free_tokens)
        d: TierDecision
        d, plan_s = decide_hinted(pause, hint_s, pool, t.cfg)  # (the agent's hint: advice, bounded there)
        t.last = d
        t.count(d.action, d.reason)
        if d.action == OFFLOAD:
            self._tier_offload(s, d.reason)
            if t.prefetch_early and plan_s is not None:
                t.plans[s.session_id] = prefetch_plan(now, plan_s, move_s, t.cfg)
            if s.pinned:  # the pinned prefix left on the device stays evictable (``_tier_victim``)
                self._evictable(s)
        elif d.action == DROP:
            self._tier_drop(s)
        else:
            self._evictable(s)
        return bool(self.kv_wait or self.new_wait)

    def _tier_offload(self, s: DecodeSession, reason: str) -> None:
        """The history less its pinned prefix (``s.pinned``: shared blocks, which stay) goes to host."""
        t = self.tier
        assert t is not None
        n = s.l_hist - s.pinned
        t.host.offload_begin(s.session_id, n)
        t.host.offload_done(s.session_id)
        t.tokens_to_host += n
        s.fetch = n
        self.kv_used -= n
        t.moves.append(KVMove(s.session_id, TO_HOST, n, host_transfer_s(self.cost, n, self.tp), reason))

    def _tier_drop(self, s: DecodeSession) -> None:
        t = self.tier
        assert t is not None
        t.host.drop(s.session_id)
        s.evicted = True
        self.kv_used -= s.l_hist - s.fetch
        self._unpin(s)
        s.fetch = 0

    def _tier_make_room(self, need: int, last_resort: bool | None) -> bool:
        """``_make_room`` with the tier: idle KV leaves the device until ``need`` fits (True then).

        The order: (1) idle sessions with KV of their own on the device, least recently used
        first: it goes to host while the host has room, else the session is dropped whole
        (``_tier_victim``); (2) sessions whose pinned prefix alone is left, least recently used
        first, dropped if some of its blocks are theirs alone (``pin_own``: freed then); (3) last
        resort, one a call: the least recently used of those whose every pinned block another
        session still reads. Dropping such a session frees nothing and loses its host copy (its next
        round prefills again), so (3) runs only when ``last_resort`` says so (``_last_resort``).
        When (1) and (2) together cannot make the room and (3) may not run, nothing moves
        (``_tier_freeable``): own parts offloaded then would only come back. It never deadlocks:
        once every other holder is dropped too, the driver's next sync counts the blocks free, or
        their owner's ``pin_own`` lets (2) take them."""
        if self.kv_cap - self.kv_used >= need:
            return True
        if self.kv_cap - self.kv_used + self._tier_freeable() < need and not self._last_resort(last_resort):
            return False  # offloading the own parts would not make room: they stay
        ev = self.evictable
        for v in [v for v, r in ev.items() if not _pin_only(v, r)]:
            if self.kv_cap - self.kv_used >= need:
                return True
            self._take_idle(v)
        others_read: list = []
        for v, r in list(ev.items()):  # (offloaded just now, their pinned prefix came last)
            if self.kv_cap - self.kv_used >= need:
                return True
            if not _pin_only(v, r):
                continue
            if v.pin_own > 0:
                self._take_idle(v)
            else:
                others_read.append(v)
        if self.kv_cap - self.kv_used >= need:
            return True
        if others_read and self._last_resort(last_resort):
            self._take_idle(others_read[0])
        return self.kv_cap - self.kv_used >= need

    def _tier_freeable(self) -> int:
        """The device KV taking every idle session (steps (1) and (2) of ``_tier_make_room``) would
        free: all of each one's KV on the device but the pinned blocks others still read (dropping
        it frees only ``pin_own`` of its pinned prefix, ``_unpin``). ``evictable_kv`` counts those
        too: by it the tier could move sessions' own parts to host and still lack the room."""
        return self.evictable_kv - sum(_others_read(v, min(v.pinned, r)) for v, r in self.evictable.items()
                                       if v.pinned > 0)

    def _last_resort(self, last_resort: bool | None) -> bool:
        """Whether a session whose pinned blocks others all read may be dropped: ``last_resort``
        when given (True: a driver's ``make_room``, the round is admitted already), else when
        nothing on this worker is in a round that will free KV (``_nothing_runs``)."""
        return last_resort if last_resort is not None else self._nothing_runs()

    def _nothing_runs(self) -> bool:
        """No round here will end and free KV (an empty batch, no local prefill, no admitted round
        whose prefill runs on a prefill worker: with the tier each admitted round has output
        ``due`` until it ends) and no offload in flight will free device blocks
        (``HostTier.pending_offloads``: a loaded box's slow moves made the last resort drop shared
        prefixes for room they were about to free), or rounds fail rather than wait: waiting for
        KV would then wait for nothing. (Only on the last resort's path: the walk over the
        sessions is rare.)"""
        t = self.tier
        assert t is not None
        return self.kv_admission == "fail" or not (
            self.batch_size or self.pending or self.queue_len or self.in_prefill is not None
            or self.chunk_session is not None or t.pending_offloads
            or any(s.due for s in self.sessions.values()))

    def _take_idle(self, v: DecodeSession) -> None:
        """``v`` leaves the evictable sessions: its KV goes to host, or it is a victim."""
        r = self.evictable.pop(v)
        self.kv_used -= r
        self.evictable_kv -= r
        if self._tier_victim(v):
            return  # moved to the host (a move for the driver), not a victim
        v.evicted = True
        self.kv_evictions += 1
        self.victims.append(v)

    def _tier_victim(self, v: DecodeSession) -> bool:
        """``_make_room`` evicts ``v`` (its KV on the device already uncharged): its own KV to the
        host while the host has room (True; its pinned prefix stays, evictable again, last in
        line); else, or when only that pinned prefix is left on the device, all of it is dropped
        (``v.evicted``, the host copy too; False: the driver frees it as a victim, and its
        references to shared blocks go)."""
        t = self.tier
        assert t is not None
        own = v.l_hist - v.pinned
        if not v.fetch and t.host_free_tokens >= own > 0:
            t.count(OFFLOAD, "pressure-offload")
            self.kv_used += v.l_hist  # _tier_offload uncharges its own part again
            self._tier_offload(v, "pressure-offload")
            if v.pinned:
                self._evictable(v)
            return True
        t.count(DROP, "pressure-drop")
        t.host.drop(v.session_id)
        t.plans.pop(v.session_id, None)
        self._unpin(v)
        v.evicted = True
        v.fetch = 0
        return False

    def _unpin(self, v: DecodeSession) -> None:
        """``v`` is dropped (the tier's drop, an eviction) with a pinned prefix (--prefix-sharing; 0
        otherwise), charged to it and uncharged now. Other sessions may still read those blocks, so
        the pool frees only the ones nobody else holds (``pin_own``, the driver's count at its last
        sync): the core counts the rest taken until the next ``sync_kv_free`` says what the pool has
        (the simulator: its index's exact count, ``Prefixing.prefix_sync``), or it would admit a
        round into blocks that are not free."""
        self.kv_cap -= _others_read(v, v.pinned)
        v.pinned = v.pin_own = 0

    def _tier_unblock(self, need: int) -> bool:
        """Every running session waits for KV and the head's ``need`` does not fit: the other waiting
        sessions' resident KV leaves the device, the last in the queue first, to the host while it
        has room (``waiting-offload``; fetched back when its round is admitted), else dropped
        (``waiting-drop``; its round prefills the history again). None of them is in a round, so
        none loses work. True once ``need`` fits: a session whose KV admission promised fits the
        device alone, so with the tier the device pool is never overcommitted for it."""
        t = self.tier
        assert t is not None
        for s in reversed(self.kv_wait):
            if self.kv_cap - self.kv_used >= need:
                break
            # (a history shared again after a drop, ``shared_history``, is charged only when admitted)
            if s is self.kv_wait[0] or s.evicted or s.fetch or s.l_hist - s.shared <= 0:
                continue
            if t.host_free_tokens >= s.l_hist:
                t.count(OFFLOAD, "waiting-offload")
                self._tier_offload(s, "waiting-offload")
                self.wait_need += s.fetch
            else:
                t.count(DROP, "waiting-drop")
                t.host.drop(s.session_id)
                self.kv_used -= s.l_hist
                self._unpin(s)  # (a pinned prefix others read frees nothing)
                t.host.reprefilled(s.session_id)  # its round, already ready, prefills the history now
                self.kv_recomputed_tokens += s.l_hist
                self.wait_need += s.l_hist
                s.l_incr += s.l_hist
                s.l_hist = 0
        return self.kv_cap - self.kv_used >= need

    def tier_prefetch_at(self, s: DecodeSession) -> float | None:
        """When the KV of ``s``, offloaded for its tool call, should start coming back before the
        result (``kvtier.prefetch_plan``: the expected end less the transfer and a margin); None:
        on the result only. The driver calls ``tier_prefetch`` then."""
        p = self.tier.plans.get(s.session_id) if self.tier is not None else None
        return None if p is None else p.at

    def tier_prefetch(self, s: DecodeSession, now: float) -> bool:
        """The prefetch time of ``s`` came: bring its KV back now if it is still on host and the
        device has blocks no waiting round needs (``kvtier.should_prefetch``: a speculative prefetch
        never takes another session's room). The KV is then idle on the device, evictable again.
        True when it started (a move for the driver)."""
        t = self.tier
        assert t is not None
        plan = t.plans.get(s.session_id)
        if plan is None or not (s.in_tool and s.fetch):
            return False
        pool = PoolState(self.kv_cap, self.kv_used, self.wait_need, t.host_free_tokens)
        why = should_prefetch(now, plan, False, s.fetch, pool)
        if not why:
            return False
        self.kv_used += s.fetch
        t.count("prefetch", why)
        self._not_evictable(s)  # (its pinned prefix was; now all of it is)
        self._tier_fetched(s, why)
        self._evictable(s)
        return True

    def _tier_fetched(self, s: DecodeSession, reason: str = "result-arrived") -> None:
        """The round of ``s``, whose KV is on host, was admitted (its history's blocks reserved with
        its input's), or its prefetch time came: the prefetch move."""
        t = self.tier
        assert t is not None
        t.plans.pop(s.session_id, None)
        n = s.fetch
        s.fetch = 0
        t.host.prefetch_begin(s.session_id)
        t.host.prefetch_done(s.session_id)
        t.tokens_from_host += n
        t.moves.append(KVMove(s.session_id, FROM_HOST, n, host_transfer_s(self.cost, n, self.tp), reason))

    def _tier_reprefilled(self, s: DecodeSession) -> None:
        t = self.tier
        assert t is not None
        if t.host.state(s.session_id) is KVState.GONE:
            t.host.reprefilled(s.session_id)

    def tier_release(self, s: DecodeSession) -> None:
        """The session ended or left: forget its host copy."""
        if self.tier is not None:
            self.tier.host.release(s.session_id)
            self.tier.plans.pop(s.session_id, None)

    def take_moves(self) -> list[KVMove]:
        """The transfers the driver must perform (each returned once); [] with the tier off."""
        t = self.tier
        if t is None or not t.moves:
            return []
        m, t.moves = t.moves, []
        return m
