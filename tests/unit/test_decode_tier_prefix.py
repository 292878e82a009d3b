"""The host KV tier composed with prefix sharing in the decode core (ampd/worker/decode_tier.py,
decode_kv.py) and in the live adapter (services/decode/prefix.py), pure parts:

- a session's pinned prefix (``DecodeSession.pinned``: blocks the prefix index holds) stays on the
  device when its KV goes to host; only its own part moves and comes back;
- under pressure the own parts of idle sessions go first (least recently used first), then a pinned
  prefix left on the device whose blocks are the session's alone (``pin_own``); one that others
  still read (dropping it frees nothing) goes only as the last resort, one at a time, when nothing
  runs, with its host copy: the session re-prefills, sharing again what is still indexed
  (``shared_history`` on an evicted session);
- a rewind into the pinned prefix of an offloaded session lets go of the host copy;
- ``SharedKV.keep_pinned`` frees the own blocks and keeps the references.
Accounting (device tokens, host blocks, pool blocks) returns to empty in each test."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from ampd.kv import KVPool
from ampd.kv.hostpool import HostPool
from ampd.policy import SLO, make_queue
from ampd.worker import ADMITTED, FROM_HOST, TO_HOST, WAITING, DecodeCore, DecodeSession, HostTier
from services.decode.prefix import LivePrefix
from services.decode.session import Session
from tests.unit.test_worker_prefill import P

BT = 16


def _core(cap: int, host_tokens: int) -> DecodeCore:
    tier = HostTier(HostPool(host_tokens // BT, BT, P.kv_bytes_per_token))
    core = DecodeCore("decode-0", 1, P, make_queue("fcfs", P, SLO(1.0, 0.1), 1), kv_capacity_tokens=cap, tier=tier)
    core.tier.durations.observe("search", 0.0, 60.0)  # a long tool
    core.tier.cfg.offload_pressure = 0.0  # every pause moves what it can
    return core


def _first(core: DecodeCore, s: DecodeSession, prompt: int, shared: int = 0, last: bool = False) -> None:
    """The session's first round: ``shared`` of its ``prompt`` tokens shared, one output token."""
    if shared:
        core.shared_history(s, shared)
    s.round, s.l_incr, s.out = 0, prompt - shared, 1
    assert core.round_ready(s, 0.0) == ADMITTED
    assert core.first_token(s, 0.1) is False
    core.round_end(s, last)


def _next(core: DecodeCore, s: DecodeSession, rnd: int, new: int, now: float) -> int:
    s.round, s.l_incr, s.out = rnd, new, 1
    return core.round_ready(s, now)


def _end(core: DecodeCore, s: DecodeSession) -> None:
    assert core.first_token(s, 9.0) is False
    core.round_end(s, True)


def test_only_the_own_part_goes_to_host_and_comes_back():
    core = _core(cap=10_000, host_tokens=4096)
    a, b = DecodeSession("a"), DecodeSession("b")
    _first(core, a, 600)
    _first(core, b, 600, shared=512)  # b shares a's 512 prompt tokens
    assert core.kv_used == 600 + 1 + 600 + 1  # each charged its whole history (live: the pool's count rules)
    b.pinned = 512
    core.tier_pause(b, 1.0, "search")
    assert core.tier.decisions == {"offload:long-tool": 1} and b.fetch == 601 - 512
    assert [(m.session_id, m.direction, m.tokens) for m in core.take_moves()] == [("b", TO_HOST, 89)]
    assert core.kv_used == 601 + 512 and core.evictable[b] == 512  # the pinned prefix stays, evictable
    assert _next(core, b, 1, 10, 2.0) == ADMITTED and b.fetch == 0 and b not in core.evictable
    assert [(m.direction, m.tokens) for m in core.take_moves()] == [(FROM_HOST, 89)]
    assert b.l_hist == 601 and b.l_incr == 10
    _end(core, b)
    a.pinned = 0
    core.tier_pause(a, 3.0, "search")  # no pin: the whole history moves, as without sharing
    assert [(m.direction, m.tokens) for m in core.take_moves()] == [(TO_HOST, 601)]
    assert _next(core, a, 1, 5, 4.0) == ADMITTED
    _end(core, a)
    assert core.kv_used == 0 and not core.sessions and core.tier.host.empty and not core.evictable


