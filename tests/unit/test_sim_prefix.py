"""Prefix sharing in the simulator (ampd/sim/prefixing.py): sessions whose first prompts share
hash blocks held on their decode worker prefill less, and the KV accounting returns to empty."""
from __future__ import annotations

from ampd.sim import simulate
from ampd.workload import Round, Session
from ampd.workload.mooncake import HASH_BLOCK_TOKENS

from test_sim import _profile

P = _profile(cap=200_000)
BT = HASH_BLOCK_TOKENS


def _trace(n=12, shared_blocks=6, own_blocks=2, gap_s=0.5):
    """``n`` sessions, each 2 rounds; round 0's prompt = a common prefix + blocks of its own."""
    out = []
    for i in range(n):
        ids = tuple(range(1, shared_blocks + 1)) + tuple(1000 * (i + 1) + k for k in range(own_blocks))
        inp = (shared_blocks + own_blocks) * BT + 100
        out.append(Session(f"s{i}", i * gap_s, (Round(inp, 40, 2.0, None, ids), Round(200, 30))))
    return out


def _run(sessions, on, **kw):
    kw.setdefault("decode", "tp1*2")
    return simulate(sessions, P, policy="colocated", ttft_slo_s=5.0, itl_slo_s=1.0, prefix_sharing=on, **kw)


def _ttft0(r):
    return sorted(s.rounds[0].ttft for s in r.sessions)


def test_sharing_prefills_less_and_is_no_slower():
    sessions = _trace()
    off, on = _run(sessions, False), _run(sessions, True)
    assert all(s.completed for s in off.sessions) and all(s.completed for s in on.sessions)
    st = on.stats
    # sessions arriving after a first round on their worker committed its blocks share the 6 common ones
    assert st["prefix_sharing_sessions"] >= len(sessions) // 2
    assert st["prefix_shared_tokens"] == st["prefix_shared_blocks"] * BT > 0
    assert "prefix_shared_tokens" not in off.stats
    assert sum(_ttft0(on)) < sum(_ttft0(off))
    assert _ttft0(on)[len(sessions) // 2] <= _ttft0(off)[len(sessions) // 2]
    # no leaks: every block and token back
    assert st["prefix_blocks_held_end"] == 0
    assert st["kv_used_end"] == [0, 0] and off.stats["kv_used_end"] == [0, 0]


def test_binding_prefers_the_worker_holding_the_prefix():
    on = _run(_trace(n=6, gap_s=2.0), True)
    workers = {s.decode_worker for s in on.sessions}
    assert len(workers) == 1  # all follow the first session's prefix (the ITL SLO is not at risk)
    assert on.stats["prefix_sharing_sessions"] == 5


def test_owner_ending_first_keeps_shared_blocks_until_the_last_holder():
    a = Session("a", 0.0, (Round(4 * BT + 10, 5, 1.0, None, (1, 2, 3, 4)), Round(50, 5)))
    b = Session("b", 0.5, (Round(4 * BT + 10, 5, 30.0, None, (1, 2, 3, 9)), Round(100, 5)))
    r = _run([a, b], True, decode="tp1*1")
    assert r.stats["prefix_shared_blocks"] == 3
    assert r.stats["kv_used_end"] == [0] and r.stats["prefix_blocks_held_end"] == 0


def test_sessions_without_hash_ids_are_unchanged():
    sessions = [Session(f"s{i}", i * 0.3, (Round(3000, 20, 1.0), Round(100, 10))) for i in range(8)]
    off, on = _run(sessions, False), _run(sessions, True)
    assert [[tuple(x) for x in s.rounds] for s in off.sessions] == [[tuple(x) for x in s.rounds] for s in on.sessions]
    assert on.stats["prefix_shared_tokens"] == 0


def test_released_blocks_stay_cached_and_are_shared_again():
    # a ends long before b arrives: b shares a's prefix from the cache (revived, charged again)
    a = Session("a", 0.0, (Round(4 * BT + 10, 5, None, None, (1, 2, 3, 4)),))
    b = Session("b", 20.0, (Round(4 * BT + 10, 5, None, None, (1, 2, 3, 9)),))
    r = _run([a, b], True, decode="tp1*1")
    st = r.stats
    assert st["prefix_shared_blocks"] == 3 and st["prefix_blocks_revived"] == 3
    assert st["kv_used_end"] == [0] and st["prefix_blocks_held_end"] == 0
    assert st["prefix_blocks_cached_end"] == 5  # a's 4 blocks and b's own; in free KV, charged to nobody
    assert r.sessions[1].rounds[0].ttft < r.sessions[0].rounds[0].ttft


def test_cache_gives_way_to_sessions_that_need_the_kv():
    # a small pool: the cache is cut to what is free, so nothing waits or overcommits for it
    prof = _profile(cap=6 * BT)
    ss = [Session(f"s{i}", i * 10.0, (Round(4 * BT + 10, 5, None, None, tuple(range(10 * i, 10 * i + 4))),))
          for i in range(4)]
    r = simulate(ss, prof, policy="colocated", decode="tp1*1", ttft_slo_s=5.0, itl_slo_s=1.0, prefix_sharing=True)
    st = r.stats
    assert all(s.completed for s in r.sessions)
    assert st["prefix_blocks_evicted"] > 0 and st["kv_overcommits"] == 0
    assert st["kv_used_end"] == [0] and st["prefix_blocks_cached_end"] * BT <= 6 * BT


def test_a_trace_without_hash_ids_skips_the_prefix_calls_and_matches_sharing_off(monkeypatch):
    # nothing can be shared: the run parks the indexes (no prefix call per round) and ends as with
    # sharing off, its prefix stats (all 0) still reported
    sessions = [Session(s.id, s.arrival, tuple(Round(r.input, r.output, r.tool_s) for r in s.rounds))
                for s in _trace()]
    off = _run(sessions, False, kv_evict=True)
    from ampd.sim.prefixing import Prefixing

    def never(*_a, **_k):
        raise AssertionError("a prefix call in a run with nothing to share")
    for name in ("prefix_round_ready", "prefix_admit_next", "prefix_pin", "prefix_trim", "prefix_release"):
        monkeypatch.setattr(Prefixing, name, never)
    on = _run(sessions, True, kv_evict=True)
    assert [s.rounds for s in on.sessions] == [s.rounds for s in off.sessions]
    assert on.stats["prefix_shared_tokens"] == on.stats["prefix_blocks_let_go"] == 0
    assert {k: v for k, v in on.stats.items() if not k.startswith("prefix_") and k not in ("wall_s", "sessions_per_s")} \
        == {k: v for k, v in off.stats.items() if k not in ("wall_s", "sessions_per_s")}
