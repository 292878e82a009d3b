"""Prefix sharing in the simulator with KV that leaves the device while sessions idle in tool calls
(ampd/sim/prefixing.py): --kv-evict, the host tier (--kv-host-mb) and Continuum's pin TTL. As on
the live worker, a session's shared prompt blocks stay on the device while only its own KV moves to
host; an eviction drops only a session's own blocks and its references; a dropped session shares
again what is still indexed; and the KV counted is never above the device's capacity.

The small cases are worked by hand: one decode worker, sessions a and b with the same 4-block
prompt (hash ids 1..4, 4 * 512 + 10 tokens), 50 output tokens and a 30 s tool call, then a 50-token
round of 5; b arrives after a's first round committed its prompt blocks, so it shares all 4
(2048 tokens) and prefills 10."""
from __future__ import annotations

import pytest

from ampd.sim import loop, simulate
from ampd.sim.workers import Decode
from ampd.workload import Round, Session
from ampd.workload.mooncake import HASH_BLOCK_TOKENS

from test_sim import _profile

BT = HASH_BLOCK_TOKENS
PROMPT = (1, 2, 3, 4)
A = Session("a", 0.0, (Round(4 * BT + 10, 50, 30.0, None, PROMPT), Round(50, 5)))
B = Session("b", 0.5, (Round(4 * BT + 10, 50, 30.0, None, PROMPT), Round(50, 5)))
C = Session("c", 3.0, (Round(850, 5),))  # no prompt blocks: it needs room a or b must give


@pytest.fixture
def peak(monkeypatch):
    """The most KV any decode worker counted (``kv_used``) after every handler of the event loop
    (``used``) and right after each admission of a round, its accounting synced (``admitted``), and
    whether its capacity was ever anything but the device's (``_unpin``'s estimate left over).
    Without the host tier decode tokens are charged as they are made and never refused
    (``ampd.worker.decode``), so only ``admitted`` is bounded by the capacity there."""
    seen = {"used": 0, "admitted": 0, "cap_changed": False}
    admitted = loop._Run.prefix_admitted

    def on_admit(self, st):
        admitted(self, st)
        seen["admitted"] = max(seen["admitted"], st.dw.kv_used)
    monkeypatch.setattr(loop._Run, "prefix_admitted", on_admit)

    def wrap(name):
        orig = getattr(loop._Run, name)

        def handler(self, *args, **kw):
            out = orig(self, *args, **kw)
            for d, cap in zip(self.decodes, self.prefix_cap):
                seen["used"] = max(seen["used"], d.kv_used)
                seen["cap_changed"] |= d.kv_cap != cap
            return out
        monkeypatch.setattr(loop._Run, name, handler)

    for name in ("round_ready", "drain", "first_token", "step_done", "prefill_done", "round_end"):
        wrap(name)
    update = Decode.update

    def decoded(self, work, now):  # a run's tokens are counted before its rounds end and release
        out = update(self, work, now)
        seen["used"] = max(seen["used"], self.kv_used)
        return out
    monkeypatch.setattr(Decode, "update", decoded)
    return seen


def _run(sessions, cap, sharing, policy="colocated", **kw):
    kw.setdefault("admission", "none")  # the decode core's KV admission alone decides
    kw.setdefault("kv_host_ratio", 0)  # no host tier unless a test asks (kv_host_mb overrides this)
    return simulate(sessions, _profile(cap=cap), policy=policy, decode="tp1*1", ttft_slo_s=5.0, itl_slo_s=1.0,
                    prefix_sharing=sharing, **kw)


def _done(r):
    assert all(s.completed for s in r.sessions), [(s.session_id, s.error) for s in r.sessions]
    st = r.stats
    assert st["kv_used_end"] == [0] and st["kv_overcommits"] == 0 and st["unfinished_sessions"] == 0
    if "prefix_blocks_held_end" in st:
        assert st["prefix_blocks_held_end"] == 0


