"""The profiler's held-out split and the checks that refuse a profile (ampd.profiler.checks)."""
from __future__ import annotations

import pytest

from ampd.perf.fit import fit_kv
from ampd.perf.piecewise import Piecewise
from ampd.profiler.checks import (error_problems, geo_midpoints, held_out, lin_midpoints, plan_points,
                                  shape_problems)


def test_held_out_points_are_never_grid_points():
    plan = plan_points(l_hist=(0, 512, 1024), l_incr=(1, 4, 16, 64), batch=(1, 2, 4, 8), context=(128, 640),
                       capacity=10**6, max_context=8192)
    assert geo_midpoints((1, 4, 16, 64)) == [2, 8, 32]
    assert lin_midpoints((0, 512, 1024)) == [256, 768]
    assert not set(plan.hpre) & set(plan.pre) and not set(plan.hdec) & set(plan.dec)
    # neither coordinate of a held-out point lies on the fitted grid
    assert {lh for lh, _ in plan.hpre} == {256, 768} and {li for _, li in plan.hpre} == {2, 8, 32}
    assert plan.hdec == [(b, 384) for b in geo_midpoints((1, 2, 4, 8))]
    assert len(plan.pre) == 12 and len(plan.dec) == 8


def test_points_beyond_the_capacity_or_the_model_are_left_out():
    plan = plan_points(l_hist=(0, 512), l_incr=(64, 256), batch=(1, 4, 16), context=(128, 512),
                       capacity=2048, max_context=600)
    assert (512, 256) not in plan.pre and (512, 64) in plan.pre      # 768 tokens > max_context 600
    assert (16, 512) not in plan.dec and (4, 512) in plan.dec        # 8192 KV tokens > capacity 2048
    assert all(b * c <= 2048 for b, c in plan.hdec)


def test_held_out_error_names_the_worst_points():
    err = held_out([(1, 0.10), (2, 0.20), (3, 0.30)], lambda x: 0.1 * x * (1.5 if x == 3 else 1.0))
    assert err.points == 3 and err.max_rel == pytest.approx(0.5) and err.mean_rel == pytest.approx(0.5 / 3)
    assert err.worst[0][0] == 3
    (msg,) = error_problems("tp.1.t_dec", err, ("batch",), 0.15)
    assert msg.startswith("tp.1.t_dec: held-out error 50.0%") and "batch=3: measured 300.00 ms, model 450.00 ms" in msg
    assert error_problems("tp.1.t_dec", err, ("batch",), 0.6) == []
    (none,) = error_problems("t_kv", held_out([], lambda x: x), ("tokens",), 0.15)
    assert "no held-out point" in none


def test_a_kv_fit_with_a_negative_slope_is_refused_naming_the_piece_and_its_points():
    # what a --reps 1 run on a busy box measured: a slow small transfer, so the first piece slopes down
    # and the fitted function is negative at small sizes (the t_kv(45 tokens) = -12 ms)
    samples = [(1e5, 0.030), (4e5, 0.004), (1.6e6, 0.006), (6.4e6, 0.012), (2.56e7, 0.040)]
    K = fit_kv(samples)
    assert K.beta[0] < 0
    problems = shape_problems("t_kv K(bytes per link)", "bytes", K, 1e3, 0.15, samples)
    assert problems and problems[0].startswith("t_kv K(bytes per link) piece 0 [100000, 1.6e+06) bytes")
    assert "(100000, 30.00 ms), (400000, 4.00 ms)" in problems[0]


def test_negative_values_and_jumps_down_are_refused_small_dips_are_not():
    neg = Piecewise((1, 4, 16), (-0.002, 0.0), (0.001, 0.001))
    (msg,) = shape_problems("q", "tokens", neg, 1, 0.15, [(1, 0.001), (2, 0.001)])
    assert "q piece 0 [1, 4) tokens is negative: -1.000 ms at 1" in msg
    jump = Piecewise((1, 4, 16), (0.050, 0.020), (0.0, 0.001))  # 50 ms up to 4, then 24 ms at 4
    (msg,) = shape_problems("q", "tokens", jump, 1, 0.15, [(1, 0.05), (2, 0.05), (4, 0.024), (8, 0.028)])
    assert msg.startswith("q decreases at breakpoint 4 tokens") and "(4, 24.00 ms)" in msg
    dip = Piecewise((1, 4, 16), (0.0505, 0.050), (-0.0001, 0.0001))  # a flat piece 1 % down: noise
    assert shape_problems("q", "tokens", dip, 1, 0.15, []) == []
    falls = Piecewise((1, 4, 16), (0.070, 0.050), (-0.005, 0.0001))  # down 21 % over the piece
    (msg,) = shape_problems("q", "tokens", falls, 1, 0.15, [])
    assert "q piece 0 [1, 4) tokens decreases" in msg
