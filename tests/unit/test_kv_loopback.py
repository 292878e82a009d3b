"""The KVTransport protocol's contract, on the loopback transport (ampd.kv.loopback): real byte copies
between two pools of this process, with the checks NIXL makes. tests/integration/test_nixl_transport.py
holds the same contract for NixlTransport; the notification listener's polling is tested here."""
from __future__ import annotations

import asyncio
import inspect
import random

import numpy as np
import pytest

from ampd.kv import KVPool, PoolLayout, Segment, SessionKV, kv_pattern, segments_tokens, verify_pattern
from ampd.kv.loopback import LoopbackHub, LoopbackTransport
from ampd.kv.protocol import KVTransferError, KVTransport
from tests.kv_helpers import scatter, until

BPT = 48  # bytes per token on both sides (not a multiple of 8 on purpose)


@pytest.fixture
def hub():
    return LoopbackHub()


@pytest.fixture
def pair(hub):
    """Two transports: a (12-token blocks) and b (5-token blocks), peered both ways."""
    pa, pb = KVPool(40, 12, BPT), KVPool(500, 5, BPT)
    scatter(pa, random.Random(3))
    scatter(pb, random.Random(4))
    a, b = LoopbackTransport("a", pa, hub=hub), LoopbackTransport("b", pb, hub=hub)
    a.add_peer("b", b.metadata(), b.layout)
    b.add_peer("a", a.metadata(), a.layout)
    yield a, b
    a.close()
    b.close()


def test_both_transports_implement_every_call_of_the_protocol():
    transport = pytest.importorskip("ampd.kv.transport")  # NIXL's Python package
    calls = {n for n, v in vars(KVTransport).items() if not n.startswith("_") and callable(v)}
    # the calls the protocol writes out itself, on top of poll_notifs and close
    shared = {"listen", "watch_notifs", "aclose", "counters"}
    for cls in (LoopbackTransport, transport.NixlTransport):
        assert KVTransport in cls.__mro__
        missing = [n for n in sorted(calls - shared) if getattr(cls, n) is getattr(KVTransport, n)]
        assert missing == [], f"{cls.__name__} leaves {missing} to the protocol's stubs"
        for n in calls - shared:
            ours, theirs = inspect.signature(getattr(cls, n)), inspect.signature(getattr(KVTransport, n))
            assert list(ours.parameters) == list(theirs.parameters), (cls.__name__, n)
    assert transport.KVTransferError is KVTransferError
    assert transport.NotifListener is not None


async def test_read_and_write_copy_the_bytes_between_different_block_sizes(pair):
    a, b = pair
    sa, sb = SessionKV(), SessionKV()
    for n in (7, 30, 2):  # a holds 39 tokens
        segs = sa.reserve(a.pool, n)
        a.pool.write(segs, kv_pattern("x", sa.tokens, n, BPT))
        sa.commit(n)
    # b reads a's history starting mid-block into its own (different) blocks
    local = sb.reserve(b.pool, 30)
    n = await b.read("a", sa.segments(9, 30), local)
    assert n == 30 * BPT and b.bytes_read == n and b.transfers == 1
    assert verify_pattern("x", 9, b.pool.read(local), BPT) == 0
    sb.commit(30)
    # b writes positions 39..60 of a's session into a's reservation, with a notification after the data
    new_a = sa.reserve(a.pool, 21)
    src = sb.reserve(b.pool, 21)
    b.pool.write(src, kv_pattern("x", 39, 21, BPT))
    assert await b.write("a", src, new_a, b"x:1") == 21 * BPT and b.bytes_written == 21 * BPT
    assert a.poll_notifs() == [("b", b"x:1")]
    assert verify_pattern("x", 39, a.pool.read(new_a), BPT) == 0
    assert a.poll_notifs() == []  # a poll with nothing pending returns at once
    assert b.counters() == {"bytes_read": 30 * BPT, "bytes_written": 21 * BPT, "transfers": 2, "notifs_sent": 0}