def _pinned_pair(core: DecodeCore) -> tuple[DecodeSession, DecodeSession]:
    """a and b, 601 tokens each, b sharing a's 512 prompt tokens; both paused with them pinned."""
    a, b = DecodeSession("a"), DecodeSession("b")
    _first(core, a, 600)
    _first(core, b, 600, shared=512)
    for s in (a, b):
        s.pinned = 512
        core.tier_pause(s, 1.0, "search")
    return a, b


def test_under_pressure_own_parts_go_first_and_a_pinned_prefix_others_read_is_dropped_last():
    core = _core(cap=2000, host_tokens=4096)
    core.tier.cfg.offload_pressure = 1.0  # pauses keep: only pressure moves KV
    a, b = _pinned_pair(core)
    assert core.tier.decisions == {"keep:no-pressure": 2} and core.evictable_kv == 2 * 601
    # a new session of 1000: a's own part (89) and then b's (89) go to host; still short, and each
    # pinned prefix is read by the other (pin_own 0: dropping one frees nothing). Nothing runs, so
    # the last resort drops one, the least recently used (a), with its host copy; the core counts
    # its blocks taken until the driver's sync says what the pool has, and c waits until then
    c = DecodeSession("c")
    c.round, c.l_incr, c.out = 0, 1000, 1
    assert core.round_ready(c, 0.0) == WAITING
    assert core.tier.decisions["offload:pressure-offload"] == 2 and core.tier.decisions["drop:pressure-drop"] == 1
    assert core.take_victims() == [a] and a.evicted and a.fetch == a.pinned == 0
    assert core.tier.host.host_blocks("a") == 0 and not b.evicted and b.fetch == 89 and b.pinned == 512
    assert core.kv_used == 512 and core.kv_cap == 2000 - 512
    # the sync: the live pool holds b's pinned blocks alone (a let go of its references), and b is
    # their only holder now; c fits by that count, and b keeps its host copy
    b.pin_own = 512
    core.sync_kv_free(2000 - 512)
    assert core.admit_next(0.5) is c and not b.evicted and core.take_victims() == []
    _end(core, c)
    # a re-prefills its own part, sharing the still indexed prompt again (live: LivePrefix.share);
    # b's own part comes back from host
    core.shared_history(a, 512)
    assert _next(core, a, 1, 20, 2.0) == ADMITTED
    assert (a.l_hist, a.l_incr) == (512, 89 + 20) and core.kv_recomputed_tokens == 89
    assert _next(core, b, 1, 20, 2.0) == ADMITTED and core.kv_recomputed_tokens == 89
    assert [(m.session_id, m.direction, m.tokens) for m in core.take_moves()][-1] == ("b", FROM_HOST, 89)
    for s in (a, b):
        _end(core, s)
    assert core.kv_used == 0 and not core.sessions and core.tier.host.empty and core.evictable_kv == 0


