import json

import numpy as np
import pytest

from ampd.kv import (
    PatternCache,
    KVPool,
    KVPoolExhausted,
    PoolLayout,
    Segment,
    SessionKV,
    kv_pattern,
    pair_ranges,
    segments_tokens,
    verify_pattern,
)


# --- pool -----------------------------------------------------------------------------------------
def test_pool_shape_and_layout():
    pool = KVPool(num_blocks=8, block_tokens=4, bytes_per_token=16)
    assert pool.buffer.dtype == np.uint8 and pool.buffer.nbytes == 8 * 4 * 16
    assert pool.capacity_tokens == 32 and pool.free_blocks == 8 and pool.free_tokens == 32
    lay = pool.layout
    assert lay.base_addr == pool.buffer.ctypes.data
    d = json.loads(json.dumps(lay.to_dict()))
    assert PoolLayout.from_dict(d) == lay
    with pytest.raises(ValueError, match="block_tokens"):
        PoolLayout.from_dict({"base_addr": 1, "num_blocks": 2, "bytes_per_token": 3})
    with pytest.raises(ValueError):
        KVPool(0, 4, 16)


def test_alloc_free_exhaustion():
    pool = KVPool(4, 2, 8)
    a = pool.alloc(3)
    assert sorted(a) == [0, 1, 2] and len(set(a)) == 3
    assert pool.free_blocks == 1 and pool.free_tokens == 2
    with pytest.raises(KVPoolExhausted) as ei:
        pool.alloc(2)
    assert ei.value.needed == 2 and ei.value.free == 1
    assert "needed 2" in str(ei.value) and "1 free" in str(ei.value)
    assert pool.free_blocks == 1  # failed alloc took nothing
    assert pool.alloc(0) == []
    pool.free([a[1]])
    assert pool.free_blocks == 2
    with pytest.raises(ValueError, match="double free"):
        pool.free([a[1]])
    with pytest.raises(ValueError, match="double free"):
        pool.free([a[0], a[0]])
    assert pool.free_blocks == 2  # rejected free changed nothing
    with pytest.raises(ValueError, match="out of range"):
        pool.free([99])
    b = pool.alloc(2)
    assert set(b) == {a[1], 3}
    pool.free(a[0:1] + a[2:] + b)
    assert pool.free_blocks == 4


def test_write_read_round_trip_and_errors():
    pool = KVPool(4, 4, 3)
    segs = [Segment(2, 1, 3), Segment(0, 0, 4), Segment(3, 3, 1)]
    data = np.arange(8 * 3, dtype=np.uint8)
    pool.write(segs, data)
    out = pool.read(segs)
    assert np.array_equal(out, data)
    out[:] = 0  # read returns a copy
    assert np.array_equal(pool.read(segs), data)
    # bytes landed where the layout says
    assert np.array_equal(pool.buffer[(2 * 4 + 1) * 3 : (2 * 4 + 4) * 3], data[:9])
    assert pool.read([]).size == 0
    with pytest.raises(ValueError, match="bytes"):
        pool.write(segs, data[:-1])
    with pytest.raises(ValueError, match="outside"):
        pool.read([Segment(1, 3, 2)])
    with pytest.raises(ValueError, match="outside"):
        pool.read([Segment(4, 0, 1)])



def test_contiguous_write_and_read_view():
    pool = KVPool(4, 4, 3)
    run = [Segment(1, 2, 2), Segment(2, 0, 4), Segment(3, 0, 0), Segment(3, 0, 1)]  # one byte run
    data = np.arange(7 * 3, dtype=np.uint8) + 1
    pool.write(run, data)  # one slice assignment
    assert np.array_equal(pool.buffer[(1 * 4 + 2) * 3 : (3 * 4 + 1) * 3], data)
    view = pool.read(run, copy=False)
    assert np.array_equal(view, data) and np.shares_memory(view, pool.buffer)
    assert not view.flags.writeable
    assert np.array_equal(pool.read(run), data) and not np.shares_memory(pool.read(run), pool.buffer)
    scattered = [Segment(2, 0, 4), Segment(1, 2, 2)]  # not one run: a copy either way
    out = pool.read(scattered, copy=False)
    assert np.array_equal(out, np.concatenate([data[6:18], data[:6]]))
    assert not np.shares_memory(out, pool.buffer)
    assert pool.read([], copy=False).size == 0
    with pytest.raises(ValueError, match="segment 1 .* outside"):
        pool.read([Segment(0, 0, 1), Segment(0, 3, 2)], copy=False)
    with pytest.raises(ValueError, match="outside"):
        pool.write([Segment(4, 0, 1)], data[:3])