def test_evict_drops_only_the_sessions_own_blocks_and_it_shares_again(peak):
    # c (850 tokens) finds 3000 - (a's 2108 + b's own 60) = 832 free: a, idle longest, is evicted.
    # Its 4 prompt blocks are b's too: only its own 60 tokens free (892 >= 850), so b stays.
    # Counted then: b's 2108 (2048 shared) + c's 850 and 5 outputs = 2963, never more.
    r = _run([A, B, C], 3000, True, kv_evict=True)
    _done(r)
    st = r.stats
    assert st["kv_evictions"] == 1
    assert peak["used"] == 2963 and not peak["cap_changed"]
    assert st["prefix_blocks_let_go"] == 4
    # a's next round shares the 4 blocks b still holds: it prefills again only its own 60 tokens
    assert st["kv_recomputed_tokens"] == 60
    assert st["prefix_shared_tokens"] == 2 * 4 * BT
    a1 = r.sessions[0].rounds[1]
    # without sharing both idle sessions go (a for c, b for a's 2158-token re-prefill)
    off = _run([A, B, C], 3000, False, kv_evict=True)
    _done(off)
    assert off.stats["kv_evictions"] == 2 and off.stats["kv_recomputed_tokens"] == 2 * (4 * BT + 60)
    assert a1.first_token - a1.input_ready < off.sessions[0].rounds[1].first_token - off.sessions[0].rounds[1].input_ready


def test_host_tier_moves_only_the_sessions_own_kv(peak):
    # a's prompt has 2 more blocks of its own (hash ids 5, 6): 6 * 512 + 10 tokens. Pressure 0 and a
    # tool never seen: both offload as their first round ends (unknown-tool). Each keeps on the
    # device the blocks b shares (live: ``SharedKV.choose_pin``) and moves the rest: a its own
    # prompt blocks too, 3082 + 50 - 2048 = 1084 tokens; b 10 + 50 = 60.
    a = Session("a", 0.0, (Round(6 * BT + 10, 50, 30.0, None, PROMPT + (5, 6)), Round(50, 5)))
    kw = dict(kv_host_mb=10, kv_offload_pressure=0.0)
    r = _run([a, B], 8 * BT, True, **kw)
    _done(r)
    tier = r.stats["kv_tier"]
    assert tier["decisions"] == {"offload:unknown-tool": 2}
    assert tier["tokens_to_host"] == tier["tokens_from_host"] == 1084 + 60
    assert tier["bytes_to_host"] == (1084 + 60) * 1000 and tier["host_used_end"] == [0]
    # each round's whole output is reserved at admission: a's 3132, then b's own 10 + 50
    assert peak["used"] == 3192 and not peak["cap_changed"]
    assert r.stats["prefix_shared_tokens"] == 4 * BT and r.stats["kv_recomputed_tokens"] == 0
    # a's blocks 5 and 6 left the device with its KV: nobody held them, so they were cached and let go
    assert r.stats["prefix_blocks_let_go"] == 2
    off = _run([a, B], 8 * BT, False, **kw)
    _done(off)
    assert off.stats["kv_tier"]["tokens_to_host"] == (6 * BT + 60) + (4 * BT + 60)


def test_host_tier_keeps_blocks_shared_after_the_pause_on_the_device(peak):
    # Pauses keep (pressure 1): a pauses holding its 6 prompt blocks alone (nothing pinned then);
    # b then shares all 6 (prefills 10, 20 outputs). c's 1000 + 5 find 4096 - 3132 - 30 = 934
    # free: a's own KV goes to host, but the 6 blocks b now reads stay (its pin is taken again
    # before the decision): 3082 + 50 - 3072 = 60 tokens; still short, b's own 30 go too.
    six = tuple(range(1, 7))
    a = Session("a", 0.0, (Round(6 * BT + 10, 50, 30.0, None, six), Round(50, 5)))
    b = Session("b", 2.0, (Round(6 * BT + 10, 20, 30.0, None, six), Round(50, 5)))
    c = Session("c", 3.0, (Round(1000, 5),))
    r = _run([a, b, c], 8 * BT, True, kv_host_mb=5, kv_offload_pressure=1.0)
    _done(r)
    tier = r.stats["kv_tier"]
    assert tier["decisions"]["offload:pressure-offload"] == 2 and tier["tokens_to_host"] == 60 + 30
    assert peak["used"] == 4096 - 934 + 1005 - 90 and not peak["cap_changed"]


