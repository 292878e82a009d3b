"""Unit tests for ampd.perf: profiles, cost functions, loading, fitting, derivation."""

from __future__ import annotations

import copy
import json
import random

import pytest

from ampd.perf import (Piecewise, Profile, interpolate_piecewise, list_profiles,
                       load_profile, profile_from_dict)
from ampd.perf import derive
from ampd.perf.fit import fit_piecewise
from ampd.perf.profile import PROFILES_DIR

SHIPPED = ["llama3.1-70b@h20", "mixtral-8x7b@h20", "qwen3-32b@h20", "zero@none"]
REAL = [n for n in SHIPPED if n != "zero@none"]
L_GRID = [1, 2, 3, 5, 8, 16, 28, 29, 30, 64, 100, 102, 103, 104, 200, 256, 500, 1000, 1024, 2000, 4096,
          8000, 16384, 40000, 131072, 200000]
B_GRID = [1, 2, 3, 4, 8, 16, 27, 28, 29, 32, 64, 100, 101, 102, 103, 128, 256, 512, 1000]


def real_tp_pairs():
    return [(n, tp) for n in REAL for tp in load_profile(n).tps]


# --------------------------------------------------------------------------- loading


def test_list_profiles_names_the_shipped_ones():
    assert list_profiles() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_load_by_name_and_by_path_agree(name, tmp_path):
    by_name = load_profile(name)
    assert isinstance(by_name, Profile)
    assert by_name.name == name and f"{by_name.model}@{by_name.hardware}" == name
    copy_path = tmp_path / "copy.json"
    copy_path.write_text((PROFILES_DIR / f"{name}.json").read_text())
    for arg in (copy_path, str(copy_path)):
        p = load_profile(arg)
        assert p.name == name and p.tps == by_name.tps
        assert p.kv_bytes_per_token == by_name.kv_bytes_per_token
        tp = p.tps[-1]
        assert p.t_pre(tp, 100, 300) == by_name.t_pre(tp, 100, 300)
        assert p.t_dec(tp, 8, 8000) == by_name.t_dec(tp, 8, 8000)
        assert p.t_kv(500, tp, p.tps[0]) == by_name.t_kv(500, tp, p.tps[0])


def test_unknown_name_lists_shipped_names():
    with pytest.raises(ValueError) as ei:
        load_profile("gpt-5@tpu")
    msg = str(ei.value)
    assert "gpt-5@tpu" in msg
    for n in SHIPPED:
        assert n in msg


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="nope.json"):
        load_profile(tmp_path / "nope.json")


def _shipped_doc(name="qwen3-32b@h20") -> dict:
    return json.loads((PROFILES_DIR / f"{name}.json").read_text())


def _del(d, *keys):
    for k in keys[:-1]:
        d = d[k]
    del d[keys[-1]]


def _set(d, value, *keys):
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value


@pytest.mark.parametrize("mutate, field", [
    (lambda d: _del(d, "schema_version"), "schema_version"),
    (lambda d: _set(d, 99, "schema_version"), "schema_version"),
    (lambda d: _del(d, "kv_bytes_per_token"), "kv_bytes_per_token"),
    (lambda d: _set(d, "big", "kv_bytes_per_token"), "kv_bytes_per_token"),
    (lambda d: _del(d, "tp", "2", "t_pre", "attn_s_per_token2"), "tp.2.t_pre.attn_s_per_token2"),
    (lambda d: _set(d, [0.1], "tp", "4", "t_dec", "batch", "alpha"), "tp.4.t_dec.batch.alpha"),
    (lambda d: _set(d, [5, 1], "tp", "1", "t_pre", "l_incr", "breakpoints"), "tp.1.t_pre.l_incr.breakpoints"),
    (lambda d: _set(d, -3, "tp", "8", "kv_capacity_tokens"), "tp.8.kv_capacity_tokens"),
    (lambda d: _set(d, 1.5, "tp", "8", "prefill_chunk_tokens"), "tp.8.prefill_chunk_tokens"),
    (lambda d: _set(d, "x", "tp", "1", "t_dec", "ctx_s_per_token"), "tp.1.t_dec.ctx_s_per_token"),
    (lambda d: _set(d, "max_tp", "t_kv", "links"), "t_kv.links"),
    (lambda d: _del(d, "t_kv", "bytes_per_link"), "t_kv.bytes_per_link"),
    (lambda d: _set(d, {}, "tp"), "tp"),
    (lambda d: d["tp"].__setitem__("two", d["tp"]["2"]), "tp.two"),
])
def test_malformed_file_names_file_and_field(tmp_path, mutate, field):
    doc = _shipped_doc()
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as ei:
        load_profile(path)
    msg = str(ei.value)
    assert str(path) in msg
    assert f"'{field}'" in msg


