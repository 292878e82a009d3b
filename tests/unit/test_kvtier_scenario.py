"""The KV tier's pieces driven together over real pools: a device pool filled with sessions idle in
tool calls still admits new sessions, every idle session completes (from host, or by re-prefill, also
after a failed prefetch), every byte brought back is the session's, and both pools end empty.

The driver here plays the decode worker's part: it copies bytes between the device pool
and a host pool's buffer with ``KVPool.read``/``write`` where the live worker uses the KV transport.
"""

import numpy as np

from ampd.kv.hostpool import HostPool
from ampd.kv.pattern import kv_pattern, verify_pattern
from ampd.kv.pool import KVPool, SessionKV
from ampd.policy.kvtier import (
    KEEP,
    OFFLOAD,
    KVState,
    KVTierConfig,
    PoolState,
    ToolPause,
    decide,
)

BT, BPT = 16, 8
CFG = KVTierConfig()


class Worker:
    def __init__(self, device_blocks: int, host_blocks: int):
        self.dev = KVPool(device_blocks, BT, BPT)
        self.host_buf = KVPool(host_blocks, BT, BPT)  # the pinned host buffer
        self.host = HostPool(host_blocks, BT, BPT)
        self.kv: dict[str, SessionKV] = {}
        self.tokens: dict[str, int] = {}
        self.idle: list[str] = []  # sessions whose idle KV is on the device, least recently used first

    def prefill(self, sid: str, tokens: int) -> None:
        kv = self.kv.setdefault(sid, SessionKV())
        segs = kv.reserve(self.dev, tokens)
        self.dev.write(segs, kv_pattern(sid, 0, tokens, BPT))
        kv.commit(tokens)
        self.tokens[sid] = tokens

    def offload(self, sid: str) -> None:
        kv = self.kv[sid]
        self.host.offload_begin(sid, kv.tokens)
        dst = self.host.segments(sid)
        self.host_buf.write(dst, self.dev.read(kv.segments(0, kv.tokens)))
        self.host.offload_done(sid)
        kv.release(self.dev)
        self.idle.remove(sid)

    def drop(self, sid: str) -> None:
        self.host.drop(sid)
        self.kv[sid].release(self.dev)
        self.idle.remove(sid)

    def make_room(self, blocks: int) -> None:
        """Idle KV leaves the device, least recently used first, until ``blocks`` are free: to the
        host while it has room, else dropped (the decode core's order and rule, ``kvtier``'s
        "Eviction order", ``TierMixin._tier_victim``)."""
        for sid in list(self.idle):
            if self.dev.free_blocks >= blocks:
                break
            if self.host.free_blocks >= self.host.blocks_for(self.tokens[sid]):
                self.offload(sid)
            else:
                self.drop(sid)
        assert self.dev.free_blocks >= blocks, "idle KV could not make the room"

    def resume(self, sid: str, fail: bool = False) -> str:
        """The tool result arrived: bring the KV back (or prefill it again); how it came back."""
        state = self.host.state(sid)
        if sid in self.idle:
            self.idle.remove(sid)
        if state is KVState.RESIDENT:
            return "resident"
        tokens = self.tokens[sid]
        self.make_room(self.dev.blocks_for(tokens))
        if state is KVState.HOST:
            self.host.prefetch_begin(sid)
            src = self.host.segments(sid)
            if not fail:
                segs = self.kv[sid].reserve(self.dev, tokens)
                self.dev.write(segs, self.host_buf.read(src))
                self.kv[sid].commit(tokens)
                self.host.prefetch_done(sid)
                return "host"
            self.host.prefetch_failed(sid)  # a transfer error: the session re-prefills its tokens
        self.prefill(sid, tokens)
        if self.host.state(sid) is KVState.GONE:
            self.host.reprefilled(sid)
        return "reprefill"

    def check_and_end(self, sid: str) -> None:
        kv = self.kv.pop(sid)
        assert verify_pattern(sid, 0, self.dev.read(kv.segments(0, kv.tokens)), BPT) == 0
        kv.release(self.dev)
        self.host.release(sid)


def test_a_pool_full_of_idle_sessions_admits_new_ones_and_every_idle_one_completes():
    w = Worker(device_blocks=40, host_blocks=12)
    idle = [f"idle{i}" for i in range(10)]
    for sid in idle:  # 10 sessions of 60 tokens (4 blocks) fill the 40-block device pool
        w.prefill(sid, 60)
    assert w.dev.free_blocks == 0
    actions = []
    for sid in idle:  # each round ends in a 10 s tool call
        w.idle.append(sid)
        pool = PoolState(40, 40 - w.dev.free_blocks, 0, w.host.free_blocks)
        d = decide(ToolPause(sid, "search", 10.0, 4, 0.01, 0.01, 0.5), pool, CFG)
        actions.append(d.action)
        if d.action == OFFLOAD:
            w.offload(sid)
    # three fit the 12 host blocks; then the device is at 28/40 = 0.7 and the host is full: the
    # rest stay, evictable
    assert actions == [OFFLOAD] * 3 + [KEEP] * 7
    assert (w.dev.free_blocks, w.host.free_blocks) == (12, 0)

    # 7 new sessions of 4 blocks arrive: 28 blocks, 12 free: the idle ones make room (dropped: the
    # host is full), least recently used first
    for j in range(7):
        sid = f"new{j}"
        w.make_room(4)
        w.prefill(sid, 60)
    assert [s for s in idle if w.host.state(s) is KVState.GONE] == ["idle3", "idle4", "idle5", "idle6"]
    assert w.dev.free_blocks == 0

    for j in range(7):
        w.check_and_end(f"new{j}")
    how = [w.resume(sid, fail=(sid == "idle1")) for sid in idle]
    assert how.count("host") == 2 and how.count("reprefill") == 5 and how.count("resident") == 3
    assert how[1] == "reprefill"  # its prefetch failed: it prefilled again, the session is not lost
    for sid in idle:
        w.check_and_end(sid)
    assert w.dev.free_blocks == 40 and w.host.empty
    assert w.host.bytes_to_host == 3 * 60 * BPT and w.host.bytes_from_host == 2 * 60 * BPT


def test_offloaded_bytes_come_back_byte_for_byte_into_other_blocks():
    w = Worker(device_blocks=8, host_blocks=8)
    w.prefill("a", 50)
    w.idle.append("a")
    w.offload("a")
    w.prefill("b", 50)  # takes a's old blocks
    assert w.resume("a") == "host"
    assert w.kv["a"].blocks != w.kv["b"].blocks
    for sid in ("a", "b"):
        w.check_and_end(sid)
    assert w.dev.free_blocks == 8 and w.host.empty
    assert np.count_nonzero(w.host_buf.buffer) > 0  # the copy went through the host buffer