async def test_many_scattered_segments(pair):
    a, b = pair
    rng = random.Random(5)
    remote = []
    for _ in range(1000):
        blk = rng.randrange(a.pool.num_blocks)
        t = rng.randint(1, 3)
        remote.append(Segment(blk, rng.randrange(a.pool.block_tokens - t + 1), t))
    total = segments_tokens(remote)
    a.pool.buffer[:] = np.frombuffer(kv_pattern("big", 0, a.pool.capacity_tokens, BPT).tobytes(), dtype=np.uint8)
    local = SessionKV().reserve(b.pool, total)
    assert await b.read("a", remote, local) == total * BPT
    expect = np.concatenate([kv_pattern("big", s.block * a.pool.block_tokens + s.offset, s.tokens, BPT)
                             for s in remote])
    assert np.array_equal(b.pool.read(local), expect)


async def test_zero_tokens_unknown_peer_and_bad_segments(pair):
    a, b = pair
    assert await b.read("a", [], []) == 0
    assert await b.read("a", [Segment(0, 0, 0)], []) == 0
    assert b.transfers == 0
    with pytest.raises(KVTransferError, match="nobody"):
        await b.read("nobody", [Segment(0, 0, 1)], [Segment(0, 0, 1)])
    with pytest.raises(KVTransferError, match="nobody"):
        await b.write("nobody", [Segment(0, 0, 1)], [Segment(0, 0, 1)], b"n")
    with pytest.raises(ValueError, match="cover"):
        await b.read("a", [Segment(0, 0, 2)], [Segment(0, 0, 1)])
    with pytest.raises(ValueError, match="outside"):
        await b.read("a", [Segment(40, 0, 1)], [Segment(0, 0, 1)])
    assert b.has_peer("a") and not b.has_peer("nobody") and b.peers() == ["a"]
    b.remove_peer("a")
    b.remove_peer("a")  # idempotent
    assert not b.has_peer("a")
    with pytest.raises(KVTransferError, match="'a'"):
        await b.read("a", [Segment(0, 0, 1)], [Segment(0, 0, 1)])


async def test_zero_token_write_still_sends_its_notif(pair):
    a, b = pair
    assert await b.write("a", [], [], b"empty") == 0
    assert a.poll_notifs() == [("b", b"empty")] and b.notifs_sent == 1 and b.transfers == 0


async def test_add_peer_is_checked_and_a_restarted_peer_replaces_the_old(pair, hub):
    a, b = pair
    b.add_peer("a", a.metadata(), a.layout.to_dict())  # same metadata (a layout as published): no-op
    assert b.has_peer("a") and b.peer_layout("a") == a.layout
    with pytest.raises(KVTransferError, match="belongs to"):
        b.add_peer("someone-else", a.metadata(), a.layout)
    with pytest.raises(KVTransferError, match="no open loopback transport"):
        b.add_peer("x", b"garbage", a.layout)
    # a "restarts": a new transport with the same name and a new pool; the old metadata is dead
    a.close()
    with pytest.raises(KVTransferError, match="gone"):
        await b.read("a", [Segment(0, 0, 1)], [Segment(0, 0, 1)])
    pa2 = KVPool(8, 4, BPT)
    a2 = LoopbackTransport("a", pa2, hub=hub)
    try:
        b.add_peer("a", a2.metadata(), a2.layout)
        a2.add_peer("b", b.metadata(), b.layout)
        segs = [Segment(3, 1, 3), Segment(6, 0, 4)]
        pa2.write(segs, kv_pattern("r", 0, 7, BPT))
        local = SessionKV().reserve(b.pool, 7)
        assert await b.read("a", segs, local) == 7 * BPT
        assert verify_pattern("r", 0, b.pool.read(local), BPT) == 0
        await b.write("a", local, [Segment(0, 0, 4), Segment(1, 0, 3)], b"again")
        assert a2.poll_notifs() == [("b", b"again")]
        assert verify_pattern("r", 0, pa2.read([Segment(0, 0, 4), Segment(1, 0, 3)]), BPT) == 0
    finally:
        a2.close()


