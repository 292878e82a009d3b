"""The tool-aware KV tier policy (ampd.policy.kvtier) and the per-tool duration estimates
(ampd.policy.tooldur), with hand-computed numbers."""

import math

import pytest

from ampd.perf import load_profile
from ampd.policy.kvtier import (
    DROP,
    KEEP,
    OFFLOAD,
    KVTierConfig,
    PoolState,
    Prefetch,
    ToolPause,
    decide,
    effective_tool_s,
    host_transfer_s,
    prefetch_plan,
    should_prefetch,
    transfer_fn,
)
from ampd.policy.tooldur import ToolDurations, ToolDurationsConfig

CFG = KVTierConfig(offload_pressure=0.7, margin_s=0.05)


def pause(expected_s=10.0, kv_blocks=100, offload_s=0.2, prefetch_s=0.2, reprefill_s=3.5):
    return ToolPause("s1", "search", expected_s, kv_blocks, offload_s, prefetch_s, reprefill_s)


# ---------------------------------------------------------------------------- tool durations
def test_tool_durations_windowed_mean_per_tool():
    td = ToolDurations(ToolDurationsConfig(window_s=60.0))
    assert td.expected_s("search", 0.0) is None
    td.observe("search", 10.0, 2.0)
    td.observe("search", 20.0, 4.0)
    td.observe("compile", 20.0, 30.0)
    assert td.expected_s("search", 20.0) == 3.0
    assert td.expected_s("compile", 20.0) == 30.0
    # at 75 the sample at 10 left the window: only the 4.0 one counts
    assert td.expected_s("search", 75.0) == 4.0
    # at 200 both left: the last observed duration is used
    assert td.expected_s("search", 200.0) == 4.0


def test_tool_durations_unnamed_is_replay_and_bad_samples_are_ignored():
    td = ToolDurations()
    td.observe("", 1.0, 5.0)
    assert td.expected_s("replay", 1.0) == 5.0
    assert td.expected_s("", 1.0) == 5.0
    td.observe("x", 1.0, -1.0)
    td.observe("x", 1.0, math.nan)
    td.observe("x", 1.0, math.inf)
    assert td.expected_s("x", 1.0) is None


def test_tool_durations_table_is_bounded_lru():
    td = ToolDurations(ToolDurationsConfig(max_tools=2))
    td.observe("a", 0.0, 1.0)
    td.observe("b", 0.0, 2.0)
    td.observe("a", 1.0, 1.0)  # a is now the most recent
    td.observe("c", 2.0, 3.0)  # drops b, the least recently seen
    assert len(td) == 2
    assert td.expected_s("b", 2.0) is None
    assert td.expected_s("a", 2.0) == 1.0
    with pytest.raises(ValueError, match="max_tools"):
        ToolDurations(ToolDurationsConfig(max_tools=0))


# ----------------------------------------------------------------------------------- decide
def test_keep_when_no_pressure():
    # 600 used + 0 waiting of 1000 = 0.6 < 0.7
    d = decide(pause(), PoolState(1000, 600, 0, 5000), CFG)
    assert (d.action, d.reason) == (KEEP, "no-pressure")
    assert d.estimates["pressure"] == 0.6


def test_pressure_counts_waiting_rounds():
    # 600 used + 150 waiting = 0.75 >= 0.7: a 10 s tool with a 0.45 s round trip is offloaded
    d = decide(pause(), PoolState(1000, 600, 150, 5000), CFG)
    assert (d.action, d.reason) == (OFFLOAD, "long-tool")
    assert d.estimates["round_trip_s"] == pytest.approx(0.45)


def test_short_tool_keeps():
    # round trip 0.2 + 0.2 + 0.05 = 0.45 s > 0.4 s tool
    d = decide(pause(expected_s=0.4), PoolState(1000, 900, 0, 5000), CFG)
    assert (d.action, d.reason) == (KEEP, "short-tool")
    assert decide(pause(expected_s=0.45), PoolState(1000, 900, 0, 5000), CFG).action == OFFLOAD