def test_invalid_json_names_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        load_profile(path)


def test_to_json_round_trips():
    p = load_profile("llama3.1-70b@h20")
    q = profile_from_dict(copy.deepcopy(p.to_json()))
    assert q.tps == p.tps
    for tp in p.tps:
        assert q.t_pre(tp, 1234, 567) == p.t_pre(tp, 1234, 567)
        assert q.t_dec(tp, 17, 40000) == p.t_dec(tp, 17, 40000)
        assert q.kv_capacity_tokens(tp) == p.kv_capacity_tokens(tp)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name", SHIPPED)
def test_unknown_tp_names_it(name):
    p = load_profile(name)
    calls = [lambda: p.t_pre(3, 0, 10), lambda: p.t_dec(3, 1, 10), lambda: p.kv_capacity_tokens(3),
             lambda: p.prefill_chunk_tokens(3), lambda: p.t_kv(10, 3, p.tps[0]),
             lambda: p.t_kv(10, p.tps[0], 3)]
    for call in calls:
        with pytest.raises(ValueError, match=r"\b3\b.*not covered"):
            call()
    with pytest.raises(ValueError, match="src_tp 3"):
        p.t_kv(10, 3, p.tps[0])
    with pytest.raises(ValueError, match="dst_tp 3"):
        p.t_kv(10, p.tps[0], 3)


def test_tp_sets_follow_memory():
    assert load_profile("llama3.1-70b@h20").tps == (2, 4, 8)
    assert load_profile("qwen3-32b@h20").tps == (1, 2, 4, 8)
    assert load_profile("mixtral-8x7b@h20").tps == (2, 4, 8)
    assert load_profile("zero@none").tps == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="tp 1"):
        derive.derive_tp(derive.MODELS["mixtral-8x7b"], derive.HARDWARE["h20"], 1)
    with pytest.raises(ValueError, match="tp 1"):
        derive.derive_tp(derive.MODELS["llama3.1-70b"], derive.HARDWARE["h20"], 1)


def test_zero_sized_work_costs_nothing_and_negative_is_rejected():
    p = load_profile("qwen3-32b@h20")
    assert p.t_pre(1, 5000, 0) == 0.0
    assert p.t_dec(1, 0, 0) == 0.0
    assert p.t_kv(0, 1, 2) == 0.0
    for call in (lambda: p.t_pre(1, 0, -1), lambda: p.t_pre(1, -1, 5), lambda: p.t_dec(1, -1, 0),
                 lambda: p.t_dec(1, 2, -5), lambda: p.t_kv(-1, 1, 1)):
        with pytest.raises(ValueError):
            call()


# --------------------------------------------------------------------------- shape of the costs


@pytest.mark.parametrize("name, tp", real_tp_pairs())
def test_t_pre_grows_with_l_incr_and_l_hist(name, tp):
    p = load_profile(name)
    for hist in (0, 1000, 30000):
        ts = [p.t_pre(tp, hist, l) for l in L_GRID]
        assert all(b > a for a, b in zip(ts, ts[1:])), (hist, ts)
    for l in (1, 50, 1000, 8000):
        ts = [p.t_pre(tp, h, l) for h in (0, 1, 100, 1000, 10000, 100000)]
        assert all(b > a for a, b in zip(ts, ts[1:])), (l, ts)
    assert all(p.t_pre(tp, 0, l) > 0 for l in L_GRID)


@pytest.mark.parametrize("name, tp", real_tp_pairs())
def test_t_dec_grows_with_batch_and_context(name, tp):
    p = load_profile(name)
    for ctx in (0, 10000, 500000):
        ts = [p.t_dec(tp, b, ctx) for b in B_GRID]
        # flat while weight-bound (dense, TP 1), rising once compute-bound
        assert all(b >= a for a, b in zip(ts, ts[1:])), (ctx, ts)
        assert ts[-1] > 2 * ts[0]
    ts = [p.t_dec(tp, 16, c) for c in (0, 16, 1600, 16000, 160000)]
    assert all(b > a for a, b in zip(ts, ts[1:]))


