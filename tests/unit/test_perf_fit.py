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


def test_nnls_matches_the_unconstrained_answer_when_it_is_nonnegative_and_clamps_otherwise():
    import numpy as np

    from ampd.perf.fit import nnls

    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 5))
    x = nnls(a, a @ np.array([1.0, 0.5, 2.0, 0.25, 3.0]))
    assert np.allclose(x, [1.0, 0.5, 2.0, 0.25, 3.0], atol=1e-9)
    x = nnls(a, a @ np.array([1.0, -2.0, 2.0, 0.0, 3.0]))
    assert (x >= 0).all() and x[1] == 0.0


def test_monotone_fit_of_noisy_flat_then_linear_times_is_continuous_nondecreasing_and_close():
    import random

    rnd = random.Random(3)
    true = lambda lh, li: 0.02 + 1e-3 * max(0, li - 16) + 2e-5 * lh  # noqa: E731 - flat up to a knee
    pts = [(lh, li) for lh in (0, 512, 1024) for li in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
    samples = [(lh, li, true(lh, li) * (1 + 0.06 * (rnd.random() - 0.5))) for lh, li in pts]
    P, hist, attn = fit_prefill(samples, monotone=True)
    assert all(b >= 0 for b in P.beta) and all(abs(j) < 1e-12 for j in P.discontinuities())
    assert hist >= 0 and attn >= 0
    for lh, li in [(256, 3), (768, 11), (768, 181)]:  # between grid points: relative error small
        assert P(li) + hist * lh + attn * li * (lh + li / 2) == pytest.approx(true(lh, li), rel=0.08)
    K = fit_kv([(x, 0.001 + 1e-9 * x) for x in (1e3, 1e4, 1e5, 1e6, 1e7)], monotone=True)
    assert K(3e5) == pytest.approx(0.001 + 3e-4, rel=1e-6)
