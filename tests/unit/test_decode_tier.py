"""The host KV tier in the decode core (ampd/worker/decode_tier.py) and the simulator: a pool filled
with sessions idle in tool calls still admits new sessions, every idle session completes (from the
host, or by re-prefill), each decision is counted with its reason, the moves are listed for the
driver, and the accounting (device tokens, host blocks) returns to empty."""
from __future__ import annotations

import dataclasses

import pytest

from ampd.kv.hostpool import HostPool, HostPoolTooSmall
from ampd.policy import SLO, make_queue
from ampd.policy.kvtier import KVState
from ampd.sim import simulate
from ampd.worker import ADMITTED, FROM_HOST, TO_HOST, WAITING, DecodeCore, DecodeSession, HostTier
from ampd.workload.trace import Round, Session
from tests.unit.test_worker_prefill import P

BT = 16


def _core(cap: int, host_tokens: int) -> DecodeCore:
    tier = HostTier(HostPool(host_tokens // BT, BT, P.kv_bytes_per_token))
    return DecodeCore("decode-0", 1, P, make_queue("fcfs", P, SLO(1.0, 0.1), 1), kv_capacity_tokens=cap, tier=tier)


def _round(core: DecodeCore, s: DecodeSession, now: float, last: bool) -> None:
    """The admitted round of ``s`` makes its one output token and ends."""
    assert core.first_token(s, now) is False
    core.round_end(s, last)


def _ready(s: DecodeSession, rnd: int, l_incr: int) -> DecodeSession:
    s.round, s.l_incr, s.out = rnd, l_incr, 1
    return s


def test_a_pool_full_of_idle_sessions_admits_new_ones_and_every_idle_one_completes():
    core = _core(cap=5000, host_tokens=2 * 1008)  # the host holds two sessions' KV of 1001 tokens
    core.tier.durations.observe("search", 0.0, 60.0)  # a long tool
    idle = [DecodeSession(f"idle-{i}") for i in range(4)]
    for s in idle:
        assert core.round_ready(_ready(s, 0, 1000), 0.0) == ADMITTED
    for s in idle:
        _round(core, s, 0.1, last=False)
        core.tier_pause(s, 0.1, "search")
    # the first pause saw 4004 / 5000 used: a long tool under pressure goes to the host; then the
    # pool is under the pressure threshold and the others keep their KV (evictable)
    assert core.tier.decisions == {"offload:long-tool": 1, "keep:no-pressure": 3}
    assert core.kv_used == 3003 and core.tier.host.state("idle-0") is KVState.HOST and idle[0].fetch == 1001
    moves = core.take_moves()
    assert [(m.session_id, m.direction, m.tokens) for m in moves] == [("idle-0", TO_HOST, 1001)]
    assert moves[0].seconds == pytest.approx(P.t_kv(1001, 1, 1)) and core.take_moves() == []
    # new sessions: each makes room by evicting idle KV, to the host while it has room, then dropped
    new = [DecodeSession(f"new-{i}") for i in range(2)]
    assert core.round_ready(_ready(new[0], 0, 3000), 1.0) == ADMITTED  # 1997 free: two victims
    assert core.tier.decisions["offload:pressure-offload"] == 1 and core.tier.decisions["drop:pressure-drop"] == 1
    assert idle[1].fetch == 1001 and idle[2].evicted and core.kv_evictions == 1 and core.victims == [idle[2]]
    assert core.round_ready(_ready(new[1], 0, 1500), 1.0) == ADMITTED  # the host is full: dropped
    assert idle[3].evicted and core.kv_evictions == 2 and core.kv_used == 4502  # each round's output reserved
    assert [m.direction for m in core.take_moves()] == [TO_HOST]
    # the idle sessions' results arrive while the new sessions hold the pool: they wait, none is lost
    waits = [core.round_ready(_ready(s, 1, 100), 2.0) for s in idle]
    assert waits == [WAITING] * 4
    for s in new:
        _round(core, s, 2.5, last=True)
    done = []
    while (s := core.admit_next(2.5)) is not None:
        done.append(s)
    assert done == idle and core.kv_used == 4 * 1102
    assert idle[2].l_hist == idle[3].l_hist == 0 and idle[3].l_incr == 1101  # dropped: prefilled again
    assert idle[0].l_hist == 1001 and idle[0].fetch == 0  # from the host
    moves = core.take_moves()
    assert [(m.session_id, m.direction, m.tokens) for m in moves] == [("idle-0", FROM_HOST, 1001),
                                                                       ("idle-1", FROM_HOST, 1001)]
    for s in done:
        _round(core, s, 3.0, last=True)
    assert core.kv_recomputed_tokens == 2002 and core.tier.tokens_to_host == core.tier.tokens_from_host == 2002
    assert core.kv_used == 0 and core.admitted == 0 and not core.sessions and core.tier.host.empty


def test_under_pressure_idle_kv_goes_least_recently_used_first_whatever_the_tools_and_hints():
    """The order ``kvtier`` states ("Eviction order"): the tool call that began longest ago first;
    neither the tool's expected duration nor a hint moves a session in it."""
    core = _core(cap=6000, host_tokens=16 * 1008)
    core.tier.cfg.offload_pressure = 1.0  # pauses keep: only pressure moves KV
    core.tier.durations.observe("search", 0.0, 60.0)
    core.tier.durations.observe("calc", 0.0, 2.0)
    pauses = {"calc-long-hint": ("calc", 300.0), "search": ("search", None), "new-tool": ("browse", None),
              "calc": ("calc", None), "search-short-hint": ("search", 0.1)}
    ss = {sid: DecodeSession(sid) for sid in pauses}
    for s in ss.values():
        assert core.round_ready(_ready(s, 0, 999), 0.0) == ADMITTED
        _round(core, s, 0.5, last=False)
    for i, sid in enumerate(reversed(pauses)):  # paused in the reverse order, 1 s apart
        tool, hint = pauses[sid]
        core.tier_pause(ss[sid], 1.0 + i, tool, hint)
    assert core.tier.decisions == {"keep:no-pressure": 5} and core.kv_used == 5000
    assert core.round_ready(_ready(DecodeSession("n"), 0, 3999), 10.0) == ADMITTED
    assert [m.session_id for m in core.take_moves()] == ["search-short-hint", "calc", "new-tool"]


def test_own_parts_stay_on_the_device_when_only_prefixes_others_read_would_make_room():
    """The pressure check counts an idle session's pinned blocks others still read as taken
    (``pin_own``): by ``evictable_kv`` the own parts would go to host and the round wait anyway."""
    core = _core(cap=2000, host_tokens=4096)
    core.tier.cfg.offload_pressure = 1.0
    core.tier.durations.observe("search", 0.0, 60.0)
    a, b = DecodeSession("a"), DecodeSession("b")
    for s in (a, b):  # 601 tokens each, the first 512 in blocks both read (pin_own 0)
        assert core.round_ready(_ready(s, 0, 600), 0.0) == ADMITTED
        _round(core, s, 0.1, last=False)
        s.pinned = 512
        core.tier_pause(s, 1.0, "search")
    e = DecodeSession("e")  # a round in progress: the last resort does not run
    e.round, e.l_incr, e.out = 0, 100, 50
    assert core.round_ready(e, 1.0) == ADMITTED and core.first_token(e, 1.1) is True
    c = _ready(DecodeSession("c"), 0, 1000)
    # 648 free + 2 * 89 own < 1001, though 648 + evictable_kv (1202) is not: nothing moves
    assert core.kv_cap - core.kv_used + core.evictable_kv >= 1001
    assert core.round_ready(c, 1.2) == WAITING
    assert core.take_moves() == [] and a.fetch == b.fetch == 0 and core.tier.decisions == {"keep:no-pressure": 2}
    core.drop(c)
    # a round the own parts do make room for moves them
    assert core.round_ready(_ready(DecodeSession("d"), 0, 800), 1.3) == ADMITTED
    assert [(m.session_id, m.direction, m.tokens) for m in core.take_moves()] == [("a", TO_HOST, 89),
                                                                                  ("b", TO_HOST, 89)]


@pytest.mark.parametrize("host_tokens", [1008, 400])
def test_when_every_session_waits_the_others_kv_makes_room_instead_of_an_overcommit(host_tokens):
    """Two sessions with resident KV both wait for room for their next round: without a tier the
    head would go ahead over capacity (an overcommit). With it, the other waiting session's KV goes
    to the host (room there) or is dropped and prefilled again with its round (no room)."""
    core = _core(cap=1000, host_tokens=host_tokens)
    a, b = DecodeSession("a"), DecodeSession("b")
    for s, n in ((a, 500), (b, 400)):
        assert core.round_ready(_ready(s, 0, n), 0.0) == ADMITTED
        _round(core, s, 0.1, last=False)
    assert core.kv_used == 902
    assert core.round_ready(_ready(a, 1, 200), 1.0) == WAITING
    assert core.round_ready(_ready(b, 1, 150), 1.0) == WAITING
    assert core.admit_next(1.0) is a and core.kv_overcommits == 0
    if host_tokens >= 401:
        assert b.fetch == 401 and b.l_hist == 401 and core.tier.decisions == {"offload:waiting-offload": 1}
        assert [(m.session_id, m.direction) for m in core.take_moves()] == [("b", TO_HOST)]
    else:
        assert b.l_hist == 0 and b.l_incr == 551 and core.kv_recomputed_tokens == 401
        assert core.tier.decisions == {"drop:waiting-drop": 1}
    # a's history, input and (reserved) output; b waits for its input, output and history
    assert core.kv_used == 702 and core.wait_need == 552 and core.admit_next(1.0) is None  # a runs first
    _round(core, a, 2.0, last=True)
    assert core.admit_next(2.0) is b and core.kv_used == 552 and core.wait_need == 0
    _round(core, b, 3.0, last=True)
    assert core.kv_used == 0 and not core.sessions and core.tier.host.empty and core.kv_overcommits == 0


@pytest.mark.parametrize("tier", [False, True])
def test_with_the_tier_a_round_reserves_its_output_so_decoding_never_overfills_the_device(tier):
    """Admission promises device + host with the tier, so the rounds running at once may together
    need more than the device: each round reserves its whole output when it is admitted. Without the
    tier (promises within the device) output is charged as it is made, as before."""
    core = _core(cap=1000, host_tokens=1008)
    if not tier:
        core.tier = None
    a, b = DecodeSession("a"), DecodeSession("b")
    a.round, a.l_incr, a.out = 0, 400, 300
    b.round, b.l_incr, b.out = 0, 200, 200
    assert core.round_ready(a, 0.0) == ADMITTED
    assert core.kv_used == (700 if tier else 400)
    if tier:  # 300 free: b's 200 input and 200 output do not fit until a's round ends
        assert core.round_ready(b, 0.0) == WAITING and core.admit_next(0.0) is None
        assert core.first_token(a, 1.0) and core.kv_used == 700  # made tokens were reserved
        core.schedule(1.0)
        core.update(core.run, 99.0)
        core.round_end(a, last=True)
        assert core.kv_used == 0 and core.admit_next(99.0) is b and core.kv_used == 400
    else:  # b fits its input; both outputs made at once would reach 1100 > 1000 (what the tier avoids)
        assert core.round_ready(b, 0.0) == ADMITTED and core.kv_used == 600


def test_tier_off_keeps_the_core_as_before_and_a_short_tool_keeps_its_kv():
    core = _core(cap=2000, host_tokens=1008)
    core.tier.durations.observe("calc", 0.0, 0.001)  # shorter than the round trip
    s = DecodeSession("s")
    assert core.round_ready(_ready(s, 0, 1500), 0.0) == ADMITTED
    _round(core, s, 0.1, last=False)
    core.tier_pause(s, 0.1, "calc")
    assert core.tier.decisions == {"keep:short-tool": 1} and core.kv_used == 1501 and s in core.evictable
    assert core.round_ready(_ready(s, 1, 10), 0.2) == ADMITTED and not core.evictable
    _round(core, s, 0.3, last=True)
    assert core.kv_used == 0 and core.tier.host.empty and core.take_moves() == []
    off = DecodeCore("decode-0", 1, P, make_queue("fcfs", P, SLO(1.0, 0.1), 1), kv_capacity_tokens=10)
    assert off.tier is None and off.take_moves() == []


def test_a_session_dropped_while_on_host_releases_its_host_blocks():
    core = _core(cap=1200, host_tokens=1008)
    core.tier.durations.observe("search", 0.0, 60.0)
    s = DecodeSession("s")
    assert core.round_ready(_ready(s, 0, 1000), 0.0) == ADMITTED
    _round(core, s, 0.1, last=False)
    core.tier_pause(s, 0.1, "search")
    assert core.kv_used == 0 and core.tier.host.used_blocks == 63
    assert core.drop(s) is False and core.tier.host.empty and core.kv_used == 0 and not core.sessions


def _sim_profile(cap: int):
    from tests.unit.test_sim import _profile
    return _profile(cap=cap)


def test_simulator_fills_the_pool_with_idle_sessions_and_every_one_completes():
    """Item 5 through the simulator: 4 sessions idle in 30 s tool calls fill a 5000-token pool; 3 new
    ones arriving together meanwhile are admitted at once (idle KV goes to the host or is dropped), and
    every idle session completes afterwards."""
    prof = _sim_profile(cap=5000)
    idle = [Session(f"idle-{i}", 0.01 * i, (Round(1100, 2, 30.0, "search"), Round(100, 2))) for i in range(4)]
    new = [Session(f"new-{i}", 5.0, (Round(1200, 2),)) for i in range(3)]
    kw = dict(policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1, admission="none", block_tokens=BT)
    off = simulate(idle + new, prof, kv_host_ratio=0, **kw)
    assert all(s.completed for s in off.sessions)
    assert min(s.rounds[0].first_token for s in off.sessions[4:]) > 30.0  # today: the new ones wait for KV
    on = simulate(idle + new, prof, kv_host_mb=3, **kw)  # 3 MiB: 98 blocks, 1568 tokens: one session
    assert all(s.completed for s in on.sessions) and on.stats["unfinished_sessions"] == 0
    for s in on.sessions[4:]:
        assert s.rounds[0].first_token - s.rounds[0].input_ready < 1.0  # admitted at once
    t = on.stats["kv_tier"]
    assert t["decisions"]["drop:pressure-drop"] >= 1 and t["tokens_to_host"] > 0
    assert t["tokens_from_host"] == t["tokens_to_host"] and t["bytes_to_host"] == t["tokens_to_host"] * 1000
    assert on.stats["kv_used_end"] == [0] and t["host_used_end"] == [0]
    assert on.stats["kv_recomputed_tokens"] > 0
    # each round was routed with where its KV was: the dropped one re-prefills its history (gone)
    assert on.stats["route_reasons"] == {"policy-local": 8, "policy-local+kv-host": 2, "policy-local+kv-gone": 1}


WARM_UP = 4


def _after_warm_up(sessions: list) -> list:
    """``sessions`` 62 s later, after ``WARM_UP`` sessions like them (a 60 s call, to another tool)
    that leave admission the tool calls its estimate of the KV on host needs
    (``ampd.policy.offshare``, 4 calls)."""
    warm = [Session(f"w-{i}", 0.5 * i, (Round(1100, 2, 60.0, "warm"), Round(100, 2))) for i in range(WARM_UP)]
    return warm + [dataclasses.replace(s, arrival=s.arrival + 62.0) for s in sessions]


def test_kv_admission_counts_the_host_pool_and_never_overcommits_the_device():
    """Item 2 of the kv admission: with the tier, the default admission (kv, whole sessions promised)
    promises device + host once it has seen sessions idle in long tools (ampd.policy.offshare: the
    host's share, here all of it); sessions idle in long tools go to the host, so sessions that today wait
    past the admission wait and are refused (kv-full) are admitted, the device pool is never
    overcommitted, and every admitted session completes."""
    prof = _sim_profile(cap=5000)
    sess = _after_warm_up([Session(f"s-{i}", 0.5 * i, (Round(1100, 2, 60.0, "search"), Round(100, 2)))
                           for i in range(7)])
    kw = dict(policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1, block_tokens=BT, admission_wait=5.0)
    off = simulate(sess, prof, kv_host_ratio=0, **kw)
    assert off.stats["admission_refused"].get("kv-full", 0) >= 3  # 4 sessions' promises fill 5000 tokens
    on = simulate(sess, prof, kv_host_mb=4, **kw)  # 4 MiB: 262 blocks, 4192 tokens: 3 sessions more
    assert on.stats["admission_refused"] == {}
    # the same sessions with no tool call seen yet: admission promises the device only
    cold = simulate(sess[WARM_UP:], prof, kv_host_mb=4, **kw)
    assert cold.stats["admission_refused"] == off.stats["admission_refused"]
    assert all(s.completed for s in on.sessions) and on.stats["unfinished_sessions"] == 0
    assert on.stats["kv_overcommits"] == 0 and on.stats["kv_used_end"] == [0]
    assert on.stats["kv_tier"]["host_used_end"] == [0] and on.stats["kv_tier"]["tokens_to_host"] > 0


def test_simulator_routes_with_the_kv_location_and_a_remote_first_token_waits_for_the_fetch():
    """Rounds whose KV is on host are routed with it (``+kv-host`` reasons, ``PrefillTask.kv_state``):
    remote, the prefill worker reads the host copy while the fetch runs; every session completes."""
    prof = _sim_profile(cap=5000)
    sess = _after_warm_up([Session(f"s-{i}", 0.5 * i, (Round(1100, 2, 60.0, "search"), Round(100, 2)))
                           for i in range(7)])
    kw = dict(policy="ampd", prefill="tp1*1", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1, block_tokens=BT)
    off = simulate(sess, prof, kv_host_ratio=0, **kw)
    assert not any("+kv-" in r for r in off.stats["route_reasons"])  # tier off: the reasons as before
    on = simulate(sess, prof, kv_host_mb=4, **kw)
    assert all(s.completed for s in on.sessions) and on.stats["kv_overcommits"] == 0
    reasons = on.stats["route_reasons"]
    assert reasons.get("prefill-slack+kv-host", 0) == on.stats["kv_tier"]["decisions"]["offload:unknown-tool"] >= 1
    # the remote prefill reads the history (t_kv, as long as the fetch) while the fetch runs: no
    # fetched round takes longer than a resident one would (read + compute + write back)
    worst = prof.t_kv(1102, 1, 1) + prof.t_pre(1, 1102, 100) + prof.t_kv(100, 1, 1)
    assert max(s.rounds[1].first_token - s.rounds[1].input_ready for s in on.sessions) == pytest.approx(worst)


def test_simulator_a_remote_round_behind_a_busy_host_link_gets_its_first_token_when_its_kv_is_back():
    """x's tool result arrives just after big's 100k-token offload started on the host link: x's own
    fetch (2k tokens) queues behind it, longer than x's remote prefill. The prefill is put off to end
    as the KV is back (it does not hold the prefill worker meanwhile) and x's first token comes when
    the link is done: big's offload end + x's fetch."""
    prof = _sim_profile(cap=150000)
    sess = [Session("x", 0.0, (Round(1000, 2, 10.122, "calc"), Round(100, 2))),
            Session("big", 0.001, (Round(100000, 2, 600.0, "search"), Round(100, 2)))]
    kw = dict(policy="ampd", prefill="tp1*1", decode="tp1*1", ttft_slo_s=50, itl_slo_s=1, block_tokens=BT,
              kv_offload_pressure=0.0)
    on = simulate(sess, prof, kv_host_mb=200, **kw)
    x, big = on.sessions
    big_end = big.rounds[1].input_ready - 600.0  # its round 0 ended: its offload starts
    assert big_end < x.rounds[1].input_ready < big_end + prof.t_kv(100002, 1, 1)
    remote = prof.t_kv(1002, 1, 1) + prof.t_pre(1, 1002, 100) + prof.t_kv(100, 1, 1)
    back = big_end + prof.t_kv(100002, 1, 1) + prof.t_kv(1002, 1, 1)
    assert back - x.rounds[1].input_ready > remote  # the fetch is the longer: the prefill waits
    assert not x.rounds[1].local and x.rounds[1].first_token == pytest.approx(back)
    assert on.stats["route_reasons"]["prefill-slack+kv-host"] == 2 and all(s.completed for s in on.sessions)


def test_simulator_tier_on_by_default_off_at_ratio_0_and_a_host_pool_too_small_is_refused():
    prof = _sim_profile(cap=5000)
    s = [Session("a", 0.0, (Round(1000, 2, 1.0), Round(100, 2)))]
    kw = dict(policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1)
    assert simulate(s, prof, **kw).stats["kv_tier"]["decisions"] == {"keep:no-pressure": 1}  # ratio 1: on
    assert "kv_tier" not in simulate(s, prof, kv_host_ratio=0, **kw).stats
    with pytest.raises(HostPoolTooSmall, match="kv-host-mb 0.5"):
        simulate(s, prof, kv_host_mb=0.5, **kw)  # 0.5 MiB < 1104 tokens x 1000 bytes


def test_simulator_sizes_the_tier_by_the_ratio_as_the_same_pool_in_mib():
    """--kv-host-ratio sizes each decode worker's host pool from its device pool, as live
    (ampd.policy.hostpool.size_host_pool): ratio 1 of a 5000-token pool at 1000 bytes a token runs as
    --kv-host-mb 5000*1000/MiB; a ratio too small for one session (the device pool) is off, not
    refused; with prefix sharing on (these rounds carry no hash_ids, so nothing is shared) the ratio-sized
    tier acts as without it."""
    prof = _sim_profile(cap=5000)
    sess = [Session(f"s-{i}", 0.5 * i, (Round(1100, 2, 60.0, "search"), Round(100, 2))) for i in range(7)]
    kw = dict(policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1, block_tokens=BT, admission_wait=5.0)
    ratio = simulate(sess, prof, kv_host_ratio=1, **kw)
    mib = simulate(sess, prof, kv_host_mb=5000 * 1000 / 2**20, **kw)
    assert ratio.stats["kv_tier"]["tokens_to_host"] > 0
    assert [s.rounds for s in ratio.sessions] == [s.rounds for s in mib.sessions]
    assert ratio.stats["kv_tier"] == mib.stats["kv_tier"]
    off = simulate(sess, prof, kv_host_ratio=0, **kw)
    assert "kv_tier" not in off.stats and "kv_tier" not in simulate(sess, prof, kv_host_ratio=0.5, **kw).stats
    assert [s.rounds for s in simulate(sess, prof, kv_host_ratio=0.5, **kw).sessions] == [s.rounds for s in off.sessions]
    assert simulate(sess, prof, kv_host_ratio=1, prefix_sharing=True, **kw).stats["kv_tier"] == mib.stats["kv_tier"]


def test_prefetch_starts_before_the_expected_end_only_into_spare_blocks():
    core = _core(cap=1200, host_tokens=1008)
    core.tier.prefetch_early = True
    core.tier.durations.observe("search", 0.0, 60.0)
    s = DecodeSession("s")
    assert core.round_ready(_ready(s, 0, 1000), 0.0) == ADMITTED
    _round(core, s, 0.1, last=False)
    core.tier_pause(s, 0.1, "search")
    core.take_moves()
    at = core.tier_prefetch_at(s)
    assert at == pytest.approx(0.1 + 60.0 - P.t_kv(1001, 1, 1) - core.tier.cfg.margin_s)
    other = DecodeSession("o")
    assert core.round_ready(_ready(other, 0, 1100), 1.0) == ADMITTED  # 100 blocks left: not enough
    assert core.tier_prefetch(s, at - 1.0) is False and core.tier_prefetch(s, at) is False
    _round(core, other, 2.0, last=True)
    assert core.tier_prefetch(s, at) is True and s.fetch == 0 and core.kv_used == 1001 and s in core.evictable
    assert [(m.direction, m.reason) for m in core.take_moves()] == [(FROM_HOST, "expected-end")]
    assert core.tier.decisions["prefetch:expected-end"] == 1 and core.tier_prefetch_at(s) is None
    assert core.round_ready(_ready(s, 1, 50), at + 0.2) == ADMITTED and core.take_moves() == []  # already back
    _round(core, s, at + 0.3, last=True)
    assert core.kv_used == 0 and core.tier.host.empty


def test_simulator_a_round_waits_only_for_the_offloads_whose_blocks_it_needs():
    """An offload frees its device blocks in the accounting at once, but they hold its KV until the
    copy ends: a round admitted while offloads are in flight waits for the first ones that cover what
    the accounting left spare, and not at all while the spare covers them."""
    from collections import deque
    from types import SimpleNamespace
    from ampd.sim.tiering import Tiering
    d = SimpleNamespace(kv_cap=1000, kv_used=600, offloads=deque([(1.0, 100), (2.0, 300), (3.0, 200)]))
    assert Tiering.tier_room_at(d, 0.5) == 2.0  # 600 in flight, 400 spare: the first 200 must land
    d.kv_used = 400
    assert Tiering.tier_room_at(d, 0.5) == 0.5  # 600 spare: nobody waits
    d.kv_used = 900
    assert Tiering.tier_room_at(d, 1.5) == 3.0 and list(d.offloads) == [(2.0, 300), (3.0, 200)]  # done ones go
    assert Tiering.tier_room_at(d, 3.0) == 3.0 and not d.offloads


def test_a_running_rounds_output_is_due_until_made_so_a_live_pool_count_leaves_it_room():
    """With the tier a round's whole output is charged at admission, and a live pool reserves it a
    token a step: ``output_due`` is the part not made yet (the live driver takes it off the pool's
    free space before ``sync_kv_free``), counted down by the first token and each step, 0 once the
    round ends, stops early or is dropped; without the tier nothing is due (charged as made)."""
    core = _core(cap=1000, host_tokens=1008)
    core.step_by_step = True  # a live driver's core
    a, b = DecodeSession("a"), DecodeSession("b")
    a.round, a.l_incr, a.out = 0, 100, 5
    b.round, b.l_incr, b.out = 0, 100, 6
    assert core.output_due(a) == 0  # not admitted
    assert core.round_ready(a, 0.0) == ADMITTED and core.round_ready(b, 0.0) == ADMITTED
    assert (core.output_due(a), core.output_due(b)) == (5, 6) and core.kv_used == 211
    # the live pool holds the two inputs; the core admits by its free space less the outputs due
    core.sync_kv_free(1000 - 200 - core.output_due(a) - core.output_due(b))
    assert core.kv_cap - core.kv_used == 789
    c = DecodeSession("c")  # 790 more: it would fit the pool's 800 free tokens, not beside the outputs due
    c.round, c.l_incr, c.out = 0, 780, 10
    assert core.round_ready(c, 0.0) == WAITING and core.output_due(c) == 0
    assert core.first_token(a, 1.0) and core.output_due(a) == 4
    core.schedule(1.0)  # a joins the batch
    for k in (1, 2):
        core.update(core.run, 1.0 + k)
        assert core.output_due(a) == 4 - k and core.output_due(b) == 6
        core.schedule(1.0 + k)
    assert core.first_token(b, 3.5) and core.output_due(b) == 5
    core.stop_early(a, 3)  # EOS at its third token: the rest of its output is due no more
    assert core.output_due(a) == 0 and core.kv_used == 100 + 3 + 100 + 6
    core.round_end(a, last=True)
    assert core.output_due(a) == 0 and core.kv_used == 106
    assert core.drop(b) and core.output_due(b) == 0 and core.kv_used == 0
    assert not core.drop(c) and core.wait_need == 0  # (never admitted)
    off = _core(cap=1000, host_tokens=1008)
    off.tier = None
    c = DecodeSession("c")
    c.round, c.l_incr, c.out = 0, 100, 5
    assert off.round_ready(c, 0.0) == ADMITTED and off.first_token(c, 1.0) and off.output_due(c) == 0


def test_a_round_ending_at_its_first_token_frees_the_output_reserved_beyond_it():
    """Live: EOS or a stop at the first token ends a round admitted for more (``s.out`` its bound):
    with the tier, the output charged at admission beyond that token is released (it leaked into
    ``kv_used`` before); without the tier only the token is charged, as ever."""
    for tier in (True, False):
        core = _core(cap=1000, host_tokens=1008)
        if not tier:
            core.tier = None
        s = DecodeSession("s")
        s.round, s.l_incr, s.out = 0, 100, 50
        assert core.round_ready(s, 0.0) == ADMITTED and core.kv_used == (150 if tier else 100)
        assert core.first_token(s, 1.0, last=True) is False
        assert s.out == 1 and core.kv_used == 101 and core.output_due(s) == 0
        core.round_end(s, last=True)
        assert core.kv_used == 0


def test_simulator_marks_the_rounds_the_live_worker_cannot_claim_from_host_and_times_them_serially():
    """ampd/sim/tiering.py as services/decode/hostread.py: a round on host fetches first
    (``PrefillTask.kv_fetch_first``) with a pinned shared prefix, an early prefetch still moving, or no
    device room until offloads in flight end; otherwise a remote prefill overlaps the fetch. A
    fetch-first remote prefill is submitted once the KV is back, not to end then."""
    from collections import deque
    from types import SimpleNamespace as NS

    from ampd.policy import PrefillTask
    from ampd.sim.tiering import Tiering

    class Run(Tiering):
        open_s = dispatch_s = 0.0

        def __init__(self):
            self.routed, self.pushed = [], []
            self.sim = NS(profile=P)

        def route(self, st, now, kv=None):
            self.routed.append(kv)

        def push(self, at, code, obj):
            self.pushed.append(at)

    def case(pinned=0, early=0.0, offloads=()):
        d = NS(link=0.0, offloads=deque(offloads), kv_cap=1000, kv_used=1000, take_moves=lambda: [])
        st = NS(dw=d, round=1, l_hist=500, kv_back=12.0, kv_early=early, pinned=pinned)
        run = Run()
        run.tier_dispatch(st, 10.0)
        return run.routed[-1]

    assert case() == ("host", pytest.approx(2.0), False)  # claimable: the overlap
    assert case(pinned=256)[2] and case(early=12.0)[2]
    assert case(early=9.0) == ("host", pytest.approx(2.0), False)  # that prefetch ended before the round
    assert case(offloads=[(11.0, 300)]) == ("host", pytest.approx(2.0), True)  # room at 11.0
    run, p = Run(), NS(tp=1)
    task = PrefillTask("s", 1, 500, 100, 10.0, "d0", 1, "host", 2.0)
    st = NS()
    assert run.tier_remote_later(st, p, task, 10.0, 2.0)
    assert run.pushed[-1] == pytest.approx(12.0 - P.t_kv(500, 1, 1) - P.t_pre(1, 500, 100) - P.t_kv(100, 1, 1))
    task.kv_fetch_first = True
    assert run.tier_remote_later(st, p, task, 10.0, 2.0) and run.pushed[-1] == 12.0


def test_simulator_a_round_whose_early_prefetch_still_moves_fetches_first():
    """--kv-prefetch-early: x's calc call ends 9.945 s in, while the prefetch its expected end (10 s,
    from the calls before it) started is still moving. Live, that prefetch holds the host copy (not
    claimed): the round waits for it, then its remote prefill runs. The simulator does the same:
    first token = what is left of the prefetch + read + compute + write back (the overlap gave the
    remote prefill's time alone)."""
    prof = _sim_profile(cap=50000)
    warm = [Session(f"w-{i}", 2.0 * i, (Round(1100, 2, 10.0, "calc"), Round(100, 2))) for i in range(6)]
    x = Session("x", 40.0, (Round(4000, 2, 9.945, "calc"), Round(100, 2)))
    kw = dict(policy="ampd", prefill="tp1*1", decode="tp1*1", ttft_slo_s=50, itl_slo_s=1, block_tokens=BT,
              kv_offload_pressure=0.0, kv_prefetch_early=True, kv_host_mb=200)
    res = simulate(warm + [x], prof, **kw)
    r = [s for s in res.sessions if s.session_id == "x"][0].rounds[1]
    remote = prof.t_kv(4002, 1, 1) + prof.t_pre(1, 4002, 100) + prof.t_kv(100, 1, 1)
    assert res.stats["kv_tier"]["decisions"]["prefetch:expected-end"] == 2 and not r.local
    assert remote + 0.001 < r.first_token - r.input_ready <= remote + prof.t_kv(4002, 1, 1) + 1e-9
