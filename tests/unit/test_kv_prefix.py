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
    return pool, PrefixIndex(BT)


def release(pool, idx, *sids):
    for s in sids:
        pool.free(idx.release(s))


def drain(pool, idx):
    """Every cached block back to the pool: nothing leaked."""
    pool.free(idx.reclaim(pool.num_blocks))
    assert idx.empty and pool.free_blocks == pool.num_blocks


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
    ga = idx.acquire("a", ha, pool)
    assert (ga.blocks, ga.shared) == ([0, 1, 2], 0)
    assert idx.match(hb) == 0  # not committed yet: its KV is not written
    assert idx.commit("a") == 3 and idx.changes == 3
    assert idx.match(hb) == 2 and idx.match(ha) == 3
    gb = idx.acquire("b", hb, pool)
    assert (gb.blocks, gb.shared, gb.fresh) == ([0, 1, 3], 2, [3])  # block 2 differs: a fresh block
    assert [idx.refs(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert idx.commit("b") == 1
    assert pool.free_blocks == 12 and idx.held_blocks == 4
    assert idx.shared_blocks == 2 and idx.shared_tokens == 2 * BT
    release(pool, idx, "a")
    assert [idx.refs(b) for b in (0, 1, 2, 3)] == [1, 1, 0, 1]
    assert idx.match(ha) == 3 and idx.cached_blocks == 1  # a's last block stays indexed, cached
    assert pool.free_blocks == 12
    release(pool, idx, "b")
    assert idx.cached_blocks == 4 and idx.changes == 4
    drain(pool, idx)
    assert idx.changes == 8  # every hash in, every hash out


def test_truncate_into_a_shared_block_copies_it():
    pool, idx = pool_index()
    h = block_hashes(SYS + [1, 2, 3, 4], BT)
    idx.acquire("a", h, pool)
    idx.commit("a")
    idx.acquire("b", h, pool)
    assert idx.blocks("b") == [0, 1, 2]
    # b keeps 6 tokens: block 0 whole, 2 slots of block 1 (shared with a): copy-on-write, the
    # driver copies them into a block of b's own
    assert idx.truncate("b", 6) == ([], CopyOp(src=1, tokens=2))
    assert idx.blocks("b") == [0]
    assert [idx.refs(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert idx.match(h) == 3  # a's prefix is untouched
    assert idx.commit("b") == 0  # nothing fresh of b's is left to index
    release(pool, idx, "a")
    assert idx.cached_blocks == 2
    # b alone holds block 0 now; truncating into it leaves it b's own, out of the index
    assert idx.truncate("b", 2) == ([], None)
    assert idx.blocks("b") == [] and idx.match(h) == 0
    assert idx.truncate("b", 100) == ([], None)  # nothing held: nothing to do
    pool.free([0])  # b's own block, its session's to free
    release(pool, idx, "b")
    drain(pool, idx)


def test_truncate_past_fresh_blocks_gives_them_back():
    pool, idx = pool_index()
    h = block_hashes(SYS + [1, 2, 3, 4], BT)
    idx.acquire("a", h, pool)  # not committed: the fresh blocks are held, not indexed
    assert idx.truncate("a", 4) == ([1, 2], None) and idx.blocks("a") == [0]
    pool.free([1, 2])
    assert idx.commit("a") == 1 and idx.match(h) == 1
    release(pool, idx, "a")
    drain(pool, idx)


def test_racing_commits_keep_the_first_block_indexed():
    pool, idx = pool_index()
    h = block_hashes(SYS, BT)
    idx.acquire("a", h, pool)
    idx.acquire("b", h, pool)  # before a committed: b computes its own copy
    assert idx.commit("a") == 2 and idx.commit("b") == 0
    assert idx.acquire("c", h, pool).blocks == idx.blocks("a")
    release(pool, idx, "a", "b", "c")
    assert pool.free_blocks == 14 and idx.cached_blocks == 2  # b's copies went back, a's stay indexed
    drain(pool, idx)


def test_exhausted_pool_holds_nothing_and_double_acquire_is_refused():
    pool, idx = pool_index(blocks=2)
    with pytest.raises(KVPoolExhausted):
        idx.acquire("a", block_hashes(list(range(12)), BT), pool)
    assert idx.empty and pool.free_blocks == 2
    idx.acquire("a", [7], pool)
    with pytest.raises(ValueError, match="already"):
        idx.acquire("a", [7], pool)
    release(pool, idx, "a", "a")  # twice: nothing held the second time
    drain(pool, idx)


def test_no_leak_over_many_sessions_with_mooncake_style_hash_ids():
    pool, idx = pool_index(blocks=64)
    pool.reclaimer = idx  # cached blocks go back before an allocation would fail
    live: list[str] = []
    own: dict[str, list[int]] = {}  # blocks a truncate left a session's own (its driver frees them)

    def end(sid):
        release(pool, idx, sid)
        pool.free(own.pop(sid, []))

    for i in range(300):
        sid, hashes = f"s{i}", [1, 2, 3][: 1 + i % 3] + [1000 + i] * (i % 2)  # shared roots, one own block
        try:
            idx.acquire(sid, hashes, pool)
        except KVPoolExhausted:
            end(live.pop(0))
            continue
        live.append(sid)
        if i % 4:
            idx.commit(sid)
        if i % 7 == 0:
            before = idx.blocks(sid)
            gone, copy = idx.truncate(sid, i % 9)
            pool.free(gone)
            full, part = divmod(i % 9, BT)
            kept = before[full:full + 1] if part else []  # a partly kept block: the session's to write
            assert idx.blocks(sid) == before[:full] and not set(kept) & set(gone)
            assert (copy is not None) == (bool(kept) and idx.refs(kept[0]) > 0)
            own[sid] = pool.alloc(1) if copy is not None else kept
        if len(live) > 20:
            end(live.pop(0))
        assert pool.free_blocks + idx.cached_blocks + idx.held_blocks + sum(map(len, own.values())) == 64
    for s in live:
        end(s)
    drain(pool, idx)


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


def test_released_blocks_stay_cached_until_reclaimed_and_revive_when_shared():
    pool, idx = pool_index()
    free0 = pool.free_blocks
    idx.acquire("a", [1, 2, 3], pool)
    idx.commit("a")
    assert idx.release("a") == [] and idx.cached_blocks == 3 and pool.free_blocks == free0 - 3
    g = idx.acquire("b", [1, 2, 7], pool)
    assert g.shared == 2 and idx.revived == 2 and idx.cached_blocks == 1
    held = idx.held_blocks
    assert idx.release("b") == [g.blocks[2]]  # 7 never committed: back to the pool
    assert held - idx.held_blocks == 3 and idx.cached_blocks == 3  # 1, 2 cached again, with 3
    pool.free(g.blocks[2:])
    assert len(idx.reclaim(10)) == 3 and idx.empty
