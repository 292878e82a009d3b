"""The live decode worker's prefix sharing adapter (services/decode/prefix.py) on a real pool, with a
stand-in for the worker: off it is inert; on, a later session's blocks are the earlier one's for the
shared prompt blocks (their mock KV checks out for it), its own from the first differing block; a
rewind into shared blocks copies on write; released blocks stay cached and go back to the pool when
it is short; the pool is empty at the end of every test. The path through the services:
tests/integration/test_prefix_sharing_live.py."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ampd.kv import KVPool, SessionKV, kv_pattern, verify_pattern
from ampd.worker import DecodeSession
from services.decode.prefix import LivePrefix, SharedKV
from services.decode.session import Session

BT, BPT = 4, 8
SYS = list(range(1000, 1012))  # three full blocks


class _Core:
    def __init__(self) -> None:
        self.sessions: dict[str, DecodeSession] = {}

    def shared_history(self, c: DecodeSession, tokens: int) -> None:
        c.l_hist += tokens


def _worker(on: bool, blocks: int = 32):
    w = SimpleNamespace(rt=SimpleNamespace(pool=KVPool(blocks, BT, BPT)), core=_Core(), tier=None,
                        metrics={"prefix_shared_tokens": 0})
    w.prefix = LivePrefix(w, on)
    return w


def _session(w, sid: str, prompt: list[int]) -> Session:
    s = Session(session_id=sid, max_rounds=0, max_output=0, kv=w.prefix.new_kv(sid), core=DecodeSession(sid))
    s.tokens = list(prompt)
    return s


def _first_round(w, s: Session) -> int:
    """What the worker does for a first round: share, reserve the rest, the mock's prefill writes it,
    commit, publish. Returns the shared tokens."""
    pool = w.rt.pool
    shared = w.prefix.share(s)
    n = len(s.tokens) - s.kv.tokens
    start = s.kv.tokens
    pool.write(s.kv.reserve(pool, n), kv_pattern(s.session_id, start, n, BPT, s.prefix_tokens))
    s.kv.commit(n)
    w.prefix.published(s)
    return shared


def _check(w, s: Session) -> int:
    """Wrong bytes in the session's KV against its mock pattern."""
    return verify_pattern(s.session_id, 0, w.rt.pool.read(s.kv.segments(0, s.kv.tokens)), BPT, s.prefix_tokens)


def _empty(w) -> bool:
    pool = w.rt.pool
    pool.free(w.prefix.index.reclaim(pool.num_blocks))
    return w.prefix.index.empty and pool.free_blocks == pool.num_blocks


def test_off_it_is_inert():
    w = _worker(False)
    s = _session(w, "a", SYS + [1])
    assert type(s.kv) is SessionKV and w.rt.pool.reclaimer is None
    assert _first_round(w, s) == 0 and s.prefix_tokens == 0
    t = _session(w, "b", SYS + [2])
    assert _first_round(w, t) == 0 and not set(s.kv.blocks) & set(t.kv.blocks)
    s.kv.release(w.rt.pool)
    t.kv.release(w.rt.pool)
    assert _empty(w)


def test_a_later_session_shares_the_prompt_blocks_and_its_kv_checks_out():
    w = _worker(True)
    pool = w.rt.pool
    a = _session(w, "a", SYS + [1, 2, 3, 4, 5])
    assert isinstance(a.kv, SharedKV) and pool.reclaimer is w.prefix.index
    assert _first_round(w, a) == 0 and a.prefix_tokens == 16
    b = _session(w, "b", SYS + [9, 9, 9, 9, 9, 9])
    assert _first_round(w, b) == 12 and b.core.l_hist == 12
    assert b.kv.blocks[:3] == a.kv.blocks[:3] and b.kv.blocks[3] != a.kv.blocks[3]  # its own from block 3
    assert w.metrics["prefix_shared_tokens"] == 12
    assert _check(w, a) == 0 and _check(w, b) == 0
    # decode tokens go into the session's own blocks
    seg = b.kv.reserve(pool, 1)
    assert seg[0].block not in a.kv.blocks
    b.kv.commit(1)
    a.kv.release(pool)
    assert w.prefix.index.refs(b.kv.blocks[0]) == 1
    b.kv.release(pool)
    assert w.prefix.gauges()["prefix_cached_tokens"] == 5 * BT  # 3 shared + a's and b's 4th blocks
    assert pool.available_tokens == pool.capacity_tokens
    assert _empty(w)


def test_cached_blocks_are_shared_again_and_reclaimed_before_a_refusal():
    w = _worker(True, blocks=8)
    pool = w.rt.pool
    a = _session(w, "a", SYS + [1])
    _first_round(w, a)
    a.kv.release(pool)
    assert w.prefix.index.cached_blocks == 3 and pool.free_blocks == 5
    c = _session(w, "c", SYS + [7])
    assert _first_round(w, c) == 12 and _check(w, c) == 0  # revived from the cache
    c.kv.release(pool)
    # an unrelated session needing the whole pool gets it: the cache goes back first
    d = _session(w, "d", list(range(31)) + [5])
    assert _first_round(w, d) == 0 and len(d.kv.blocks) == 8 and w.prefix.index.cached_blocks == 0
    d.kv.release(pool)
    assert _empty(w)


def test_a_rewind_into_shared_blocks_copies_on_write():
    w = _worker(True)
    pool = w.rt.pool
    a = _session(w, "a", SYS + [1])
    _first_round(w, a)
    b = _session(w, "b", SYS + [2])
    _first_round(w, b)
    before = pool.read(a.kv.segments(0, a.kv.tokens)).copy()
    b.kv.truncate(pool, 6)  # keeps block 0 and 2 tokens of block 1, which a still reads
    w.prefix.rewound(b, 6)
    assert b.kv.tokens == 6 and b.kv.blocks[0] == a.kv.blocks[0] and b.kv.blocks[1] != a.kv.blocks[1]
    assert len(b.kv.blocks) == 2 and _check(w, b) == 0
    # b writes on into its own copy: a's blocks stay as they were
    new = list(range(50, 60))
    b.tokens = b.tokens[:6] + new
    pool.write(b.kv.reserve(pool, len(new)), kv_pattern("b", 6, len(new), BPT, b.prefix_tokens))
    b.kv.commit(len(new))
    assert np.array_equal(pool.read(a.kv.segments(0, a.kv.tokens)), before) and _check(w, b) == 0
    b.kv.release(pool)
    a.kv.release(pool)
    assert _empty(w)


def test_a_rewind_past_the_shared_blocks_is_a_plain_truncate():
    w = _worker(True)
    pool = w.rt.pool
    a = _session(w, "a", SYS + [1, 2, 3, 4, 5, 6])
    _first_round(w, a)
    a.kv.truncate(pool, 17)
    assert a.kv.tokens == 17 and len(a.kv.blocks) == 5 and w.prefix.index.held(a.kv.session_id) == 4
    a.kv.release(pool)
    assert _empty(w)


def test_a_session_opened_again_under_its_id_keeps_apart_from_its_old_blocks():
    w = _worker(True)
    pool = w.rt.pool
    old = _session(w, "a", SYS + [1])
    _first_round(w, old)
    new = _session(w, "a", SYS + [1])  # the old one's blocks wait for a prefill worker's notification
    assert _first_round(w, new) == 12 and new.kv.session_id != old.kv.session_id
    old.kv.release(pool)  # released late: the new session's references stay
    assert all(w.prefix.index.refs(b) == 1 for b in new.kv.blocks[:3]) and _check(w, new) == 0
    new.kv.release(pool)
    assert _empty(w)