def test_reprefill_cheaper_drops():
    d = decide(pause(reprefill_s=0.1), PoolState(1000, 900, 0, 5000), CFG)
    assert (d.action, d.reason) == (DROP, "reprefill-cheaper")


def test_host_full():
    # 99 host blocks free < 100 needed: keep (evictable later) unless rounds wait for blocks
    assert decide(pause(), PoolState(1000, 900, 0, 99), CFG).reason == "host-full"
    d = decide(pause(), PoolState(1000, 900, 10, 99), CFG)
    assert (d.action, d.reason) == (DROP, "host-full-demand")


def test_unknown_tool_offloads_when_host_has_room():
    assert decide(pause(expected_s=None), PoolState(1000, 900, 0, 100), CFG).reason == "unknown-tool"
    d = decide(pause(expected_s=None), PoolState(1000, 900, 0, 0), CFG)
    assert (d.action, d.reason) == (KEEP, "unknown-tool-host-full")
    assert "expected_s" not in d.estimates


def test_no_kv_keeps_and_config_checks():
    assert decide(pause(kv_blocks=0), PoolState(10, 10, 10, 0), CFG).reason == "no-kv"
    with pytest.raises(ValueError, match="offload_pressure"):
        KVTierConfig(offload_pressure=1.5)
    with pytest.raises(ValueError, match="margin_s"):
        KVTierConfig(margin_s=-1)


def test_decision_with_profile_transfer_times():
    # llama3.1-70b@h20 at TP 4: 32 blocks of 256 tokens = 8192 tokens, ~0.030 s each way, 3.5 s
    # to prefill again; a 2 s tool call under pressure is offloaded
    prof = load_profile("llama3.1-70b@h20")
    move = transfer_fn(prof, 4, 256)
    assert move(32) == pytest.approx(host_transfer_s(prof, 8192, 4)) == pytest.approx(0.0303, abs=1e-3)
    assert host_transfer_s(prof, 0, 4) == 0.0
    p = ToolPause("s1", "search", 2.0, 32, move(32), move(32), prof.t_pre(4, 0, 8192))
    assert decide(p, PoolState(100, 80, 0, 64), CFG).action == OFFLOAD


# ----------------------------------------------------------------------------------- hints
def test_hint_overrides_estimate_and_is_clamped():
    assert effective_tool_s(10.0, None, CFG) == 10.0
    assert effective_tool_s(10.0, 2.0, CFG) == 2.0
    assert effective_tool_s(None, 2.0, CFG) == 2.0
    assert effective_tool_s(10.0, -5.0, CFG) == 0.0
    assert effective_tool_s(10.0, 1e12, CFG) == CFG.max_hint_s
    assert effective_tool_s(10.0, math.nan, CFG) == 10.0


# -------------------------------------------------------------------------------- prefetch
def test_prefetch_plan():
    # tool at 100 s expected 10 s, 0.2 s to fetch back, 0.05 s margin: start at 109.75
    plan = prefetch_plan(100.0, 10.0, 0.2, CFG)
    assert (plan.at, plan.reason) == (pytest.approx(109.75), "expected-end")
    assert prefetch_plan(100.0, 0.1, 0.2, CFG).at == 100.0  # not before the tool started
    assert prefetch_plan(100.0, None, 0.2, CFG) == Prefetch(None, "on-result")


def test_should_prefetch():
    plan = Prefetch(109.75, "expected-end")
    room = PoolState(1000, 800, 50, 0)  # 150 spare blocks
    assert should_prefetch(109.0, plan, False, 100, room) == ""
    assert should_prefetch(109.75, plan, False, 100, room) == "expected-end"
    # a speculative prefetch never takes blocks a waiting round needs
    assert should_prefetch(109.75, plan, False, 100, PoolState(1000, 800, 150, 0)) == ""
    # the result arrived: at once, whatever the room (it goes through admission)
    assert should_prefetch(101.0, plan, True, 100, PoolState(1000, 1000, 500, 0)) == "result-arrived"
    assert should_prefetch(200.0, Prefetch(None, "on-result"), False, 1, room) == ""
