"""Prefix sharing (ampd.kv.prefix): chained block hashes, shared blocks with reference counts,
copy-on-write, release to the pool with no leak; and binding by the longest prefix
(ampd.policy.prefixbind)."""

import pytest

from ampd.kv.pool import KVPool, KVPoolExhausted
from ampd.kv.prefix import CopyOp, PrefixIndex, block_hashes
from ampd.policy.prefixbind import bind_prefix
from ampd.policy.types import WorkerView

BT = 4


def pool_index(blocks=16):
    pool = KVPool(blocks, BT, 2)
    return pool, PrefixIndex(pool, BT)


SYS = list(range(100, 108))  # a two-block system prompt


def test_block_hashes_are_chained_and_full_blocks_only():
    a = block_hashes(SYS + [1, 2, 3, 4, 5], BT)
    b = block_hashes(SYS + [1, 2, 3, 9], BT)
    assert len(a) == 3 and len(b) == 3  # the partial block [5] has no hash
    assert a[:2] == b[:2] and a[2] != b[2]
    # the same block after a different prefix is a different block
    assert block_hashes([0, 0, 0, 0, 1, 2, 3, 4], BT)[1] != block_hashes([9, 9, 9, 9, 1, 2, 3, 4], BT)[1]
    assert block_hashes(SYS, BT, seed=1) != block_hashes(SYS, BT)
    assert block_hashes([1, 2, 3], BT) == []
    with pytest.raises(ValueError):
        block_hashes(SYS, 0)