def test_evict_counts_a_prefix_only_the_victim_holds_as_freed(peak):
    # a holds its 4 prompt blocks alone (nobody shares them): evicting it frees its whole 2108
    # tokens (``pin_own``, fed before each decision as the live KvSync does), enough for c2's
    # 2000 (3000 - 2108 - 840 + 2108 = 2160 free), so d, idle since later, keeps its KV.
    a = Session("a", 0.0, (Round(4 * BT + 10, 50, 30.0, None, PROMPT), Round(40, 5)))
    d = Session("d", 0.5, (Round(800, 40, 40.0), Round(50, 5)))
    c2 = Session("c2", 3.0, (Round(2000, 5),))
    r = _run([a, d, c2], 3000, True, kv_evict=True)
    _done(r)
    st = r.stats
    assert st["kv_evictions"] == 1 and st["prefix_blocks_let_go"] == 4
    # c2's KV took the cached blocks' space: a prefills its whole history again, 2108 + 40 tokens
    # beside d's 840 (2988, and its 5 outputs)
    assert st["kv_recomputed_tokens"] == 4 * BT + 60 and st["prefix_shared_tokens"] == 0
    assert peak["used"] == 840 + 4 * BT + 60 + 40 + 5


def test_pin_ttl_expiry_frees_only_the_sessions_own_blocks(peak):
    # Continuum pins a and b for 5 s (their tools take 30): c waits until a's pin expires
    # (1.235 s + 5), then a is evicted; its own 60 tokens make c's room (b keeps the 4 blocks).
    r = _run([A, B, C], 3000, True, policy="continuum")
    _done(r)
    st = r.stats
    assert st["kv_evictions"] == 1 and st["prefix_blocks_let_go"] == 4
    assert peak["used"] == 2963 and not peak["cap_changed"]
    a0, c0 = r.sessions[0].rounds[0], r.sessions[2].rounds[0]
    assert c0.input_ready == 3.0 and c0.first_token == pytest.approx(a0.last_token + 5.0 + 0.01 + 850e-4)
    assert st["prefix_shared_tokens"] == 2 * 4 * BT  # a shares the blocks again for its next round
    off = _run([A, B, C], 3000, False, policy="continuum")
    _done(off)
    assert off.stats["kv_evictions"] == 2


def _tight_trace(n=24, gap_s=0.4):
    """KV-tight: 3 prompt families (6 shared blocks each) plus blocks of each session's own, three
    rounds with tool calls of 4..12 s."""
    out = []
    for i in range(n):
        fam = 100 * (i % 3)
        ids = tuple(fam + k for k in range(6)) + tuple(10_000 + 10 * i + k for k in range(1 + i % 3))
        inp = len(ids) * BT + 40 + i
        out.append(Session(f"s{i}", i * gap_s, (Round(inp, 60, 4.0 + i % 9, None, ids),
                                                Round(300, 40, 6.0, None), Round(120, 30))))
    return out