async def test_a_layout_that_is_not_the_peers_pool_is_refused(pair):
    a, b = pair
    lay = a.layout
    wrong = PoolLayout(lay.base_addr + lay.nbytes, lay.num_blocks, lay.block_tokens, lay.bytes_per_token)
    b.add_peer("a", a.metadata(), wrong)  # a stale layout: the metadata is a's, the addresses are not
    before = b.pool.buffer.copy()
    with pytest.raises(KVTransferError, match="outside its registered pool"):
        await b.read("a", [Segment(0, 0, 1)], [Segment(0, 0, 1)])
    assert np.array_equal(b.pool.buffer, before) and b.transfers == 0


async def test_closed_transport_refuses(pair):
    a, b = pair
    b.close()
    b.close()
    assert b.closed and b.poll_notifs() == []
    with pytest.raises(KVTransferError, match="closed"):
        await b.read("a", [Segment(0, 0, 1)], [Segment(0, 0, 1)])
    with pytest.raises(KVTransferError, match="closed"):
        b.listen(lambda p, m: None, pending=lambda: False)
    await b.aclose()  # idempotent too


async def test_watch_notifs_callback(pair):
    a, b = pair
    got: list[tuple[str, bytes]] = []
    task = asyncio.create_task(a.watch_notifs(lambda p, m: got.append((p, m))))
    try:
        await b.send_notif("a", b"one")
        await b.write("a", [Segment(0, 0, 2)], [Segment(0, 0, 2)], b"two")
        await until(lambda: len(got) == 2, what="callbacks")
        assert sorted(got) == [("b", b"one"), ("b", b"two")]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_notif_listener_polls_only_while_pending(pair):
    a, b = pair
    got: list[tuple[str, bytes]] = []
    expected = {"n"}
    listener = a.listen(lambda p, m: (got.append((p, m)), expected.discard(m.decode())), pending=lambda: bool(expected))
    try:
        listener.arm()
        await b.write("a", [Segment(0, 0, 2)], [Segment(0, 0, 2)], b"n")
        await until(lambda: got, what="callback")
        assert got == [("b", b"n")]
        await asyncio.sleep(0.05)  # nothing pending: the listener goes quiet
        polls = listener.polls
        await asyncio.sleep(0.1)
        assert listener.polls == polls
        # a notification that lands while nobody waits is delivered at the next arm()
        await b.send_notif("a", b"late")
        await asyncio.sleep(0.05)
        assert len(got) == 1
        expected.add("late")
        listener.arm()
        await until(lambda: len(got) == 2, what="late callback")
        assert got[1] == ("b", b"late")
    finally:
        await listener.stop()


async def test_a_failing_callback_does_not_stop_the_listener(pair):
    a, b = pair
    got = []

    def callback(peer, msg):
        got.append(msg)
        if msg == b"bad":
            raise RuntimeError("one bad notification")
    listener = a.listen(callback, pending=lambda: len(got) < 2)
    try:
        listener.arm()
        await b.send_notif("a", b"bad")
        await b.send_notif("a", b"good")
        await until(lambda: len(got) == 2, what="both callbacks")
        assert got == [b"bad", b"good"]
    finally:
        await listener.stop()
    assert listener._task.done()


def test_hubs_are_separate_and_a_closed_transport_leaves_its_hub():
    h1, h2 = LoopbackHub(), LoopbackHub()
    a = LoopbackTransport("a", KVPool(2, 4, BPT), hub=h1)
    b = LoopbackTransport("b", KVPool(2, 4, BPT), hub=h2)
    with pytest.raises(KVTransferError, match="no open loopback transport"):
        b.add_peer("a", a.metadata(), a.layout)
    assert h1.find(a.metadata()) is a
    with a:
        pass
    assert a.closed and h1.find(a.metadata()) is None
    b.close()