def test_a_pinned_prefix_others_read_is_not_a_victim_while_one_of_its_own_frees_blocks():
    core = _core(cap=2000, host_tokens=4096)
    core.tier.cfg.offload_pressure = 1.0
    a, b = _pinned_pair(core)  # the least recently used two: the old order dropped a first
    d = DecodeSession("d")
    _first(core, d, 600, shared=512)  # d's pinned prefix is its own: nobody else holds it now
    d.pinned = 512
    core.tier_pause(d, 1.5, "search")
    a.pin_own, b.pin_own, d.pin_own = 0, 0, 512  # the driver's count (LivePrefix.own_pins)
    c = DecodeSession("c")
    c.round, c.l_incr, c.out = 0, 900, 1  # 197 free: the own parts (3 * 89) and d's prefix make room
    assert core.round_ready(c, 0.0) == ADMITTED
    assert core.tier.decisions["offload:pressure-offload"] == 3 and core.tier.decisions["drop:pressure-drop"] == 1
    assert core.take_victims() == [d] and d.evicted and core.tier.host.host_blocks("d") == 0
    assert not (a.evicted or b.evicted) and a.fetch == b.fetch == 89 and a.pinned == b.pinned == 512
    assert core.kv_cap == 2000  # d's blocks were its own: counted free at once
    for s in (c, a, b, d):
        if s is c:
            _end(core, c)
        else:
            core.drop(s)
    assert core.kv_used == 0 and not core.sessions and core.tier.host.empty and core.evictable_kv == 0


@pytest.mark.parametrize("running", ["decoding", "prefilling-remotely"])
def test_with_only_shared_pinned_prefixes_left_a_round_waits_while_one_runs_then_they_go(running):
    """``running``: e's round is in the batch, or admitted with its prefill on a prefill worker (no
    first token yet: it counts as running by its output due, ``_nothing_runs``)."""
    core = _core(cap=2000, host_tokens=4096)
    core.tier.cfg.offload_pressure = 1.0
    a, b = _pinned_pair(core)
    e = DecodeSession("e")  # a round in progress: its end will free KV
    e.round, e.l_incr, e.out = 0, 100, 50
    assert core.round_ready(e, 0.0) == ADMITTED
    if running == "decoding":
        assert core.first_token(e, 0.1) is True
    else:
        assert core.batch_size == 0 and not core.pending and core.queue_len == 0 and core.in_prefill is None
    c = DecodeSession("c")
    c.round, c.l_incr, c.out = 0, 1700, 1
    # the own parts (2 * 89) would not make room without the shared prefixes, which wait for e's
    # end: nothing moves (``_tier_freeable``)
    assert core.round_ready(c, 0.2) == WAITING
    assert core.tier.decisions == {"keep:no-pressure": 2} and core.take_moves() == []
    assert core.take_victims() == [] and a.fetch == b.fetch == 0 and not (a.evicted or b.evicted)
    if running != "decoding":
        assert core.first_token(e, 0.25) is True  # its remote prefill ended: it decodes here
    core.drop(e)  # (ended early: nothing runs now)
    # the last resort: the own parts go, then a, the least recently used; nothing is counted free
    # until the sync
    assert core.admit_next(0.3) is None and core.take_victims() == [a] and not b.evicted
    assert core.tier.decisions["offload:pressure-offload"] == 2 and b.fetch == 89
    b.pin_own = 512  # the sync: a let go, b alone holds the blocks now
    core.sync_kv_free(2000 - 512)
    assert core.admit_next(0.4) is c and core.take_victims() == [b]  # dropping b frees them: no deadlock
    _end(core, c)
    for s in (a, b):
        core.drop(s)
    assert core.kv_used == 0 and not core.sessions and core.tier.host.empty and core.evictable_kv == 0