def test_share_then_copy_on_write_at_the_first_differing_block():
    pool, idx = pool_index()
    ha = block_hashes(SYS + [1, 2, 3, 4], BT)
    hb = block_hashes(SYS + [5, 6, 7, 8], BT)
    ga = idx.acquire("a", ha)
    assert (ga.blocks, ga.shared) == ([0, 1, 2], 0)
    assert idx.match(hb) == 0  # not committed yet: its KV is not written
    assert idx.commit("a") == 3
    assert idx.match(hb) == 2 and idx.match(ha) == 3
    gb = idx.acquire("b", hb)
    assert (gb.blocks, gb.shared, gb.fresh) == ([0, 1, 3], 2, [3])  # block 2 differs: a fresh block
    assert [idx.refs(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert idx.commit("b") == 1
    assert pool.free_blocks == 12 and idx.blocks_held == 4
    assert idx.shared_blocks == 2
    idx.release("a")
    assert [idx.refs(b) for b in (0, 1, 2, 3)] == [1, 1, 0, 1]
    assert idx.match(ha) == 2  # a's last block went back with its session
    assert pool.free_blocks == 13
    idx.release("b")
    assert idx.empty and pool.free_blocks == 16


def test_truncate_into_a_shared_block_copies_it():
    pool, idx = pool_index()
    h = block_hashes(SYS + [1, 2, 3, 4], BT)
    idx.acquire("a", h)
    idx.commit("a")
    idx.acquire("b", h)
    assert idx.blocks("b") == [0, 1, 2]
    # b keeps 6 tokens: block 0 whole, 2 slots of block 1 (shared with a): copy-on-write
    op = idx.truncate("b", 6)
    assert op == CopyOp(src=1, dst=3, tokens=2)
    assert idx.blocks("b") == [0, 3]
    assert [idx.refs(b) for b in (0, 1, 2, 3)] == [2, 1, 1, 1]
    assert idx.match(h) == 3  # a's prefix is untouched
    assert idx.commit("b") == 0  # a cut block never enters the index
    idx.release("a")
    # b alone holds block 0 now; truncating into it writes in place and takes it out of the index
    assert idx.truncate("b", 2) is None
    assert idx.blocks("b") == [0] and idx.match(h) == 0
    assert idx.truncate("b", 100) is None  # past the prompt: nothing to do
    idx.release("b")
    assert idx.empty and pool.free_blocks == 16


def test_racing_commits_keep_the_first_block_indexed():
    pool, idx = pool_index()
    h = block_hashes(SYS, BT)
    idx.acquire("a", h)
    idx.acquire("b", h)  # before a committed: b computes its own copy
    assert idx.commit("a") == 2 and idx.commit("b") == 0
    assert idx.acquire("c", h).blocks == idx.blocks("a")
    for s in ("a", "b", "c"):
        idx.release(s)
    assert idx.empty and pool.free_blocks == 16


def test_exhausted_pool_holds_nothing_and_double_acquire_is_refused():
    pool, idx = pool_index(blocks=2)
    with pytest.raises(KVPoolExhausted):
        idx.acquire("a", block_hashes(list(range(12)), BT))
    assert idx.empty and pool.free_blocks == 2
    idx.acquire("a", [7])
    with pytest.raises(ValueError, match="already"):
        idx.acquire("a", [7])
    idx.release("a")
    idx.release("a")  # twice: nothing held
    assert idx.empty


def test_no_leak_over_many_sessions_with_mooncake_style_hash_ids():
    pool, idx = pool_index(blocks=64)
    live = []
    for i in range(300):
        hashes = [1, 2, 3][: 1 + i % 3] + [1000 + i] * (i % 2)  # shared roots, one own block
        try:
            idx.acquire(f"s{i}", hashes)
        except KVPoolExhausted:
            idx.release(live.pop(0))
            continue
        live.append(f"s{i}")
        if i % 4:
            idx.commit(f"s{i}")
        if i % 7 == 0:
            idx.truncate(f"s{i}", i % 9)
        if len(live) > 20:
            idx.release(live.pop(0))
        assert pool.free_blocks + idx.blocks_held == 64
    for s in live:
        idx.release(s)
    assert idx.empty and pool.free_blocks == 64


def dw(wid, free, itl=None):
    return WorkerView(wid, "decode", 1, itl, (), free, 0.0)


def test_bind_prefers_the_longest_prefix():
    ws = [dw("d0", 1000), dw("d1", 500), dw("d2", 800)]
    assert bind_prefix(ws, {}, 16) == ("d0", 0)  # no match: plain binding (most free)
    assert bind_prefix(ws, {"d1": 3, "d2": 2}, 16) == ("d1", 3)
    assert bind_prefix(ws, {"d1": 2, "d2": 2}, 16) == ("d2", 2)  # tie: most free
    # the session needs 560 tokens; d1 shares 3 x 16 = 48 of them, so it needs 512 > 500 free
    assert bind_prefix(ws, {"d1": 3, "d2": 2}, 16, need=560) == ("d2", 2)
    # a worker missing its ITL SLO gains no session for a cache hit
    ws[1] = dw("d1", 500, itl=0.2)
    assert bind_prefix(ws, {"d1": 3}, 16, itl_slo_s=0.1) == ("d0", 0)
    assert bind_prefix(ws, {"d1": 3}, 16, itl_slo_s=0.5) == ("d1", 3)
    assert bind_prefix(ws, {"d1": 3}, 16, promised={"d0": 2000}, need=900) == (None, 0)


def test_retain_keeps_released_blocks_indexed_until_evicted():
    pool = KVPool(16, BT, 2)
    idx = PrefixIndex(pool, BT, retain=True)
    free0 = pool.free_blocks
    idx.acquire("a", [1, 2, 3])
    idx.commit("a")
    assert idx.release("a") == 3 and idx.cached_blocks == 3 and pool.free_blocks == free0 - 3
    g = idx.acquire("b", [1, 2, 7])
    assert g.shared == 2 and idx.revived == 2 and idx.cached_blocks == 1
    assert idx.release("b") == 3 and idx.cached_blocks == 3  # 1, 2 indexed again; 7 never committed
    assert idx.evict(10) == 3 and idx.empty and pool.free_blocks == free0
