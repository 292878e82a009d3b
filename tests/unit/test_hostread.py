"""Remote prefill from the host copy, the decode worker's side (services/decode/hostread.py): a round
whose KV is on host claims its host copy as it starts (device blocks for history and input reserved
at once), its fetch back runs into the blocks reserved then and is CRC-checked, the round's first
token or local prefill waits for that fetch, a failed fetch starts the round again from its tokens
(the session is never lost), and the host blocks go only once both readers are done. Real pools and
real byte copies (the loopback transport); the tier and the worker are stand-ins holding what
HostReads reads of them. The wire side: history_on_host in the task's checks and its token."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from ampd.kv import KVPool, SessionKV
from ampd.kv.loopback import LoopbackHub, LoopbackTransport
from ampd.policy.types import KV_GONE
from ampd.trust import task_token
from ampd.v1 import common_pb2
from ampd.validate import InvalidArgument, TaskTarget, validate_prefill_task
from services.decode.hostread import HostReads, block_crcs, block_segments
from services.decode.hostcopy import HostCopy

BT, BPT, HIST, INCR = 4, 8, 10, 5


class Tier:
    """What HostReads reads of a LiveTier: its host pool and agent, copies, listed fetches, counters."""

    def __init__(self, device_blocks: int = 16) -> None:
        hub = LoopbackHub()
        dev, self.pool = KVPool(device_blocks, BT, BPT), KVPool(16, BT, BPT)
        self.name = "d0-host"
        self.transport = LoopbackTransport(self.name, self.pool, hub=hub)
        worker_agent = LoopbackTransport("d0", dev, hub=hub)
        worker_agent.add_peer(self.name, self.transport.metadata(), self.pool.layout)
        self.started, self.queued = [], []
        self.w = SimpleNamespace(rt=SimpleNamespace(pool=dev, transport=worker_agent, host_peer=None,
                                                    changed=lambda: None),
                                 remote=SimpleNamespace(held={}), start_round=self.started.append,
                                 queue_local=self.queued.append)
        self.copies, self.fetching, self.counts = {}, {}, {}

    def _count(self, key: str, n: float = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def offloaded(self, sid: str, tokens: int = HIST, start: int = 0, listed: int = HIST + 1) -> np.ndarray:
        """A host copy of ``tokens`` patterned tokens, its prefetch listed for ``listed`` tokens (the
        core's count: the history and the last output token)."""
        blocks = self.pool.alloc(self.pool.blocks_for(tokens))
        segs = block_segments(blocks, tokens, BT)
        data = (np.arange(tokens * BPT) % 251).astype(np.uint8)
        self.pool.write(segs, data)
        self.copies[sid] = HostCopy(blocks, tokens, block_crcs(self.pool.read(segs), self.pool.block_bytes), start)
        self.fetching[sid] = listed
        return data


def _session(sid: str = "s1") -> SimpleNamespace:
    return SimpleNamespace(session_id=sid, round=2, tokens=list(range(HIST + INCR)), kv=SessionKV(BT),
                           recompute=0, closed=False, where=None)


def test_a_claimed_round_is_fetched_into_its_blocks_and_its_host_copy_goes_after_both_readers():
    t = Tier()
    data = t.offloaded("s1")
    reads, s = HostReads(t), _session()
    assert t.w.rt.host_peer[0] == "d0-host"  # the host agent, registered with the worker
    assert reads.claim(s)
    r = reads.get(s)
    assert "s1" not in t.copies and "s1" not in t.fetching and t.counts["kv_tier_host_reads"] == 1
    # history and input reserved at once: positions [0, 10) for the fetch, [10, 15) for the new KV
    assert (r.l_hist, sum(x.tokens for x in r.hist), sum(x.tokens for x in r.dest)) == (HIST, HIST, INCR)
    assert t.w.rt.pool.free_blocks == 16 - 4 and s.kv.tokens == 0
    assert r.src == block_segments(t.copies.get("s1", r.copy).blocks, HIST, BT)
    reads.sent(r)  # the task goes out before the fetch ended
    assert t.counts["kv_tier_host_read_ahead"] == 1
    done = []
    assert reads.after_fetch(s, lambda: done.append(s.kv.tokens))  # its PrefillDone came first: it waits
    assert reads.local(s)  # so does a local run

    async def fetch():
        await reads.fetch(s, "result-arrived")
    asyncio.run(fetch())
    assert done == [HIST] and t.queued == [s]  # both ran once the history was on the device
    assert np.array_equal(t.w.rt.pool.read(r.hist), data)  # byte for byte
    assert t.counts["kv_tier_move_prefetch:result-arrived"] == 1
    assert t.counts["kv_tier_bytes_from_host"] == HIST * BPT
    assert not reads.after_fetch(s, lambda: None) and not reads.local(s) and not reads.redo(s)
    assert t.pool.free_blocks == 16 - 3  # the prefill worker may still read the host copy
    reads.remote_ended("s1", 2)
    assert t.pool.free_blocks == 16 and not reads.active


def test_a_failed_fetch_starts_the_round_again_from_its_tokens():
    t = Tier()
    t.offloaded("s1")
    reads, s = HostReads(t), _session()
    assert reads.claim(s)
    r = reads.get(s)
    t.pool.buffer[3] ^= 0xFF  # the host copy changed after its CRC was taken

    async def fetch():
        await reads.fetch(s, "result-arrived")
    asyncio.run(fetch())
    assert r.error == "mismatch" and t.counts["kv_tier_failed_prefetch:mismatch"] == 1
    assert "kv_tier_move_prefetch:result-arrived" not in t.counts
    reads.remote_ended("s1", 2)  # its prefill worker reported (the first token must not come from it)
    assert reads.redo(s)
    assert t.started == [s] and s.recompute == HIST and s.where[1].state == KV_GONE
    # The claim's blocks stay the session's (a prefill worker that went overdue may still write them),
    # and the round's reservation as it starts again keeps them instead of taking others.
    pool = t.w.rt.pool
    held = list(s.kv.blocks)
    assert s.kv.tokens == 0 and len(held) == 4 and pool.free_blocks == 12
    s.kv.reserve(pool, len(s.tokens))
    assert s.kv.blocks == held and pool.free_blocks == 12
    assert reads.get(s) is None and not reads.redo(s) and t.pool.free_blocks == 16
    s.kv.release(pool)
    assert pool.free_blocks == 16


@pytest.mark.parametrize("case", ["no-room", "rewound", "pinned", "moving", "recompute"])
def test_a_round_that_cannot_be_claimed_waits_for_its_fetch_as_before(case):
    t = Tier(device_blocks=3 if case == "no-room" else 16)  # 15 tokens need 4 blocks
    t.offloaded("s1", listed=HIST - 2 if case == "rewound" else HIST + 1, start=4 if case == "pinned" else 0)
    if case == "moving":
        del t.fetching["s1"]  # its prefetch already reserved (an early one), or none listed
    reads, s = HostReads(t), _session()
    s.recompute = 3 if case == "recompute" else 0
    assert not reads.claim(s) and "s1" in t.copies and reads.get(s) is None
    assert t.w.rt.pool.free_blocks == t.w.rt.pool.num_blocks and s.kv.tokens == s.kv.reserved == 0


def _task(on_host: bool) -> common_pb2.PrefillTask:
    task = common_pb2.PrefillTask(session_id="s1", round=1, l_hist=8, l_incr=4, decode_worker="d0", decode_tp=1,
                                  token_ids=[1, 2, 3, 4], history_on_host=on_host,
                                  sampling=common_pb2.SamplingParams(max_tokens=4))
    task.history.add(block=0, offset=0, tokens=8)
    task.dest.add(block=0, offset=8, tokens=4)
    return task


def test_a_history_on_host_is_checked_against_the_host_pool():
    target = TaskTarget(1, num_blocks=4, block_tokens=16, host_blocks=2)
    validate_prefill_task(_task(True), target=target)  # block 0 of each pool: no slot named twice
    task = _task(True)
    task.history[0].block = 2
    with pytest.raises(InvalidArgument, match=r"task.history\[0\].block: 2 is outside the decode worker's 2 blocks"):
        validate_prefill_task(task, target=target)
    with pytest.raises(InvalidArgument, match="task.history_on_host: decode worker 'd0' has no host KV tier"):
        validate_prefill_task(_task(True), target=TaskTarget(1, 4, 16))
    validate_prefill_task(_task(False), target=target)  # one pool: slots 0..7 and 8..11 of block 0


def test_the_task_token_covers_where_the_history_lies():
    key = b"k" * 32
    assert task_token(key, _task(True)) != task_token(key, _task(False))


def test_the_host_tier_is_registered_with_the_worker_and_read_back_from_its_registration():
    import base64

    from ampd.runtime import _host_fields
    from ampd.state.store import WorkerInfo

    assert _host_fields(None) == {}  # no tier: nothing registered, a registration as before
    layout = {"base_addr": 4096, "num_blocks": 16, "block_tokens": BT, "bytes_per_token": BPT}
    info = WorkerInfo("d0", "decode", "127.0.0.1:1", 1, "d0-1", {}, 64, **_host_fields(("d0-1-host", b"\0md", layout)))
    back = WorkerInfo.from_json(info.to_json())
    assert (back.host_agent, base64.b64decode(back.host_metadata), back.host_layout) == ("d0-1-host", b"\0md", layout)
    old = WorkerInfo.from_json(WorkerInfo("p0", "prefill", "a", 1, "p0-1", {}, 64).to_json())
    assert (old.host_agent, old.host_metadata, old.host_layout) == ("", "", {})


def test_a_prefill_worker_adds_a_decode_workers_host_tier_as_a_peer_and_drops_it_with_the_worker():
    """WorkerRuntime.sync_peers on a stand-in runtime (loopback agents, a registry of dicts): the host
    agent comes with the decode worker's registration, goes when it restarts without it, and when the
    worker leaves."""
    import base64

    from ampd.runtime import WorkerRuntime, _host_fields
    from ampd.state.store import WorkerInfo

    hub = LoopbackHub()
    agents = {}

    def decode_worker(gen: int, tier: bool) -> WorkerInfo:
        dev, host = KVPool(8, BT, BPT), KVPool(8, BT, BPT)
        agents[gen] = (LoopbackTransport(f"d0-{gen}", dev, hub=hub), LoopbackTransport(f"d0-{gen}-host", host, hub=hub))
        host_peer = (f"d0-{gen}-host", agents[gen][1].metadata(), host.layout.to_dict()) if tier else None
        return WorkerInfo("d0", "decode", "a", 1, f"d0-{gen}", dev.layout.to_dict(), 32, **_host_fields(host_peer))

    registry: dict[str, WorkerInfo] = {}

    async def workers():
        return dict(registry)

    async def nixl_metadata(wid):
        info = registry.get(wid)
        return None if info is None else agents[int(info.nixl_agent.split("-")[1])][0].metadata()

    me = SimpleNamespace(cfg=SimpleNamespace(kind="prefill"), _peer_gen={}, peers={}, _peer_missing={},
                         transport=LoopbackTransport("p0", KVPool(8, BT, BPT), hub=hub),
                         store=SimpleNamespace(workers=workers, nixl_metadata=nixl_metadata))
    sync = lambda: asyncio.run(WorkerRuntime.sync_peers(me))  # noqa: E731
    registry["d0"] = decode_worker(1, tier=True)
    sync()
    assert sorted(me.transport.peers()) == ["d0-1", "d0-1-host"] and WorkerRuntime.host_agent(me, "d0") == "d0-1-host"
    assert base64.b64decode(registry["d0"].host_metadata) == agents[1][1].metadata()
    registry["d0"] = decode_worker(2, tier=False)  # restarted, its tier off
    sync()
    assert "d0-2" in me.transport.peers() and "d0-1-host" not in me.transport.peers()
    with pytest.raises(LookupError, match="no host KV tier"):
        WorkerRuntime.host_agent(me, "d0")
    registry["d0"] = decode_worker(3, tier=True)
    sync()
    del registry["d0"]
    for _ in range(5):  # a worker leaves after several syncs without it
        sync()
    assert not {"d0-3", "d0-3-host"} & set(me.transport.peers())
