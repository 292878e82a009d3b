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
from services.decode.tier import HostCopy

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
    assert s.kv.tokens == 0 and t.w.rt.pool.free_blocks == 16  # the round reserves again as it starts
    assert reads.get(s) is None and not reads.redo(s) and t.pool.free_blocks == 16


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