def test_with_offloads_in_flight_a_pinned_prefix_others_read_is_not_the_last_resort():
    """Nothing runs, but the driver's offloads of the own parts have not ended (a loaded box: the
    pool frees their blocks later, and the driver admits again then): the round waits rather than
    drop a prefix others read, which frees nothing and loses the session's host copy (the live
    packed-pool test re-prefilled 1,046-3,037 tokens a run that way)."""
    core = _core(cap=2000, host_tokens=4096)
    a, b = _pinned_pair(core)  # every pause moves what it can: the own parts (89 each) go to host
    assert [(m.session_id, m.direction) for m in core.take_moves()] == [("a", TO_HOST), ("b", TO_HOST)]
    core.tier.pending_offloads = 2  # the driver's count: both transfers still run
    c = DecodeSession("c")
    c.round, c.l_incr, c.out = 0, 1700, 1  # fits only once the pool holds the one shared prefix
    assert core.round_ready(c, 0.2) == WAITING
    assert core.take_victims() == [] and not (a.evicted or b.evicted) and a.fetch == b.fetch == 89
    assert "drop:pressure-drop" not in core.tier.decisions and core.tier.host.host_blocks("a") > 0
    core.tier.pending_offloads = 0  # they ended: nothing will free KV now, so the last resort runs
    assert core.admit_next(0.3) is None and core.take_victims() == [a] and not b.evicted
    b.pin_own = 512  # the sync: a let go, b alone holds the blocks now
    core.sync_kv_free(2000 - 512)
    assert core.admit_next(0.4) is c and core.take_victims() == [b]
    _end(core, c)
    for s in (a, b):
        core.drop(s)
    assert core.kv_used == 0 and not core.sessions and core.tier.host.empty and core.evictable_kv == 0


def test_a_waiting_round_dropped_to_unblock_the_head_frees_only_its_own_part():
    core = _core(cap=2000, host_tokens=BT)  # a host too small for any session: waiting KV is dropped
    core.tier.cfg.offload_pressure = 1.0
    a, b = _pinned_pair(core)
    assert _next(core, a, 1, 2000, 2.0) == WAITING  # 798 free + b's 601 idle < 2001: nobody evicted
    assert _next(core, b, 1, 10, 2.1) == WAITING  # a waits first
    # every running session waits: b's KV is dropped for the head (waiting-drop) ...
    assert core.admit_next(2.2) is a and core.tier.decisions["drop:waiting-drop"] == 1
    assert b.l_hist == 0 and b.l_incr == 10 + 601 and b.pinned == 0
    # ... but its pinned 512 tokens are a's too: counted taken until the sync says what the pool has
    assert core.kv_cap == 2000 - 512 and core.kv_overcommits == 1


def test_a_waiting_round_whose_history_is_shared_again_is_not_moved_to_unblock_the_head():
    core = _core(cap=2000, host_tokens=4096)
    core.tier.cfg.offload_pressure = 1.0
    a, e, s = DecodeSession("a"), DecodeSession("e"), DecodeSession("s")
    _first(core, a, 600)
    _first(core, e, 600)
    _first(core, s, 600, shared=512)
    s.pinned = 512
    core._tier_drop(s)
    core.sync_kv_free(2000 - 1202)  # (its 512 others read are counted again)
    assert _next(core, a, 1, 999, 1.0) == WAITING  # 798 free, nothing idle
    assert _next(core, e, 1, 10, 1.1) == WAITING
    core.shared_history(s, 512)  # dropped, it shares its prefix again: charged when admitted
    assert _next(core, s, 1, 10, 1.2) == WAITING and (s.l_hist, s.shared) == (512, 512)
    # every running session waits: s, last in line, has nothing charged on the device to move, so
    # e's KV goes to host (a bug would move s's uncharged 512 and count them free)
    assert core.admit_next(1.3) is a
    assert core.tier.decisions["offload:waiting-offload"] == 1 and (e.fetch, s.fetch) == (601, 0)
    assert core.kv_used == 601 + 1000 and core.kv_overcommits == 0


def test_a_rewind_into_the_pinned_prefix_of_an_offloaded_session_lets_the_host_copy_go():
    core = _core(cap=10_000, host_tokens=4096)
    s = DecodeSession("s")
    _first(core, s, 600, shared=512)
    s.pinned = 512
    core.tier_pause(s, 1.0, "search")
    core.take_moves()
    core.rewind(s, 700)  # nothing to drop
    assert s.fetch == 89
    core.rewind(s, 550)
    assert (s.pinned, s.fetch, s.l_hist) == (512, 38, 550)
    core.rewind(s, 300)  # into the pinned blocks: nothing kept is on host
    assert (s.pinned, s.fetch, s.l_hist) == (300, 0, 300) and core.tier.host.empty
    assert core.evictable[s] == 300 and core.kv_used == 300
    assert _next(core, s, 1, 10, 2.0) == ADMITTED and core.take_moves() == []
    _end(core, s)
    assert core.kv_used == 0 and core.tier.host.empty


