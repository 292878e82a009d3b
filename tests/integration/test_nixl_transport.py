"""NixlTransport between two agents in one process, and between two real processes.

The two-process test runs this file as a script (`python test_nixl_transport.py peer ...`) for the
second process; the pytest process is the first. They talk JSON lines over stdin/stdout.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as the peer process
    sys.path.insert(0, str(REPO))

from ampd.kv import (  # noqa: E402
    KVPool,
    PoolLayout,
    Segment,
    SessionKV,
    kv_pattern,
    segments_tokens,
    verify_pattern,
)

nixl = pytest.importorskip("nixl._api") if __name__ != "__main__" else None
from ampd.kv.transport import KVTransferError, NixlTransport  # noqa: E402
from tests.kv_helpers import scatter, until  # noqa: E402

BPT = 48  # bytes per token on both sides (not a multiple of 8 on purpose)
MSG = "@@"  # protocol lines start with this; anything else on stdout (UCX chatter) is ignored


def _segs_to_json(segs):
    return [s.to_list() for s in segs]


def _segs_from_json(v):
    return [Segment.from_list(x) for x in v]


# ------------------------------------------------------------------------------------------------
# peer process
# ------------------------------------------------------------------------------------------------
def _emit(obj) -> None:
    sys.stdout.write(MSG + json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _peer_main(name: str, num_blocks: int, block_tokens: int) -> None:
    pool = KVPool(num_blocks, block_tokens, BPT)
    scatter(pool, random.Random(7))
    tr = NixlTransport(name, pool)
    _emit({"name": name, "md": base64.b64encode(tr.metadata()).decode(), "layout": tr.layout.to_dict()})
    sessions: dict[str, SessionKV] = {}
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "add_peer":
                tr.add_peer(cmd["name"], base64.b64decode(cmd["md"]), PoolLayout.from_dict(cmd["layout"]))
                _emit({"ok": True})
            elif op == "pull":  # READ a session's history from the peer, verify every byte
                s = sessions.setdefault(cmd["session"], SessionKV())
                remote = _segs_from_json(cmd["segments"])
                local = s.reserve(pool, segments_tokens(remote))
                n = await tr.read(cmd["peer"], remote, local)
                s.commit(segments_tokens(remote))
                data = pool.read(s.segments(0, s.tokens))
                _emit({"ok": True, "bytes": n, "mismatches": verify_pattern(cmd["session"], 0, data, BPT),
                       "local_segments": len(local)})
            elif op == "push":  # compute new KV locally, WRITE it into the peer's reserved segments
                s = sessions[cmd["session"]]
                start, tokens = cmd["start"], cmd["tokens"]
                assert start == s.tokens
                local = s.reserve(pool, tokens)
                pool.write(local, kv_pattern(cmd["session"], start, tokens, BPT))
                s.commit(tokens)
                n = await tr.write(cmd["peer"], local, _segs_from_json(cmd["segments"]), cmd["notif"].encode())
                _emit({"ok": True, "bytes": n, "session_segments": _segs_to_json(s.segments(0, s.tokens))})
            elif op == "notif":
                await tr.send_notif(cmd["peer"], cmd["notif"].encode())
                _emit({"ok": True})
            elif op == "notifs":
                got = await until(tr.poll_notifs, what="notification")
                _emit({"ok": True, "notifs": [[p, m.decode()] for p, m in got]})
            elif op == "quit":
                _emit({"ok": True, "counters": tr.counters()})
                break
            else:
                _emit({"ok": False, "error": f"unknown op {op}"})
        except Exception as e:  # report, keep serving
            _emit({"ok": False, "error": repr(e)})
    tr.close()


class PeerProcess:
    """The other process, driven over pipes."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, name: str, num_blocks: int, block_tokens: int) -> "PeerProcess":
        env = dict(os.environ, PYTHONPATH=str(REPO), NIXL_LOG_LEVEL="WARN")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "peer", name, str(num_blocks), str(block_tokens),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, cwd=str(REPO),
        )
        return cls(proc)

    async def recv(self, timeout_s: float = 30.0) -> dict:
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
            if not line:
                raise AssertionError(f"peer process exited (rc={await self.proc.wait()})")
            text = line.decode(errors="replace")
            if text.startswith(MSG):
                return json.loads(text[len(MSG):])

    async def call(self, **cmd) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        reply = await self.recv()
        assert reply.get("ok"), reply
        return reply

    async def stop(self) -> None:
        try:
            if not self.proc.stdin.is_closing():
                self.proc.stdin.close()  # the peer exits at end of input
            await asyncio.wait_for(self.proc.wait(), 10)
        except (asyncio.TimeoutError, OSError):
            if self.proc.returncode is None:
                self.proc.kill()
            await self.proc.wait()