@pytest.mark.parametrize("name, tp", real_tp_pairs())
def test_pieces_are_continuous_at_breakpoints(name, tp):
    p = load_profile(name)
    m = p.tp_models[tp]
    for pw in (m.pre, m.dec, p.kv_transfer.bytes_per_link):
        for b, jump in zip(pw.inner, pw.discontinuities()):
            assert abs(jump) <= 1e-6 * max(pw(b), 1e-9), (b, jump)
    # and through the public API, just below and at each inner breakpoint
    for b in m.pre.inner:
        if b > 1:
            lo, hi = p.t_pre(tp, 0, b - 1e-9), p.t_pre(tp, 0, b)
            assert abs(hi - lo) <= 1e-6 * hi
    for b in m.dec.inner:
        lo, hi = p.t_dec(tp, b - 1e-9, 0), p.t_dec(tp, b, 0)
        assert abs(hi - lo) <= 1e-6 * hi


@pytest.mark.parametrize("name", REAL)
def test_t_kv_grows_with_tokens_and_links(name):
    p = load_profile(name)
    for s in p.tps:
        for d in p.tps:
            ts = [p.t_kv(n, s, d) for n in (1, 10, 100, 1000, 10000, 100000, 1000000)]
            assert all(b > a for a, b in zip(ts, ts[1:]))
            assert p.t_kv(5000, s, d) == pytest.approx(p.t_kv(5000, d, s))  # min(src, dst) links
    lo, hi = p.tps[0], p.tps[-1]
    assert p.t_kv(10000, hi, hi) < p.t_kv(10000, lo, hi)
    # alpha + bytes / (links x 25 GB/s x 0.9)
    expect = 0.0005 + 10000 * p.kv_bytes_per_token / (min(lo, hi) * 25e9 * 0.9)
    assert p.t_kv(10000, lo, hi) == pytest.approx(expect, rel=1e-6)


def test_zero_profile_is_free():
    p = load_profile("zero@none")
    for tp in p.tps:
        for l in L_GRID:
            assert p.t_pre(tp, 12345, l) == 0.0
        for b in B_GRID:
            assert p.t_dec(tp, b, 10 ** 6) == 0.0
        for d in p.tps:
            assert p.t_kv(10 ** 6, tp, d) == 0.0
        assert p.kv_capacity_tokens(tp) >= 10 ** 6
        assert p.prefill_chunk_tokens(tp) > 0


def test_spec_numbers_and_reality_checks():
    q = load_profile("qwen3-32b@h20")
    assert q.kv_bytes_per_token == 262144
    assert load_profile("llama3.1-70b@h20").kv_bytes_per_token == 327680
    assert load_profile("mixtral-8x7b@h20").kv_bytes_per_token == 131072
    assert 0.5 <= q.t_pre(1, 0, 1000) <= 0.8            # compute-bound prefill on H20
    assert 0.015 <= q.t_dec(1, 1, 1000) <= 0.03         # weight-read-bound decode step
    for name in REAL:
        p = load_profile(name)
        for tp in p.tps:
            # more GPUs: faster and more KV room; chunk fits the pause target (or is the minimum)
            if tp != p.tps[0]:
                prev = p.tps[p.tps.index(tp) - 1]
                assert p.t_pre(tp, 0, 4000) < p.t_pre(prev, 0, 4000)
                assert p.t_dec(tp, 8, 8000) < p.t_dec(prev, 8, 8000)
                assert p.kv_capacity_tokens(tp) > p.kv_capacity_tokens(prev)
            c = p.prefill_chunk_tokens(tp)
            assert c % 256 == 0 and (c == 256 or p.t_pre(tp, 0, c) <= 0.2)
    m = derive.MODELS
    assert m["llama3.1-70b"].total_params == pytest.approx(70.6e9, rel=0.01)
    assert m["qwen3-32b"].total_params == pytest.approx(32.8e9, rel=0.01)
    assert m["mixtral-8x7b"].total_params == pytest.approx(46.7e9, rel=0.01)
    assert m["mixtral-8x7b"].active_matmul_params + 2 * 32000 * 4096 == pytest.approx(12.9e9, rel=0.03)