# --- sessions -------------------------------------------------------------------------------------
def test_session_reserve_commit_segments_across_partial_blocks():
    pool = KVPool(16, 4, 2)
    s = SessionKV()
    segs = s.reserve(pool, 6)
    b0, b1 = s.blocks
    assert segs == [Segment(b0, 0, 4), Segment(b1, 0, 2)]
    assert s.tokens == 0 and pool.free_blocks == 14
    s.commit(6)
    assert s.tokens == 6
    # the partial last block is filled first
    segs = s.reserve(pool, 7)
    b2, b3 = s.blocks[2:]
    assert segs == [Segment(b1, 2, 2), Segment(b2, 0, 4), Segment(b3, 0, 1)]
    assert segments_tokens(segs) == 7
    s.commit(7)
    assert s.tokens == 13
    assert s.segments(3, 6) == [Segment(b0, 3, 1), Segment(b1, 0, 4), Segment(b2, 0, 1)]
    assert s.segments(0, 0) == []
    with pytest.raises(ValueError):
        s.segments(10, 4)
    with pytest.raises(ValueError):
        s.commit(1)  # nothing reserved
    # exact fit in the partial block allocates nothing
    free = pool.free_blocks
    assert s.reserve(pool, 3) == [Segment(b3, 1, 3)]
    assert pool.free_blocks == free
    # a new reservation replaces the old one, allocation is all-or-nothing
    with pytest.raises(KVPoolExhausted):
        s.reserve(pool, 1000)
    assert pool.free_blocks == free
    s.reserve(pool, 5)
    assert s.reserved == 5 and len(s.blocks) == 5
    s.trim(pool)
    assert s.reserved == 0 and len(s.blocks) == 4 and pool.free_blocks == free
    s.release(pool)
    assert s.tokens == 0 and s.blocks == [] and pool.free_blocks == 16


def test_session_on_pool_with_other_block_size_rejected():
    s = SessionKV()
    s.reserve(KVPool(4, 4, 2), 1)
    with pytest.raises(ValueError, match="block_tokens"):
        s.reserve(KVPool(4, 8, 2), 1)


def test_session_pattern_write_read():
    pool = KVPool(32, 8, 5)
    pool.alloc(3)  # others hold some blocks, so the session's are not at 0
    s = SessionKV()
    for n in (5, 11, 1, 17):
        segs = s.reserve(pool, n)
        pool.write(segs, kv_pattern("sess", s.tokens, n, 5))
        s.commit(n)
    assert verify_pattern("sess", 0, pool.read(s.segments(0, s.tokens)), 5) == 0
    assert verify_pattern("sess", 7, pool.read(s.segments(7, 9)), 5) == 0


# --- pattern --------------------------------------------------------------------------------------
def test_kv_pattern_deterministic_and_sliceable():
    a = kv_pattern("s-1", 10, 20, 13)
    assert a.dtype == np.uint8 and a.shape == (20 * 13,)
    assert np.array_equal(a, kv_pattern("s-1", 10, 20, 13))
    # any sub-range is the same bytes: content depends on (session, position, byte) only
    assert np.array_equal(a[5 * 13 : 8 * 13], kv_pattern("s-1", 15, 3, 13))
    assert kv_pattern("s-1", 0, 0, 13).size == 0
    # byte j of a position does not depend on bytes_per_token
    assert np.array_equal(kv_pattern("s-1", 3, 1, 40)[:13], kv_pattern("s-1", 3, 1, 13))


def test_kv_pattern_distinct_across_sessions_and_positions():
    bpt = 64
    a = kv_pattern("s-1", 0, 100, bpt).reshape(100, bpt)
    b = kv_pattern("s-2", 0, 100, bpt).reshape(100, bpt)
    # sessions differ at every position, positions differ within a session
    assert all(not np.array_equal(a[i], b[i]) for i in range(100))
    assert len({row.tobytes() for row in a}) == 100
    # roughly uniform bytes (no constant runs)
    assert np.count_nonzero(a == b) < a.size // 50
    assert len(np.unique(a)) > 200


