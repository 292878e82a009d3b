"""The pure prefix-sharing core of a decode worker (ampd.policy.prefixindex.PrefixIndex, as the live worker drives it) and the pool's reclaim hook."""
from __future__ import annotations

import pytest

from ampd.kv import KVPool, KVPoolExhausted
from ampd.policy.prefixindex import CopyOp, PrefixIndex, prefix_hashes

BT = 4
SYS = list(range(100, 112))  # three full blocks of system prompt


def _pool(blocks: int = 16) -> tuple[KVPool, PrefixIndex]:
    pool = KVPool(blocks, BT, 8)
    idx = PrefixIndex(BT)
    pool.reclaimer = idx
    return pool, idx


def _prefill(pool: KVPool, idx: PrefixIndex, sid: str, tokens: list[int]) -> list[int]:
    """share, allocate the rest, publish: the session's blocks."""
    sh = idx.share(sid, prefix_hashes(tokens, BT))
    own = pool.alloc(pool.blocks_for(len(tokens)) - len(sh.blocks))
    blocks = list(sh.blocks) + own
    idx.publish(sid, tokens, blocks)
    return blocks


def _end(pool: KVPool, idx: PrefixIndex, sid: str, blocks: list[int], now: float) -> None:
    n = idx.held(sid)
    pool.free(idx.release(sid) + blocks[n:])


def _drain(pool: KVPool, idx: PrefixIndex) -> None:
    pool.free(idx.reclaim(pool.num_blocks))
    assert idx.empty and pool.free_blocks == pool.num_blocks


def test_prefix_hashes_leave_one_token_to_prefill():
    assert len(prefix_hashes(list(range(8)), BT)) == 1  # 8 tokens: the second block holds the last one
    assert len(prefix_hashes(list(range(9)), BT)) == 2
    assert prefix_hashes([], BT) == []


def test_sessions_share_the_common_blocks_and_own_the_first_differing_one():
    pool, idx = _pool()
    a = _prefill(pool, idx, "a", SYS + [1, 2, 3, 4, 5])
    assert idx.held("a") == 4  # 3 system blocks + its own full block; the partial one stays its own
    sh = idx.share("b", prefix_hashes(SYS + [9, 9, 9, 9, 9], BT))
    assert sh.blocks == tuple(a[:3]) and sh.tokens == 12
    assert all(idx.refs(x) == 2 for x in a[:3]) and idx.refs(a[3]) == 1
    b = list(sh.blocks) + pool.alloc(2)
    assert idx.publish("b", SYS + [9, 9, 9, 9, 9], b) == 4
    assert b[3] != a[3]  # copy-on-write at the first differing block: b's own
    _end(pool, idx, "a", a, 1.0)
    assert idx.refs(a[0]) == 1 and idx.cached_blocks == 1  # a's own full block stays cached
    _end(pool, idx, "b", b, 2.0)
    assert idx.cached_blocks == 5 and idx.held_blocks == 0
    _drain(pool, idx)


def test_released_blocks_are_shared_again_and_reclaimed_lru_under_pressure():
    pool, idx = _pool(8)
    a = _prefill(pool, idx, "a", SYS + [1])
    _end(pool, idx, "a", a, 1.0)
    assert idx.cached_blocks == 3 and pool.free_blocks == 5
    assert pool.available_tokens == 8 * BT  # cached blocks count as free
    sh = idx.share("b", prefix_hashes(SYS + [2], BT))
    assert sh.blocks == tuple(a[:3]) and idx.cached_blocks == 0  # revived
    b = list(sh.blocks) + pool.alloc(1)
    idx.publish("b", SYS + [2], b)
    _end(pool, idx, "b", b, 2.0)
    # an unrelated session needs the whole pool: the cache goes back, oldest first, no refusal
    c = pool.alloc(8)
    assert idx.cached_blocks == 0 and idx.reclaimed_blocks == 3 and idx.empty
    with pytest.raises(KVPoolExhausted):
        pool.alloc(1)
    pool.free(c)
    _drain(pool, idx)


def test_reclaim_takes_least_recently_released_first():
    pool, idx = _pool()
    x = _prefill(pool, idx, "x", [1] * 4 + [0])
    y = _prefill(pool, idx, "y", [2] * 4 + [0])
    _end(pool, idx, "y", y, 1.0)
    _end(pool, idx, "x", x, 2.0)
    gone = idx.reclaim(1)
    assert gone == [y[0]]
    pool.free(gone)
    assert idx.share("z", prefix_hashes([1] * 4 + [5], BT)).tokens == 4
    assert idx.share("w", prefix_hashes([2] * 4 + [5], BT)).tokens == 0
    pool.free(idx.release("z"))
    _drain(pool, idx)


