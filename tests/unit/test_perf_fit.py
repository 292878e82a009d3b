"""The profiler's fitting core: exact on data of the model's own form, breakpoints with two x per piece."""
from __future__ import annotations

import pytest

from ampd.perf import load_profile
from ampd.perf.fit import breakpoints_for, fit_decode, fit_kv, fit_prefill, rel_errors


def test_breakpoints_give_every_piece_two_measured_values():
    assert breakpoints_for([1, 2, 4, 8, 16]) == (1, 4, 16)
    assert breakpoints_for([1, 2, 4, 8]) == (1, 4, 8)
    assert breakpoints_for([5, 1]) == (1, 5)
    with pytest.raises(ValueError, match="2 distinct"):
        breakpoints_for([3, 3])


def test_fits_recover_a_shipped_profile_exactly_at_its_points():
    p = load_profile("mixtral-8x7b@h20")
    pts = [(lh, li) for lh in (0, 1000, 9000) for li in (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048)]
    P, hist, attn = fit_prefill([(lh, li, p.t_pre(4, lh, li)) for lh, li in pts])
    assert hist == pytest.approx(p.tp_models[4].pre_hist_s_per_token, rel=1e-6)
    assert attn == pytest.approx(p.tp_models[4].pre_attn_s_per_token2, rel=1e-6)
    for lh, li in pts:
        got = P(li) + hist * lh + attn * li * (lh + li / 2)
        assert got == pytest.approx(p.t_pre(4, lh, li), rel=1e-6)
    dec = [(b, b * c) for c in (100, 3000) for b in (1, 2, 4, 8, 16, 32)]  # pairs: each piece exact
    D, ctx = fit_decode([(b, x, p.t_dec(4, b, x)) for b, x in dec])
    assert ctx == pytest.approx(p.tp_models[4].dec_ctx_s_per_token, rel=1e-6)
    assert all(D(b) + ctx * x == pytest.approx(p.t_dec(4, b, x), rel=1e-6) for b, x in dec)
    K = fit_kv([(n * 1e4, p.t_kv(n, 4, 4)) for n in (10, 100, 1000, 10000)])
    assert K(1e6) == pytest.approx(p.t_kv(100, 4, 4), rel=1e-6)


def test_negative_shared_term_is_fixed_at_zero():
    # times that do not grow with the history: the history coefficient must not go negative
    samples = [(lh, li, 0.01 + 1e-5 * li - 1e-9 * lh) for lh in (0, 100, 200) for li in (1, 2, 4, 8)]
    _, hist, attn = fit_prefill(samples)
    assert hist == 0.0 and attn >= 0.0


def test_rel_errors():
    e = rel_errors([(1.1, 1.0), (1.0, 1.0)])
    assert e.max_rel == pytest.approx(0.1) and e.mean_rel == pytest.approx(0.05) and e.points == 2