def test_verify_pattern_counts_mismatches():
    d = kv_pattern("s", 4, 10, 16).copy()
    assert verify_pattern("s", 4, d, 16) == 0
    d[3] ^= 1
    d[100] ^= 0xFF
    d[159] += 1
    assert verify_pattern("s", 4, d, 16) == 3
    assert verify_pattern("s", 5, kv_pattern("s", 4, 10, 16), 16) > 100  # wrong start
    assert verify_pattern("t", 4, kv_pattern("s", 4, 10, 16), 16) > 100  # wrong session
    with pytest.raises(ValueError):
        verify_pattern("s", 4, d[:-1], 16)


# --- byte ranges for NIXL -------------------------------------------------------------------------
def _expand(rows):
    """Rows (addr, len, 0) -> flat list of byte addresses, for comparing pairings."""
    return np.concatenate([np.arange(a, a + n, dtype=np.uint64) for a, n, _ in rows]) if len(rows) else []


def test_pair_ranges_different_block_sizes_and_coalescing():
    bpt = 3
    la = PoolLayout(base_addr=1000, num_blocks=10, block_tokens=4, bytes_per_token=bpt)
    ra = PoolLayout(base_addr=50000, num_blocks=10, block_tokens=6, bytes_per_token=bpt)
    local = [Segment(2, 1, 3), Segment(3, 0, 4), Segment(7, 0, 2), Segment(0, 0, 0)]
    remote = [Segment(5, 2, 4), Segment(1, 0, 5)]
    lrows, rrows = pair_ranges(la, local, ra, remote)
    assert lrows.shape == rrows.shape and lrows.shape[1] == 3
    assert np.array_equal(lrows[:, 1], rrows[:, 1])
    assert int(lrows[:, 1].sum()) == 9 * bpt

    # byte-by-byte pairing matches a naive walk
    def naive(layout, segs):
        out = []
        for s in segs:
            for p in range(s.offset, s.offset + s.tokens):
                start = layout.base_addr + (s.block * layout.block_tokens + p) * bpt
                out.extend(range(start, start + bpt))
        return np.array(out, dtype=np.uint64)

    assert np.array_equal(_expand(lrows), naive(la, local))
    assert np.array_equal(_expand(rrows), naive(ra, remote))
    # local blocks 2 and 3 are adjacent: (2,1,3)+(3,0,4) is one local run, split by the remote
    # boundary after 4 tokens, so 3 descriptors: [4 tok], [3 tok], [2 tok]
    assert lrows[:, 1].tolist() == [12, 9, 6]


def test_pair_ranges_fully_contiguous_is_one_descriptor():
    la = PoolLayout(0, 8, 4, 2)
    ra = PoolLayout(4096, 8, 8, 2)
    lrows, rrows = pair_ranges(la, [Segment(1, 2, 2), Segment(2, 0, 4), Segment(3, 0, 1)],
                               ra, [Segment(0, 5, 3), Segment(1, 0, 4)])
    assert lrows.tolist() == [[(1 * 4 + 2) * 2, 14, 0]]
    assert rrows.tolist() == [[4096 + 5 * 2, 14, 0]]


def test_pair_ranges_errors_and_empty():
    la = PoolLayout(0, 4, 4, 2)
    lrows, rrows = pair_ranges(la, [], la, [Segment(0, 0, 0)])
    assert lrows.shape == (0, 3) and rrows.shape == (0, 3)
    with pytest.raises(ValueError, match="cover"):
        pair_ranges(la, [Segment(0, 0, 2)], la, [Segment(0, 0, 3)])
    with pytest.raises(ValueError, match="outside"):
        pair_ranges(la, [Segment(0, 3, 2)], la, [Segment(0, 0, 2)])
    with pytest.raises(ValueError, match="bytes_per_token"):
        pair_ranges(la, [Segment(0, 0, 1)], PoolLayout(0, 4, 4, 3), [Segment(0, 0, 1)])


