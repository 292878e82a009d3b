"""The host KV tier's accounting (ampd.kv.hostpool): states, moves, the start-up size check, no leaks."""

import pytest

from ampd.kv.hostpool import (
    MIB,
    HostKVExhausted,
    HostPool,
    HostPoolTooSmall,
    KVState,
    check_host_pool,
    host_pool_blocks,
)
from ampd.kv.pool import Segment


def test_capacity_from_mb():
    # 256-token blocks of 327680 bytes a token (llama3.1-70b) are 80 MiB each: 1000 MiB holds 12
    assert host_pool_blocks(1000, 256, 327680) == 12
    assert check_host_pool(1000, 256, 327680, 3072) == 12
    assert check_host_pool(0, 256, 327680, 1 << 20) == 0  # off
    pool = HostPool.from_mb(1, 16, 128, 512)  # 1 MiB of 2 KiB blocks
    assert (pool.num_blocks, pool.free_blocks, pool.used_blocks) == (512, 512, 0)


def test_pool_too_small_for_one_session_is_refused_with_the_sizes():
    with pytest.raises(HostPoolTooSmall) as exc:
        check_host_pool(1000, 256, 327680, 8192)
    msg = str(exc.value)
    for part in ("--kv-host-mb 1000", "12 host blocks of 256 tokens", "83886080 bytes each", "3072 tokens",
                 "8192 tokens (32 blocks, 2560 MiB)", "at least 2560"):
        assert part in msg, (part, msg)
    assert check_host_pool(2560, 256, 327680, 8192) == 32
    with pytest.raises(HostPoolTooSmall, match="must be >= 0"):
        check_host_pool(-1, 256, 128, 1)


def test_offload_and_prefetch_round_trip():
    pool = HostPool(10, 16, bytes_per_token=100)
    assert pool.state("s") is KVState.RESIDENT
    pool.offload_begin("s", 40)  # 3 blocks: 16 + 16 + 8
    segs = pool.segments("s")
    assert segs == [Segment(0, 0, 16), Segment(1, 0, 16), Segment(2, 0, 8)]
    assert (pool.state("s"), pool.moving("s"), pool.free_blocks) == (KVState.RESIDENT, "offload", 7)
    pool.offload_done("s")
    assert (pool.state("s"), pool.moving("s"), pool.host_blocks("s")) == (KVState.HOST, "", 3)
    pool.prefetch_begin("s")
    assert pool.segments("s") == segs
    pool.prefetch_done("s")
    assert (pool.state("s"), pool.free_blocks) == (KVState.RESIDENT, 10)
    assert (pool.bytes_to_host, pool.bytes_from_host) == (4000, 4000)
    pool.release("s")
    assert pool.empty


def test_moves_without_segments_keep_the_same_accounting():
    # the decode core's tier moves no bytes: beginning a move builds no segment; the accounting is the same
    pool = HostPool(10, 16)
    assert pool.offload_begin("s", 40) is None
    assert (pool.state("s"), pool.moving("s"), pool.free_blocks) == (KVState.RESIDENT, "offload", 7)
    pool.offload_done("s")
    assert pool.prefetch_begin("s") is None
    assert pool.moving("s") == "prefetch"
    assert pool.segments("s") == [Segment(0, 0, 16), Segment(1, 0, 16), Segment(2, 0, 8)]
    pool.prefetch_done("s")
    assert (pool.state("s"), pool.free_blocks, pool.tokens_to_host, pool.tokens_from_host) == (
        KVState.RESIDENT, 10, 40, 40)


def test_failures_never_lose_the_session():
    pool = HostPool(4, 16)
    pool.offload_begin("a", 20)
    pool.offload_failed("a")  # the device copy is intact
    assert (pool.state("a"), pool.free_blocks) == (KVState.RESIDENT, 4)
    pool.offload_begin("a", 20)
    pool.offload_done("a")
    pool.prefetch_begin("a")
    pool.prefetch_failed("a")  # a transfer error: re-prefill from the session's tokens
    assert (pool.state("a"), pool.free_blocks) == (KVState.GONE, 4)
    pool.reprefilled("a")
    assert pool.state("a") is KVState.RESIDENT
    assert pool.tokens_from_host == 0
    pool.release("a")
    assert pool.empty


def test_exhausted_is_all_or_nothing():
    pool = HostPool(2, 16)
    with pytest.raises(HostKVExhausted, match="needed 3 blocks, 2 free"):
        pool.offload_begin("a", 33)
    assert pool.empty  # nothing reserved, nothing tracked
    pool.offload_begin("b", 32)
    with pytest.raises(HostKVExhausted):
        pool.offload_begin("c", 1)
    pool.release("b")  # a move in flight is abandoned
    assert pool.empty


def test_drop_and_illegal_moves():
    pool = HostPool(4, 16)
    pool.offload_begin("a", 16)
    with pytest.raises(ValueError, match="moving"):
        pool.drop("a")
    with pytest.raises(ValueError, match="offload in flight"):
        pool.offload_begin("a", 16)
    with pytest.raises(ValueError, match="no prefetch in flight"):
        pool.prefetch_done("a")
    pool.offload_done("a")
    with pytest.raises(ValueError, match="its KV is host, not resident"):
        pool.offload_begin("a", 16)
    pool.drop("a")
    assert (pool.state("a"), pool.free_blocks) == (KVState.GONE, 4)
    with pytest.raises(ValueError, match="gone, not host"):
        pool.prefetch_begin("a")
    with pytest.raises(KeyError):
        pool.prefetch_begin("nobody")
    with pytest.raises(ValueError, match="tokens must be > 0"):
        pool.offload_begin("z", 0)
    pool.drop("b")  # a resident session dropped straight away
    assert pool.state("b") is KVState.GONE
    for s in ("a", "b"):
        pool.release(s)
    assert pool.empty


def test_no_leak_over_many_sessions():
    pool = HostPool(64, 16)
    live: list[str] = []
    for i in range(200):
        sid = f"s{i}"
        try:
            pool.offload_begin(sid, 1 + (i * 37) % 100)
        except HostKVExhausted:
            victim = live.pop(0)
            pool.drop(victim)
            pool.release(victim)
            continue
        live.append(sid)
        if i % 3 == 0:
            pool.offload_failed(sid)
        else:
            pool.offload_done(sid)
            if i % 3 == 1:
                pool.prefetch_begin(sid)
                (pool.prefetch_done if i % 2 else pool.prefetch_failed)(sid)
        assert pool.free_blocks + sum(pool.host_blocks(s) for s in live) == 64
    for sid in live:
        pool.release(sid)
    assert pool.empty
    assert MIB == 1 << 20