# ------------------------------------------------------------------------------------------------
# two processes
# ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
async def test_two_processes_read_history_and_write_new_kv_with_notif():
    session = "sess-42"
    # A: the decode worker owning the session's KV, 16-token blocks, scattered
    pool_a = KVPool(num_blocks=64, block_tokens=16, bytes_per_token=BPT)
    scatter(pool_a, random.Random(1))
    tr_a = NixlTransport("dec-a", pool_a)
    peer = await PeerProcess.start("pre-b", num_blocks=128, block_tokens=8)  # B: prefill worker
    try:
        hello = await peer.recv()
        assert hello["name"] == "pre-b"
        tr_a.add_peer("pre-b", base64.b64decode(hello["md"]), PoolLayout.from_dict(hello["layout"]))
        await peer.call(op="add_peer", name="dec-a", md=base64.b64encode(tr_a.metadata()).decode(),
                        layout=tr_a.layout.to_dict())

        # history written over several rounds: 37 + 50 + 1 + 15 = 103 tokens, ends in a partial block
        s = SessionKV()
        for n in (37, 50, 1, 15):
            segs = s.reserve(pool_a, n)
            pool_a.write(segs, kv_pattern(session, s.tokens, n, BPT))
            s.commit(n)
        hist = s.segments(0, s.tokens)
        assert len(hist) >= 7  # scattered blocks, partial last block

        # B READs the history from A and checks every byte
        r = await peer.call(op="pull", peer="dec-a", session=session, segments=_segs_to_json(hist))
        assert r["bytes"] == 103 * BPT
        assert r["mismatches"] == 0

        # A reserves the next round's positions (fills A's partial block first); B WRITEs them
        new = s.reserve(pool_a, 29)
        assert new[0].offset == 103 % 16
        r = await peer.call(op="push", peer="dec-a", session=session, start=103, tokens=29,
                            segments=_segs_to_json(new), notif=f"{session}:1:777")
        assert r["bytes"] == 29 * BPT
        got = await until(tr_a.poll_notifs, what="write notification")
        assert got == [("pre-b", f"{session}:1:777".encode())]
        assert verify_pattern(session, 103, pool_a.read(new), BPT) == 0
        s.commit(29)
        assert verify_pattern(session, 0, pool_a.read(s.segments(0, s.tokens)), BPT) == 0

        # A READs back from B too (B's session now holds all 132 tokens in 8-token blocks): not
        # needed by the protocol but proves reads work in the other direction with B's layout.
        back = SessionKV().reserve(pool_a, 132)
        assert await tr_a.read("pre-b", _segs_from_json(r["session_segments"]), back) == 132 * BPT
        assert verify_pattern(session, 0, pool_a.read(back), BPT) == 0
        pool_a.free({x.block for x in back})

        # Standalone notifications both ways.
        await peer.call(op="notif", peer="dec-a", notif="ping")
        assert await until(tr_a.poll_notifs, what="ping") == [("pre-b", b"ping")]
        await tr_a.send_notif("pre-b", b"pong")
        r = await peer.call(op="notifs")
        assert r["notifs"] == [["dec-a", "pong"]]

        r = await peer.call(op="quit")
        assert r["counters"]["bytes_read"] == 103 * BPT
        assert r["counters"]["bytes_written"] == 29 * BPT
        assert r["counters"]["transfers"] == 2
        s.release(pool_a)
        assert pool_a.free_blocks == 64
    finally:
        await peer.stop()
        tr_a.close()


# ------------------------------------------------------------------------------------------------
# one process, two agents
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def pair():
    """Two transports in this process: a (12-token blocks) and b (5-token blocks), peered both ways."""
    pa = KVPool(40, 12, BPT)
    pb = KVPool(500, 5, BPT)
    scatter(pa, random.Random(3))
    scatter(pb, random.Random(4))
    a = NixlTransport("inproc-a", pa)
    b = NixlTransport("inproc-b", pb)
    a.add_peer("inproc-b", b.metadata(), b.layout)
    b.add_peer("inproc-a", a.metadata(), a.layout)
    yield a, b
    a.close()
    b.close()