@pytest.mark.parametrize("policy,kw", [
    # without the tier, admission's promises (whole sessions' KV on the device) leave nothing to
    # evict: the decode core's KV admission alone decides, evicting idle sessions
    ("colocated", {"kv_evict": True, "admission": "none"}),
    ("continuum", {"admission": "none"}),
    ("ampd", {"kv_evict": True, "prefill": "tp1*1", "admission": "none"}),
    # with it, admission promises device + host: the tier's pressure order makes the room
    ("colocated", {"kv_host_mb": 40, "kv_offload_pressure": 0.5}),
    ("colocated", {"kv_host_mb": 40, "kv_evict": True}),
])
def test_kv_tight_trace_completes_without_overcommit(peak, policy, kw):
    cap = 30 * BT
    ss = _tight_trace()
    r = simulate(ss, _profile(cap=cap), policy=policy, decode="tp1*2", ttft_slo_s=5.0, itl_slo_s=1.0,
                 prefix_sharing=True, **kw)
    st = r.stats
    refused = sum(st["admission_refused"].values())
    assert sum(s.completed for s in r.sessions) + refused == len(ss) and st["unfinished_sessions"] == 0
    assert all(s.completed or s.error for s in r.sessions)
    assert st["kv_used_end"] == [0, 0] and st["prefix_blocks_held_end"] == 0 and st["kv_overcommits"] == 0
    assert peak["admitted"] <= cap and not peak["cap_changed"]
    assert peak["admitted"] > cap * 3 // 4  # (KV-tight indeed)
    assert st["prefix_shared_tokens"] > 0 and st["prefix_blocks_let_go"] > 0
    if "kv_tier" in st:
        off = simulate(ss, _profile(cap=cap), policy=policy, decode="tp1*2", ttft_slo_s=5.0, itl_slo_s=1.0,
                       prefix_sharing=False, **kw)
        assert 0 < st["kv_tier"]["bytes_to_host"] < off.stats["kv_tier"]["bytes_to_host"]
        assert st["kv_tier"]["host_used_end"] == [0, 0]
        assert peak["used"] <= cap  # (outputs are reserved at admission)
    else:
        assert st["kv_evictions"] > 0


def _cached_then_reserved(b_at, kv_host_mb=10):
    """a's 4 prompt blocks are cached once it ends; x (no prompt blocks) then reserves 10 + 1500
    tokens on a 6-block device (with the tier), its output made over ~30 s; b shares a's prompt at
    ``b_at``."""
    a = Session("a", 0.0, (Round(4 * BT + 10, 5, None, None, PROMPT),))
    x = Session("x", 1.0, (Round(10, 1500),))
    b = Session("b", b_at, (Round(4 * BT + 10, 5, None, None, PROMPT),))
    r = _run([a, x, b], 6 * BT, True, kv_host_mb=kv_host_mb)
    _done(r)
    return r


def test_cache_keeps_the_room_of_output_not_made_yet(peak):
    # With the tier x's whole output is charged at admission (3072 - 1510 = 1562 < 2048 cached
    # tokens), but the pool reclaims a cached block only when a token is written into it: x writes
    # 1510 tokens, so the 4 blocks (2048 <= 3072 - 1510) all stay and b, after x, shares them all
    # (as with the tier off). Cut by the charges, a's first block went and b shared nothing.
    r = _cached_then_reserved(40.0)
    st = r.stats
    assert st["prefix_blocks_evicted"] == 0
    assert st["prefix_shared_blocks"] == st["prefix_blocks_revived"] == 4
    assert st["kv_tier"]["bytes_to_host"] == 0 and peak["used"] <= 6 * BT
    assert _cached_then_reserved(40.0, kv_host_mb=0).stats["prefix_shared_blocks"] == 4  # tier off


def test_a_revived_prefix_never_takes_the_room_of_output_not_made_yet(peak):
    # b comes while x still makes its output: reviving the 4 cached blocks would count 1510 + 2048
    # > 3072 tokens on the device, so the cache first gives way to x's charged output, least
    # recently released first (a's first block: b then finds no prefix and prefills its prompt
    # when the KV is free), and the KV counted never exceeds the device.
    r = _cached_then_reserved(5.0)
    assert peak["used"] <= 6 * BT and peak["admitted"] <= 6 * BT
    st = r.stats
    assert st["prefix_blocks_evicted"] >= 1 and st["prefix_blocks_revived"] == 0