# --------------------------------------------------------------------------- fitting


def test_fit_recovers_known_pieces_exactly():
    truth = Piecewise((0, 256, 1024, 4096), (0.01, 0.002, -0.5), (1e-4, 1.3e-4, 2.5e-4))
    xs = list(range(0, 5000, 7))
    fitted = fit_piecewise([(x, truth(x)) for x in xs], truth.breakpoints)
    assert fitted.breakpoints == truth.breakpoints
    for a, b in zip(fitted.alpha + fitted.beta, truth.alpha + truth.beta):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)


def test_fit_recovers_known_pieces_from_noisy_samples():
    rng = random.Random(7)
    truth = Piecewise((1, 8, 32, 128, 512), (0.02, 0.018, 0.01, -0.02), (0.0, 2.5e-4, 5e-4, 7.5e-4))
    samples = []
    for _ in range(20):
        for b in range(1, 513):
            samples.append((b, truth(b) * (1 + rng.gauss(0, 0.01))))
    fitted = fit_piecewise(samples, truth.breakpoints)
    for b in (1, 5, 8, 20, 32, 100, 128, 400, 512):
        assert fitted(b) == pytest.approx(truth(b), rel=0.01)


def test_fit_of_a_sampled_curve_matches_interpolation_where_linear():
    # a function that is linear on each bucket is reproduced by both fit and interpolation
    def f(x):
        return 0.003 + max(0.02, x * 0.02 / 28)   # roofline with its knee at 28
    bps = (1, 28, 64, 256)
    interp = interpolate_piecewise(f, bps)
    fitted = fit_piecewise([(x / 4, f(x / 4)) for x in range(4, 1200)], bps)
    for x in (1, 10, 28, 29, 50, 64, 200, 256):
        assert interp(x) == pytest.approx(f(x), rel=1e-9)
        assert fitted(x) == pytest.approx(f(x), rel=1e-6)


def test_fit_needs_samples_in_every_piece():
    with pytest.raises(ValueError, match=r"piece 1 \[10, 20\)"):
        fit_piecewise([(1, 1.0), (2, 2.0), (25, 3.0), (30, 4.0)], (0, 10, 20, 40))
    with pytest.raises(ValueError, match="breakpoints"):
        fit_piecewise([(1, 1.0)], (5, 5))


# --------------------------------------------------------------------------- derivation


def test_shipped_profiles_equal_what_derive_produces():
    docs = derive.derive_all()
    assert sorted(docs) == list_profiles()
    for name, doc in docs.items():
        path = PROFILES_DIR / f"{name}.json"
        assert json.loads(path.read_text()) == doc, f"{path} is stale: run python -m ampd.perf.derive --out {PROFILES_DIR}"
        assert path.read_text() == derive.dumps(doc)


def test_derive_cli_writes_the_files(tmp_path):
    assert derive.main(["--out", str(tmp_path)]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(f"{n}.json" for n in SHIPPED)
    for n in SHIPPED:
        assert (tmp_path / f"{n}.json").read_text() == (PROFILES_DIR / f"{n}.json").read_text()
        assert load_profile(tmp_path / f"{n}.json").name == n


def test_pieces_follow_the_analytic_model():
    m, hw = derive.MODELS["qwen3-32b"], derive.HARDWARE["h20"]
    p = load_profile("qwen3-32b@h20")
    for tp in p.tps:
        for l in (1, 7, 28, 29, 300, 5000):
            assert p.t_pre(tp, 0, l) == pytest.approx(
                derive.prefill_linear_s(m, hw, tp, l) + derive.prefill_attn_s_per_token2(m, hw, tp) * l * l / 2,
                rel=1e-6)
        for b in (1, 5, 28, 29, 77, 512):
            assert p.t_dec(tp, b, 0) == pytest.approx(derive.decode_batch_s(m, hw, tp, b), rel=1e-6)
    mx = derive.MODELS["mixtral-8x7b"]
    px = load_profile("mixtral-8x7b@h20")
    for b in range(1, 513, 3):  # MoE expert saturation is curved: interpolation within 3 %
        assert px.t_dec(4, b, 0) == pytest.approx(derive.decode_batch_s(mx, hw, 4, b), rel=0.03)