def test_a_block_held_by_a_session_is_never_reclaimed():
    pool, idx = _pool(4)
    a = _prefill(pool, idx, "a", SYS + [1])
    assert idx.reclaim(4) == []
    with pytest.raises(KVPoolExhausted):
        pool.alloc(1)
    _end(pool, idx, "a", a, 1.0)
    _drain(pool, idx)


def test_truncate_copies_a_partly_kept_shared_block():
    pool, idx = _pool()
    a = _prefill(pool, idx, "a", SYS + [1])
    b = _prefill(pool, idx, "b", SYS + [2])
    assert b[:3] == a[:3]
    gone, copy = idx.truncate("b", 6)  # keeps block 0 and half of block 1, which a still reads
    assert gone == [] and copy == CopyOp(a[1], 2) and idx.held("b") == 1
    assert idx.refs(a[1]) == 1 and idx.refs(a[2]) == 1 and idx.refs(a[0]) == 2
    own = pool.alloc(1)  # the driver copies 2 slots into a block of b's own
    pool.free(b[3:])  # and frees b's blocks past the kept tokens
    b = b[:1] + own
    _end(pool, idx, "b", b, 1.0)
    _end(pool, idx, "a", a, 2.0)
    _drain(pool, idx)


def test_truncate_of_a_block_it_alone_holds_keeps_it_as_its_own():
    pool, idx = _pool()
    a = _prefill(pool, idx, "a", SYS + [1])
    gone, copy = idx.truncate("a", 6)
    assert copy is None and gone == [a[2]] and idx.held("a") == 1
    assert idx.share("b", prefix_hashes(SYS + [1], BT)).tokens == 4  # the kept partial block is no prefix block any more
    pool.free(gone + a[3:])
    pool.free(idx.release("b"))
    pool.free(idx.release("a") + [a[1]])
    _drain(pool, idx)


def test_share_twice_is_an_error_and_release_of_unknown_is_nothing():
    pool, idx = _pool()
    a = _prefill(pool, idx, "a", SYS + [1])
    with pytest.raises(ValueError):
        idx.share("a", prefix_hashes(SYS + [1], BT))
    assert idx.release("nobody") == []
    _end(pool, idx, "a", a, 0.0)
    _drain(pool, idx)


def test_shared_run_counts_the_blocks_others_read_and_unpin_caches_the_rest():
    pool, idx = _pool()
    a = _prefill(pool, idx, "a", SYS + [1, 2, 3, 4, 5])  # four indexed blocks
    assert idx.held("a") == 4 and idx.shared_run("a") == 0
    b = _prefill(pool, idx, "b", SYS + [9])
    assert idx.shared_run("a") == idx.shared_run("b") == 3 and idx.shared_run("nobody") == 0
    # the host tier moved a's KV but its first three blocks: its fourth goes to the cache
    assert idx.unpin("a", 3) == [] and idx.held("a") == 3 and idx.cached_blocks == 1
    assert idx.unpin("a", 3) == []  # nothing past them any more
    pool.free(a[4:])
    assert idx.unpin("b", 0) == [] and idx.held("b") == 0  # b lets go of all: a still reads them
    assert all(idx.refs(x) == 1 for x in a[:3])
    pool.free(b[3:])
    _end(pool, idx, "a", a[:3], 3.0)
    _drain(pool, idx)


def test_changes_count_every_hash_in_and_out_of_the_index():
    pool, idx = _pool()
    a = _prefill(pool, idx, "a", SYS + [1, 2, 3, 4, 5])
    assert idx.changes == 4  # four blocks indexed
    b = _prefill(pool, idx, "b", SYS + [9])
    assert idx.changes == 4  # shared: nothing entered
    _end(pool, idx, "b", b, 1.0)
    assert idx.changes == 4  # released, still indexed
    gone, _ = idx.truncate("a", 2 * BT)  # a alone holds its blocks 2 and 3: they leave the index
    assert idx.changes == 6 and len(idx.hashes()) == 2
    pool.free(gone + a[4:])
    _end(pool, idx, "a", a[:2], 2.0)
    _drain(pool, idx)
    assert idx.changes == 8