@pytest.mark.timeout(60)
async def test_in_process_read_write_roundtrip(pair):
    a, b = pair
    sa, sb = SessionKV(), SessionKV()
    for n in (7, 30, 2):  # a holds 39 tokens
        segs = sa.reserve(a.pool, n)
        a.pool.write(segs, kv_pattern("x", sa.tokens, n, BPT))
        sa.commit(n)
    # b reads a's history starting mid-block into its own (different) blocks
    local = sb.reserve(b.pool, 30)
    n = await b.read("inproc-a", sa.segments(9, 30), local)
    assert n == 30 * BPT and b.bytes_read == n and b.transfers == 1
    assert verify_pattern("x", 9, b.pool.read(local), BPT) == 0
    sb.commit(30)
    # b writes positions 39..60 of a's session into a's reservation, with a notification
    new_a = sa.reserve(a.pool, 21)
    src = sb.reserve(b.pool, 21)
    b.pool.write(src, kv_pattern("x", 39, 21, BPT))
    n = await b.write("inproc-a", src, new_a, b"x:1")
    assert n == 21 * BPT and b.bytes_written == n
    assert await until(a.poll_notifs, what="notif") == [("inproc-b", b"x:1")]
    assert verify_pattern("x", 39, a.pool.read(new_a), BPT) == 0
    # a poll with nothing pending returns at once
    assert a.poll_notifs() == []


@pytest.mark.timeout(60)
async def test_in_process_many_scattered_segments(pair):
    a, b = pair
    rng = random.Random(5)
    # 1000 one-to-three-token segments scattered over a's blocks vs a contiguous-ish run on b
    remote = []
    for _ in range(1000):
        blk = rng.randrange(a.pool.num_blocks)
        t = rng.randint(1, 3)
        off = rng.randrange(a.pool.block_tokens - t + 1)
        remote.append(Segment(blk, off, t))
    total = segments_tokens(remote)
    a.pool.buffer[:] = np.frombuffer(
        kv_pattern("big", 0, a.pool.capacity_tokens, BPT).tobytes(), dtype=np.uint8
    )
    local = SessionKV().reserve(b.pool, total)
    assert await b.read("inproc-a", remote, local) == total * BPT
    expect = np.concatenate([
        kv_pattern("big", s.block * a.pool.block_tokens + s.offset, s.tokens, BPT) for s in remote
    ])
    assert np.array_equal(b.pool.read(local), expect)


@pytest.mark.timeout(60)
async def test_zero_tokens_unknown_peer_and_bad_segments(pair):
    a, b = pair
    assert await b.read("inproc-a", [], []) == 0
    assert await b.read("inproc-a", [Segment(0, 0, 0)], []) == 0
    assert b.transfers == 0
    with pytest.raises(KVTransferError, match="nobody"):
        await b.read("nobody", [Segment(0, 0, 1)], [Segment(0, 0, 1)])
    with pytest.raises(KVTransferError, match="nobody"):
        await b.write("nobody", [Segment(0, 0, 1)], [Segment(0, 0, 1)], b"n")
    with pytest.raises(ValueError, match="cover"):
        await b.read("inproc-a", [Segment(0, 0, 2)], [Segment(0, 0, 1)])
    with pytest.raises(ValueError, match="outside"):
        await b.read("inproc-a", [Segment(40, 0, 1)], [Segment(0, 0, 1)])
    assert b.has_peer("inproc-a") and not b.has_peer("nobody")
    b.remove_peer("inproc-a")
    b.remove_peer("inproc-a")  # idempotent
    assert not b.has_peer("inproc-a")
    with pytest.raises(KVTransferError, match="inproc-a"):
        await b.read("inproc-a", [Segment(0, 0, 1)], [Segment(0, 0, 1)])


@pytest.mark.timeout(60)
async def test_add_peer_idempotent_and_restarted_peer(pair):
    a, b = pair
    b.add_peer("inproc-a", a.metadata(), a.layout)  # same metadata: no-op
    assert b.has_peer("inproc-a")
    with pytest.raises(KVTransferError, match="belongs to"):
        b.add_peer("someone-else", a.metadata(), a.layout)
    # a "restarts": a new agent with the same name and a new pool
    a.close()
    pa2 = KVPool(8, 4, BPT)
    a2 = NixlTransport("inproc-a", pa2)
    try:
        b.add_peer("inproc-a", a2.metadata(), a2.layout)
        a2.add_peer("inproc-b", b.metadata(), b.layout)
        segs = [Segment(3, 1, 3), Segment(6, 0, 4)]
        pa2.write(segs, kv_pattern("r", 0, 7, BPT))
        local = SessionKV().reserve(b.pool, 7)
        assert await b.read("inproc-a", segs, local) == 7 * BPT
        assert verify_pattern("r", 0, b.pool.read(local), BPT) == 0
        await b.write("inproc-a", local, [Segment(0, 0, 4), Segment(1, 0, 3)], b"again")
        assert await until(a2.poll_notifs, what="notif") == [("inproc-b", b"again")]
        assert verify_pattern("r", 0, pa2.read([Segment(0, 0, 4), Segment(1, 0, 3)]), BPT) == 0
    finally:
        a2.close()


