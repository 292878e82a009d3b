"""The share of admitted KV that can be off the device (ampd.policy.offshare): what admission's
promise_room lets a host KV tier stand in for."""

import pytest

from ampd.perf import load_profile
from ampd.policy.kvtier import host_transfer_s
from ampd.policy.offshare import OffDeviceShare, OffDeviceShareConfig, off_device_s

COST = load_profile("llama3.1-70b@h20")


def test_a_call_shorter_than_the_moves_keeps_its_kv_on_the_device():
    assert off_device_s(1.0, 0.8, 0.05) == pytest.approx(0.2)
    assert off_device_s(0.85, 0.8, 0.05) == 0.0  # not longer than the round trip and the margin
    assert off_device_s(0.5, 0.8, 0.05) == 0.0


def test_no_estimate_until_enough_tool_calls():
    est = OffDeviceShare(OffDeviceShareConfig(window_s=100.0, min_tools=2))
    assert est.share(0.0) is None
    est.round_ended(0.0, 10.0, 1000, None, 0, COST, 4)  # a first round: no tool call before it
    assert est.share(10.0) is None
    est.round_ended(40.0, 50.0, 2000, 10.0, 1000, COST, 4)
    assert est.share(50.0) is None  # one call
    est.round_ended(80.0, 90.0, 3000, 50.0, 2000, COST, 4)
    trip1, trip2 = 2 * host_transfer_s(COST, 1000, 4), 2 * host_transfer_s(COST, 2000, 4)
    off = 1000 * (30 - trip1) + 2000 * (30 - trip2)
    total = 1000 * 10 + 1000 * 30 + 2000 * 10 + 2000 * 30 + 3000 * 10
    assert est.share(90.0) == pytest.approx(off / total)
    # the window moves on: the first round and call are out (before 200 - 100), the rest stays
    assert est.share(140.0 + 1e-6) is None  # only the call ending at 80 is left


def test_short_calls_give_no_host_room_and_long_ones_most():
    assert 2 * host_transfer_s(COST, 100_000, 4) > 0.2 + 0.05
    short, long_ = OffDeviceShare(), OffDeviceShare()
    t = 0.0
    for _ in range(8):
        # 10 s rounds of a 100k-token session, whose move to host and back takes longer than 0.2 s
        for est, tool in ((short, 0.2), (long_, 100.0)):
            est.round_ended(t, t + 10.0, 100_000, t - tool, 100_000, COST, 4)
        t += 20.0
    assert short.share(t) == 0.0
    assert 0.85 < long_.share(t) < 100 / 110


def test_bad_samples_are_ignored_and_bad_config_refused():
    est = OffDeviceShare(OffDeviceShareConfig(min_tools=1))
    est.tool(1.0, 100, float("nan"), 0.0)
    est.tool(1.0, 0, 5.0, 5.0)
    est.round(1.0, 100, -1.0)
    assert est.share(1.0) is None
    with pytest.raises(ValueError, match="window_s"):
        OffDeviceShareConfig(window_s=0)
    with pytest.raises(ValueError, match="min_tools"):
        OffDeviceShareConfig(min_tools=0)