def test_freed_blocks_come_back_in_ascending_runs():
    # a session's blocks in ascending order make few NIXL descriptors (pair_ranges merges runs)
    pool = KVPool(8, 2, 8)
    a = pool.alloc(5)
    assert a == [0, 1, 2, 3, 4]
    pool.free(a)
    assert pool.alloc(5) == [0, 1, 2, 3, 4]


def test_pattern_cache_matches_kv_pattern_and_stays_bounded():
    cache = PatternCache(max_bytes=3 * 100 * 24)
    for n in (5, 40, 40, 17, 100):  # grows, repeats, shrinks
        assert np.array_equal(cache.prefix("s", n, 24), kv_pattern("s", 0, n, 24))
    data = kv_pattern("s", 0, 60, 24).copy()
    assert cache.verify("s", data, 24) == 0
    data[100] ^= 1
    data[-1] ^= 0xFF
    assert cache.verify("s", data, 24) == verify_pattern("s", 0, data, 24) == 2
    for i in range(10):  # least recently used out: never over the bound
        cache.prefix(f"t{i}", 100, 24)
        assert cache._bytes <= cache.max_bytes
    assert np.array_equal(cache.prefix("s", 100, 24), kv_pattern("s", 0, 100, 24))  # computed again
    assert np.array_equal(cache.prefix("big", 1000, 24), kv_pattern("big", 0, 1000, 24))  # over it: not kept
    with pytest.raises(ValueError, match="multiple"):
        cache.verify("s", data[:-1], 24)


def test_pair_ranges_python_walk_matches_numpy_path(monkeypatch):
    import random

    import ampd.kv.ranges as ranges

    rng = random.Random(3)
    la = PoolLayout(base_addr=1 << 40, num_blocks=64, block_tokens=8, bytes_per_token=5)
    ra = PoolLayout(base_addr=1 << 41, num_blocks=64, block_tokens=12, bytes_per_token=5)

    def segs(layout, total):
        blocks = list(range(layout.num_blocks))
        rng.shuffle(blocks)
        if rng.random() < 0.5:
            blocks.sort()  # ascending runs: coalescing
        out, left = [], total
        for b in blocks:
            if not left:
                break
            off = rng.randrange(layout.block_tokens) if rng.random() < 0.3 else 0
            n = 0 if rng.random() < 0.05 else min(left, rng.randint(1, layout.block_tokens - off))
            out.append(Segment(b, off, n))
            left -= n
        assert not left
        return out

    for total in [0, 1, 7, 8, 30, 100, 150]:
        for _ in range(20):
            local, remote = segs(la, total), segs(ra, total)
            fast = pair_ranges(la, local, ra, remote)
            monkeypatch.setattr(ranges, "PY_BELOW", -1)
            slow = pair_ranges(la, local, ra, remote)
            monkeypatch.undo()
            assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(fast, slow))
    for py_below in (512, -1):  # both paths raise the same errors
        monkeypatch.setattr(ranges, "PY_BELOW", py_below)
        with pytest.raises(ValueError, match=r"^local segments cover 3 tokens, remote 2$"):
            pair_ranges(la, [Segment(0, 0, 3)], ra, [Segment(0, 0, 2)])
        with pytest.raises(ValueError, match=r"^remote segment 1 .* outside layout"):
            pair_ranges(la, [Segment(0, 0, 3)], ra, [Segment(0, 0, 2), Segment(64, 0, 1)])


def test_pattern_cache_pattern_slices_and_big_ranges():
    cache = PatternCache(max_bytes=50 * 16)
    assert np.array_equal(cache.pattern("s", 10, 20, 16), kv_pattern("s", 10, 20, 16))
    assert cache._bytes == 30 * 16  # kept with the positions before it
    assert np.array_equal(cache.pattern("s", 25, 10, 16), kv_pattern("s", 25, 10, 16))
    assert cache._bytes == 50 * 16  # grown by doubling, within the bound
    first = cache.prefix("s", 30, 16).copy()
    assert np.array_equal(cache.pattern("s", 40, 20, 16), kv_pattern("s", 40, 20, 16))  # over the bound
    assert np.array_equal(cache.prefix("s", 30, 16), first) and cache._bytes <= cache.max_bytes