@pytest.mark.timeout(60)
async def test_stuck_or_failed_transfer_raises_and_releases(pair, monkeypatch):
    a, b = pair
    released = []
    real_release = b.agent.release_xfer_handle
    monkeypatch.setattr(b.agent, "release_xfer_handle", lambda h: (released.append(h), real_release(h)))
    monkeypatch.setattr(b.agent, "transfer", lambda h, notif_msg=b"": "PROC")
    monkeypatch.setattr(b.agent, "check_xfer_state", lambda h: "PROC")
    with pytest.raises(KVTransferError, match=r"READ with peer 'inproc-a': timed out"):
        await b.read("inproc-a", [Segment(0, 0, 1)], [Segment(0, 0, 1)], timeout_s=0.02)
    monkeypatch.setattr(b.agent, "check_xfer_state", lambda h: "ERR")
    with pytest.raises(KVTransferError, match=r"WRITE with peer 'inproc-a': transfer state ERR"):
        await b.write("inproc-a", [Segment(0, 0, 1)], [Segment(0, 0, 1)], b"n")
    assert len(released) == 2
    assert b.transfers == 0 and b.bytes_read == 0 and b.bytes_written == 0


@pytest.mark.timeout(60)
async def test_closed_transport_refuses(pair):
    a, b = pair
    b.close()
    b.close()
    assert b.poll_notifs() == []
    with pytest.raises(KVTransferError, match="closed"):
        await b.read("inproc-a", [Segment(0, 0, 1)], [Segment(0, 0, 1)])


@pytest.mark.timeout(60)
async def test_watch_notifs_callback(pair):
    a, b = pair
    got: list[tuple[str, bytes]] = []
    task = asyncio.create_task(a.watch_notifs(lambda p, m: got.append((p, m))))
    try:
        await b.send_notif("inproc-a", b"one")
        await b.write("inproc-a", [Segment(0, 0, 2)], [Segment(0, 0, 2)], b"two")
        await until(lambda: len(got) == 2, what="callbacks")
        assert sorted(got) == [("inproc-b", b"one"), ("inproc-b", b"two")]
    finally:
        task.cancel()


@pytest.mark.timeout(60)
async def test_notif_listener_polls_only_while_pending(pair):
    a, b = pair
    got: list[tuple[str, bytes]] = []
    expected = {"n"}
    listener = a.listen(lambda p, m: (got.append((p, m)), expected.discard(m.decode())), pending=lambda: bool(expected))
    try:
        listener.arm()
        await b.write("inproc-a", [Segment(0, 0, 2)], [Segment(0, 0, 2)], b"n")
        await until(lambda: got, what="callback")
        assert got == [("inproc-b", b"n")]
        await asyncio.sleep(0.05)  # nothing pending: the listener goes quiet
        polls = listener.polls
        await asyncio.sleep(0.1)
        assert listener.polls == polls
        # a notification that lands while nobody waits is delivered at the next arm()
        await b.send_notif("inproc-a", b"late")
        await asyncio.sleep(0.05)
        assert len(got) == 1
        expected.add("late")
        listener.arm()
        await until(lambda: len(got) == 2, what="late callback")
        assert got[1] == ("inproc-b", b"late")
    finally:
        await listener.stop()


@pytest.mark.timeout(60)
async def test_aclose_cancels_and_awaits_the_warm_up_reads():
    """add_peer in a running loop warms the connection in a task the transport keeps; a removed
    peer's warm-up is kept until it ends, and aclose cancels and awaits every one before the pool
    is deregistered."""
    pa, pb, pc = KVPool(8, 4, BPT), KVPool(8, 4, BPT), KVPool(8, 4, BPT)
    a, b, c = NixlTransport("warm-a", pa), NixlTransport("warm-b", pb), NixlTransport("warm-c", pc)
    try:
        a.add_peer("warm-b", b.metadata(), b.layout)
        a.add_peer("warm-c", c.metadata(), c.layout)
        tasks = set(a._warming)
        assert len(tasks) == 2 and all(not t.done() for t in tasks)
        a.remove_peer("warm-c")  # cancelled, still owned until it has ended
        assert a._warming and not a.has_peer("warm-c")
        await a.aclose()
        assert a.closed and not a._warming and all(t.done() for t in tasks)
        await a.aclose()  # idempotent
    finally:
        for t in (a, b, c):
            t.close()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "peer":
    asyncio.run(_peer_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