def test_a_session_dropped_by_the_policy_releases_its_pin_and_may_share_again():
    core = _core(cap=10_000, host_tokens=4096)
    s = DecodeSession("s")
    _first(core, s, 600, shared=512)
    s.pinned = 512
    core._tier_drop(s)  # the policy's drop (or a victim): all of it goes
    assert s.evicted and (s.fetch, s.pinned) == (0, 0) and core.kv_used == 0
    assert _next(core, s, 1, 10, 2.0) == ADMITTED  # nothing shared again: all prefilled again
    assert (s.l_hist, s.l_incr) == (0, 611)
    _end(core, s)
    assert core.kv_used == 0 and core.tier.host.empty


# ------------------------------------------------------------------------------- live adapter
def _live():
    pool = KVPool(32, 4, 8)
    w = SimpleNamespace(rt=SimpleNamespace(pool=pool), core=SimpleNamespace(sessions={}), tier=None,
                        metrics={"prefix_shared_tokens": 0})
    w.core.shared_history = lambda c, n: None
    return pool, LivePrefix(w, True)


def _prefilled(pool: KVPool, prefix: LivePrefix, sid: str, extra: int) -> Session:
    """A session whose prompt is three full shared-able blocks and ``extra`` tokens, prefilled, with
    6 decode tokens."""
    s = Session(session_id=sid, max_rounds=0, max_output=0, kv=prefix.new_kv(sid), core=DecodeSession(sid))
    s.tokens = list(range(100, 112)) + [extra]
    prefix.share(s)
    n = len(s.tokens) - s.kv.tokens
    s.kv.reserve(pool, n)
    s.kv.commit(n)
    prefix.published(s)
    s.kv.reserve(pool, 6)
    s.kv.commit(6)
    return s


def test_keep_pinned_keeps_the_shared_blocks_and_frees_the_own_ones():
    pool, prefix = _live()
    a = _prefilled(pool, prefix, "a", 1)
    assert a.kv.choose_pin() == 0  # nobody shares its prompt yet: nothing pinned, all of it may move
    b = _prefilled(pool, prefix, "b", 2)  # b finds a's three prompt blocks indexed
    assert b.kv.choose_pin() == 12 and b.kv.pinned == 12 and a.kv.choose_pin() == 12  # a's are read by b
    shared = b.kv.blocks[:3]
    b.kv.keep_pinned(pool)
    assert b.kv.blocks == shared and b.kv.tokens == 12 and all(prefix.index.refs(x) == 2 for x in shared)
    a.kv.release(pool)
    c = _prefilled(pool, prefix, "c", 3)
    assert c.kv.choose_pin() == 12  # what it found indexed stays pinned (b holds it too)
    for s in (b, c):
        s.kv.release(pool)
    assert prefix.index.cached_blocks == 3
    pool.free(prefix.index.reclaim(3))
    assert pool.free_blocks == 32 and prefix.index.empty


def test_a_session_that_shares_nothing_leaves_its_prompt_blocks_cached_when_it_moves():
    pool, prefix = _live()
    a = _prefilled(pool, prefix, "a", 1)
    assert a.kv.choose_pin() == 0
    prompt = a.kv.blocks[:3]
    a.kv.keep_pinned(pool)  # its KV went to host: its prompt blocks stay indexed, cached, shareable
    assert a.kv.blocks == [] and a.kv.tokens == 0 and prefix.index.cached_blocks == 3
    assert pool.free_blocks == 32 - 3 and pool.available_tokens == pool.capacity_tokens
    b = _prefilled(pool, prefix, "b", 2)
    assert b.kv.blocks[:3] == prompt  # shared again from the cache
    b.kv.release(pool)
    a.kv.release(pool)
    pool.free(prefix.index.reclaim(32))
    assert pool.free_blocks == 32 and prefix.index.empty


def test_own_pins_counts_the_pinned_tokens_only_the_session_holds():
    pool, prefix = _live()
    a = _prefilled(pool, prefix, "a", 1)
    b = _prefilled(pool, prefix, "b", 2)  # b reads a's three prompt blocks
    prefix.w.sessions = {"a": a, "b": b}
    prefix.w.core.evictable = {b.core: 12}
    b.core.pinned = b.kv.choose_pin()
    prefix.own_pins()
    assert b.core.pinned == 12 and b.core.pin_own == 0  # a reads them too: dropping b frees nothing
    a.kv.release(pool)
    prefix.own_pins()
    assert b.core.pin_own == 12 and b.kv.pinned_own == 12  # b alone holds them now
    b.kv.release(pool)
    pool.free(prefix.index.reclaim(32))
    assert pool.free_blocks == 32 and prefix.index.empty


def test_reviving_cached_blocks_never_takes_the_room_of_a_running_rounds_output():
    """A round running with the host tier was charged its whole output at admission, and the pool
    reserves it a token a step: cached prefix blocks (released, still indexed) may sit in that room
    until a token is written into them. A new session whose prompt matches them must not revive them
    there (the running round would find the pool full: KV exhausted); the cache gives way first, least
    recently released first (``KvAdmission.revive_cut``, the simulator's ``prefix_revive``)."""
    from services.decode.kv import KvSync

    pool = KVPool(8, 4, 8)
    core = DecodeCore("decode-0", 1, P, make_queue("fcfs", P, SLO(1.0, 0.1), 1), kv_capacity_tokens=32,
                      tier=HostTier(HostPool(64, 4, P.kv_bytes_per_token)))
    w = SimpleNamespace(rt=SimpleNamespace(pool=pool), core=core, sessions={}, metrics={"prefix_shared_tokens": 0},
                        tier=SimpleNamespace(owed=lambda: 0, deferred={}))
    w.prefix = prefix = LivePrefix(w, True)
    w.kv = KvSync(w)
    p = _prefilled(pool, prefix, "p", 1)  # three prompt blocks indexed, then cached as it ends
    p.kv.release(pool)
    assert prefix.index.cached_blocks == 3 and pool.free_blocks == 5
    a = Session(session_id="a", max_rounds=0, max_output=0, kv=prefix.new_kv("a"), core=DecodeSession("a"))
    a.tokens = [7, 8, 9, 10]  # its own prompt: one block
    w.sessions["a"] = a
    a.core.round, a.core.l_incr, a.core.out = 0, 4, 21
    w.kv.sync()
    assert core.round_ready(a.core, 0.0) == ADMITTED  # 25 tokens fit the 5 free blocks and the 3 cached
    a.kv.reserve(pool, 4)
    a.kv.commit(4)
    assert core.first_token(a.core, 0.1) is True  # 20 output tokens due: 5 blocks, 4 free
    w.kv.sync()
    assert core.kv_cap - core.kv_used == 28 - 20
    c = Session(session_id="c", max_rounds=0, max_output=0, kv=prefix.new_kv("c"), core=DecodeSession("c"))
    c.tokens = list(range(100, 112)) + [5]  # p's prompt
    c.prefix_tokens = 12
    prefix.share(c)
    w.kv.sync()
    assert pool.available_tokens >= w.kv.outputs_due() == 20
    assert c.kv.tokens <= 8  # two blocks at most revived: one cached block went back first
    for _ in range(20):  # the running round makes its output, a token a step
        a.kv.reserve(pool, 1)
        a.kv.commit(1)
    for s in (a, c):
        s.kv.release(pool)
    pool.free(prefix.index.reclaim(8))
    assert pool.free_blocks == 8 and prefix.index.empty
