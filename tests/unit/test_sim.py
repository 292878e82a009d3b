"""Unit tests of the discrete-event simulator (ampd/sim): hand-computed timings, determinism,
KV accounting, SPEC parsing, the CLI's errors."""
from __future__ import annotations

import json

import pytest

from ampd.deployment import SpecError, format_spec, parse_spec

policy = pytest.importorskip("ampd.policy")
perf = pytest.importorskip("ampd.perf")
workload = pytest.importorskip("ampd.workload")

from ampd.perf import profile_from_dict  # noqa: E402
from ampd.sim import PathLatency, SimConfig, Simulator, sim_report, simulate, to_session_records  # noqa: E402
from ampd.workload import Round, Session  # noqa: E402


def _profile(tps=(1, 2, 4), cap=1_000_000):
    """A small linear profile whose costs are easy to compute by hand."""
    tp = {}
    for t in tps:
        tp[str(t)] = {
            "kv_capacity_tokens": cap, "prefill_chunk_tokens": 512,
            "t_pre": {"l_incr": {"breakpoints": [0, 1e9], "alpha": [0.01], "beta": [1e-4 / t]},
                      "hist_s_per_token": 1e-6 / t, "attn_s_per_token2": 0.0},
            "t_dec": {"batch": {"breakpoints": [0, 1e9], "alpha": [0.02], "beta": [1e-4]},
                      "ctx_s_per_token": 1e-7 / t},
        }
    return profile_from_dict({
        "schema_version": 1, "name": "test@sim", "model": "test", "hardware": "sim",
        "kv_bytes_per_token": 1000,
        "t_kv": {"bytes_per_link": {"breakpoints": [0, 1e12], "alpha": [0.001], "beta": [1e-9]},
                 "links": "min_tp"},
        "tp": tp})


P = _profile()


def _expected_tokens(first, tp, batch_ctx0, n_out):
    """Token times of a lone session decoding alone: first token, then output-1 steps."""
    times = [first]
    t = first
    ctx = batch_ctx0
    for _ in range(n_out - 1):
        t += P.t_dec(tp, 1, ctx)
        ctx += 1
        times.append(t)
    return times


def _run(sessions, **kw):
    kw.setdefault("ttft_slo_s", 5.0)
    kw.setdefault("itl_slo_s", 0.5)
    return simulate(sessions, P, **kw)


def test_remote_single_session_exact_timing():
    s = Session("a", 1.0, (Round(1000, 6, 2.0), Round(300, 4)))
    r = _run([s], policy="remote", prefill="tp2*1", decode="tp1*1")
    r0, r1 = r.sessions[0].rounds
    # round 0: no history read, compute on tp2, write-back tp2 -> tp1
    ttft0 = P.t_pre(2, 0, 1000) + P.t_kv(1000, 2, 1)
    assert r0.local is False
    assert r0.first_token - r0.input_ready == pytest.approx(ttft0, abs=1e-12)
    assert r.token_times(r0) == pytest.approx(_expected_tokens(1.0 + ttft0, 1, 1001, 6), abs=1e-12)
    # round 1: ready after the tool; history = 1000 + 6 tokens read in, 300 written back
    ready1 = r0.last_token + 2.0
    assert r1.input_ready == pytest.approx(ready1, abs=1e-12)
    ttft1 = P.t_kv(1006, 1, 2) + P.t_pre(2, 1006, 300) + P.t_kv(300, 2, 1)
    assert r1.first_token - r1.input_ready == pytest.approx(ttft1, abs=1e-12)
    assert r.token_times(r1) == pytest.approx(_expected_tokens(ready1 + ttft1, 1, 1307, 4), abs=1e-12)
    assert r.sessions[0].completed


def test_local_single_session_exact_timing():
    s = Session("a", 0.5, (Round(800, 5, 1.0), Round(200, 3)))
    r = _run([s], policy="local", prefill="tp2*1", decode="tp4*1")
    r0, r1 = r.sessions[0].rounds
    assert r0.local is True and r1.local is True
    ttft0 = P.t_pre(4, 0, 800)
    assert r0.first_token - r0.input_ready == pytest.approx(ttft0, abs=1e-12)
    assert r.token_times(r0) == pytest.approx(_expected_tokens(0.5 + ttft0, 4, 801, 5), abs=1e-12)
    ttft1 = P.t_pre(4, 805, 200)
    assert r1.first_token - r1.input_ready == pytest.approx(ttft1, abs=1e-12)
    assert r.token_times(r1) == pytest.approx(_expected_tokens(r1.first_token, 4, 1006, 3), abs=1e-12)


def test_local_prefill_pauses_the_batch():
    # a decodes a long round; b's local prefill lands in the middle and pauses a's batch
    a = Session("a", 0.0, (Round(100, 200),))
    b = Session("b", 0.5, (Round(5000, 3),))
    r = _run([a, b], policy="colocated", prefill="none", decode="tp1*1")
    ra = r.sessions[0].rounds[0]
    rb = r.sessions[1].rounds[0]
    pre_b = P.t_pre(1, 0, 5000)
    times = r.token_times(ra)
    gaps = [y - x for x, y in zip(times, times[1:])]
    # the gap that spans b's prefill = the prefill time + one decode step (of a, or of a and b)
    big = max(gaps)
    i = gaps.index(big)
    start_of_prefill = times[i]
    # b's prefill waits for a's step in progress at 0.5, then pauses the batch
    assert times[i - 1] < 0.5 <= start_of_prefill
    # the paused gap = the prefill + the next step, which decodes a (context 101 + i) and b (5001)
    assert big == pytest.approx(pre_b + P.t_dec(1, 2, 101 + i + 5001), abs=1e-9)
    # b's first token is emitted at the end of its prefill, which starts at the step boundary
    assert rb.first_token == pytest.approx(start_of_prefill + pre_b, abs=1e-9)
    # every other gap is a plain decode step
    assert sorted(gaps)[-2] < 0.05


def test_deterministic_under_seed_and_kv_freed():
    sessions = workload.generate("toolbench", 3.0, 30, 7)
    kw = dict(policy="ampd", prefill="tp1*1,tp2*1", decode="tp2*2", ttft_slo_s=0.5, itl_slo_s=0.03, seed=3)
    a = _run(sessions, **kw)
    b = _run(sessions, **kw)
    ta = [(r.first_token, r.last_token, r.local, r.target) for s in a.sessions for r in s.rounds]
    tb = [(r.first_token, r.last_token, r.local, r.target) for s in b.sessions for r in s.rounds]
    assert ta == tb
    assert all(s.completed for s in a.sessions)
    assert a.stats["kv_used_end"] == [0, 0]
    assert a.stats["unfinished_sessions"] == 0
    assert a.stats["local_prefills"] + a.stats["remote_prefills"] == sum(len(s.rounds) for s in sessions)


def test_compact_report_matches_full_report():
    from ampd.bench.report import SLO

    sessions = workload.generate("hotpotqa", 2.0, 20, 1)
    r = _run(sessions, policy="ampd", prefill="tp1*1", decode="tp1*1", ttft_slo_s=1.0, itl_slo_s=0.03)
    slo = SLO(1.0, 0.03)
    full = sim_report(r, slo, extras=False)
    compact = sim_report(r, slo, max_full_tokens=0, extras=False)
    assert list(full) == list(compact)
    for k, v in full.items():
        if isinstance(v, dict) and "p50" in v:
            for q in v:
                assert compact[k][q] == pytest.approx(v[q], rel=1e-6, abs=1e-9), (k, q)
        elif isinstance(v, float):
            assert compact[k] == pytest.approx(v, rel=1e-9), k
        else:
            assert compact[k] == v, k


@pytest.mark.parametrize("rate,ttft,itl", [(2.0, 1.0, 0.03), (40.0, 0.2, 0.01)])
def test_compact_report_is_the_record_path_exactly(rate, ttft, itl):
    """``compact_report`` (one pass, no records) gives exactly what ``build_report`` gives on the
    compact records, including unfinished sessions and failing SLOs (the second case overloads)."""
    from ampd.bench.report import SLO, build_report
    from ampd.sim.records import compact_report, to_compact_session_records

    sessions = workload.generate("hotpotqa", rate, 20, 1)
    r = _run(sessions, policy="ampd", prefill="tp1*1", decode="tp1*1", ttft_slo_s=ttft, itl_slo_s=itl)
    r.sessions[0].completed = False  # an incomplete session: counted in errors, no e2e sample
    r.sessions[0].error = ""
    slo = SLO(ttft, itl)
    want = build_report(r.policy, to_compact_session_records(r), slo, r.duration_s, itl_samples=r.itl_samples())
    got = compact_report(r, slo, r.duration_s)
    assert got == want
    assert got["attained"] < got["sessions"] and got["errors"]


def _itl_samples_by_segment(r):
    """itl_samples' samples computed one segment and one round at a time (the definition)."""
    from ampd.sim.steplog import SERIES_POINTS as P

    out = []
    for lg in r.step_logs:
        lg.finish()
        for lo, t0, A, g, k, n, old, prev in zip(lg.lo, lg.t0, lg.A, lg.g, lg.k, lg.n, lg.old, lg.prev):
            if old:
                out.append((t0 + A - prev, float(old)))
            if 1 < k <= P + 1:
                out += [(A + g * float(j), float(n)) for j in range(1, k)]
            elif k > P + 1:
                out += [(A + g * (1 + (k - 2.0) * (i + 0.5) / P), n * (k - 1) / P) for i in range(P)]
    out += [(r.step_logs[rd.worker].step_end(rd.step_lo) - rd.first_token, 1.0)
            for s in r.sessions for rd in s.rounds if rd.n_tokens > 1]
    return out


def test_itl_samples_are_every_segments_gaps():
    from ampd.sim.steplog import FirstSteps, ItlPieces

    sessions = workload.generate("hotpotqa", 4.0, 20, 3)
    r = _run(sessions, policy="ampd", prefill="tp1*1", decode="tp1*2")
    v, w = r.itl_samples()
    want = _itl_samples_by_segment(r)
    assert sorted(zip(v.tolist(), w.tolist())) == sorted(want)
    assert (w > 1).any() and any(k > 17 for lg in r.step_logs for k in lg.k)  # long runs too
    pieces = ItlPieces(r.step_logs, FirstSteps.of(r.sessions))
    got = [p for piece in pieces() for p in zip(*piece)]
    assert len(got) == pieces.size and got == list(zip(v, w))


def test_colocated_has_no_prefill_workers():
    sessions = workload.generate("toolbench", 2.0, 10, 2)
    r = _run(sessions, policy="colocated", prefill="none", decode="tp1*2")
    assert r.stats["remote_prefills"] == 0
    assert all(rr.local for s in r.sessions for rr in s.rounds)
    with pytest.raises(ValueError, match="co-located"):
        _run(sessions, policy="continuum", prefill="tp1*1", decode="tp1*1")
    recs = to_session_records(r)
    assert len(recs) == len(sessions) and all(s.completed for s in recs)


def test_more_prefill_capacity_never_lowers_attainment():
    from ampd.bench.report import SLO

    sessions = workload.generate("dureader", 6.0, 20, 5)
    slo = SLO(0.3, 0.05)
    att = []
    for pre in ("tp1*1", "tp1*2", "tp1*4"):
        r = _run(sessions, policy="remote", prefill=pre, decode="tp2*2", ttft_slo_s=0.3, itl_slo_s=0.05)
        att.append(sim_report(r, slo)["slo_attainment"])
    assert att[0] <= att[1] <= att[2]


def test_kv_contention_only_slows_transfers():
    sessions = workload.generate("toolbench", 3.0, 10, 4)
    a = _run(sessions, policy="remote", prefill="tp1*2", decode="tp1*1")
    b = _run(sessions, policy="remote", prefill="tp1*2", decode="tp1*1", kv_contention=True)
    assert sum(r.ttft for s in b.sessions for r in s.rounds) >= sum(r.ttft for s in a.sessions for r in s.rounds) - 1e-9


def test_kv_pressure_waits_instead_of_failing():
    prof = _profile(cap=3000)
    sessions = [Session(f"s{i}", 0.0, (Round(1000, 10, 0.5), Round(500, 10))) for i in range(4)]
    r = simulate(sessions, prof, policy="colocated", prefill="none", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1)
    assert all(s.completed for s in r.sessions)
    assert r.stats["kv_used_end"] == [0]
    # three first inputs fit at once: the fourth session starts after one ends
    starts = sorted(s.rounds[0].first_token for s in r.sessions)
    ends = sorted(s.end for s in r.sessions)
    assert starts[3] >= ends[0]


@pytest.mark.parametrize("text, groups", [
    ("tp4*2", ((4, 2),)), ("tp4*1,tp2*2", ((4, 1), (2, 2))), ("TP8", ((8, 1),)), (" tp1*3 ", ((1, 3),)),
    ("", ()), ("none", ()), (None, ()),
])
def test_parse_spec(text, groups):
    assert parse_spec(text) == groups


@pytest.mark.parametrize("bad", ["tp", "tp4*", "4*2", "tp4x2", "tp0*1", "tp4*0", "tp4*2,", "tp-1*2", "gpu4"])
def test_parse_spec_errors(bad):
    with pytest.raises(SpecError, match="expected tpN\\*R|must be >= 1"):
        parse_spec(bad)


def test_format_spec_roundtrip():
    assert format_spec(parse_spec("tp4*1,tp2*2")) == "tp4*1,tp2*2"
    assert format_spec(()) == "none"


def test_unknown_tp_in_spec():
    with pytest.raises(ValueError, match="TP 8"):
        Simulator(SimConfig(profile=P, policy="ampd", prefill="tp8*1", decode="tp1*1", ttft_slo_s=1.0))


# ------------------------------------------------------------------------------------------ CLI
def _cli(argv):
    from ampd.cli import main

    return main(argv)


def _write_trace(path, sessions):
    workload.dump_trace(sessions, path)


def test_cli_runs_and_writes_json(tmp_path, capsys):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(P.to_json()))
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, workload.generate("toolbench", 2.0, 5, 1))
    out = tmp_path / "r.json"
    rc = _cli(["simulate", "--trace", str(trace), "--profile", str(prof), "--prefill", "tp1*1",
               "--decode", "tp2*1", "--policy", "ampd", "--ttft-slo", "1", "--itl-slo", "0.05",
               "--json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    for k in ("policy", "sessions", "completed", "failed", "slo_attainment", "goodput_rps",
              "local_fraction", "ttft_s", "ttft_initial_s", "ttft_incremental_s", "itl_s", "e2e_s"):
        assert k in rep
    assert "SLO attainment" in capsys.readouterr().out


def test_cli_colocated_policy_turns_prefill_gpus_into_colocated_workers(tmp_path, capsys):
    """The rule `ampd up` follows too (ampd.deployment.worker_shape): same GPU count, no prefill workers."""
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(P.to_json()))
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, workload.generate("toolbench", 2.0, 3, 1))
    out = tmp_path / "r.json"
    rc = _cli(["simulate", "--trace", str(trace), "--profile", str(prof), "--prefill", "tp1*1",
               "--decode", "tp2*1", "--policy", "colocated", "--ttft-slo", "1", "--itl-slo", "0.05",
               "--json", str(out)])
    assert rc == 0
    dep = json.loads(out.read_text())["deployment"]
    assert (dep["prefill"], dep["decode"], dep["gpus"]) == ("none", "tp2*1,tp1*1", 3)


@pytest.mark.parametrize("args, msg", [
    (["--prefill", "tp1x1"], "--prefill: bad replica group"),
    (["--decode", "tp9*1"], "TP 9 is not in profile"),
    (["--policy", "nope"], "unknown policy"),
    (["--profile", "no-such@thing"], "unknown profile"),
    (["--trace", "BAD"], "line 1"),
    (["--path-latency", "dispatch=-1"], "--path-latency: path latency 'dispatch' must be"),
    (["--path-latency", "route=0.1"], "--path-latency: path latency 'route=0.1': expected NAME=SECONDS"),
])
def test_cli_errors(tmp_path, capsys, args, msg):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(P.to_json()))
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, workload.generate("toolbench", 2.0, 3, 1))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "arrival": "soon", "rounds": []}\n')
    base = {"--trace": str(trace), "--profile": str(prof), "--prefill": "tp1*1", "--decode": "tp1*1",
            "--policy": "ampd", "--ttft-slo": "1", "--itl-slo": "0.05"}
    over = dict(zip(args[::2], args[1::2]))
    if over.get("--trace") == "BAD":
        over["--trace"] = str(bad)
    base.update(over)
    argv = ["simulate"] + [x for kv in base.items() for x in kv]
    assert _cli(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


def test_chunked_local_prefill_interleaves_decode_steps():
    """A long local prefill in chunks: the co-batched session keeps getting tokens (no gap as long
    as the whole prefill), the long prompt's first token comes later than unchunked, and the
    tokens of every round still all come out."""
    from ampd.perf import load_profile
    from ampd.sim import simulate
    from ampd.workload import Round, Session

    prof = load_profile("qwen3-32b@h20")
    sessions = [Session("decoder", 0.0, (Round(input=200, output=300),)),
                Session("long", 0.5, (Round(input=6000, output=5),))]
    runs = {}
    for chunked in (False, True):
        res = simulate(sessions, prof, policy="local", decode="tp2*1", ttft_slo_s=10, itl_slo_s=1,
                       chunked_prefill=chunked)
        by_id = {s.session_id: s for s in res.sessions}
        gaps = res.itl_gaps(by_id["decoder"].rounds[0])
        runs[chunked] = (max(gaps), by_id["long"].rounds[0].ttft, by_id["decoder"].rounds[0].n_tokens)
    whole = prof.t_pre(2, 0, 6000)
    assert runs[False][0] >= whole  # unchunked: the decoder waits out the whole prefill
    assert runs[True][0] < 0.5 * whole
    assert runs[True][1] > runs[False][1]  # chunking delays the long prompt's first token
    assert runs[True][2] == runs[False][2] == 300


def test_path_latency_delays_routing_handoff_and_tools():
    """PathLatency: round 0 is routed open+dispatch after arrival, later rounds dispatch after their
    input is ready (tool + tool rpc after the last token); a remote first token comes handoff after
    the prefill ends. TTFT still runs from the input being ready."""
    from ampd.sim import PathLatency

    s = Session("a", 1.0, (Round(1000, 6, 2.0), Round(300, 4)))
    path = PathLatency(open_s=0.03, dispatch_s=0.01, handoff_s=0.002, tool_s=0.005)
    r = _run([s], policy="remote", prefill="tp2*1", decode="tp1*1", path=path)
    r0, r1 = r.sessions[0].rounds
    ttft0 = 0.03 + 0.01 + P.t_pre(2, 0, 1000) + P.t_kv(1000, 2, 1) + 0.002
    assert r0.input_ready == pytest.approx(1.0, abs=1e-12)
    assert r0.first_token - r0.input_ready == pytest.approx(ttft0, abs=1e-12)
    assert r1.input_ready == pytest.approx(r0.last_token + 2.0 + 0.005, abs=1e-12)
    ttft1 = 0.01 + P.t_kv(1006, 1, 2) + P.t_pre(2, 1006, 300) + P.t_kv(300, 2, 1) + 0.002
    assert r1.first_token - r1.input_ready == pytest.approx(ttft1, abs=1e-12)
    # local: no handoff
    r = _run([s], policy="local", prefill="tp2*1", decode="tp4*1", path=path)
    r0 = r.sessions[0].rounds[0]
    assert r0.first_token - r0.input_ready == pytest.approx(0.04 + P.t_pre(4, 0, 1000), abs=1e-12)


def test_path_latency_prefill_busy_adds_up_along_the_queue():
    """prefill_busy: each remote prefill holds the worker longer; the task behind waits for it."""
    from ampd.sim import PathLatency

    a = Session("a", 0.0, (Round(1000, 2),))
    b = Session("b", 0.0, (Round(500, 2),))
    r = _run([a, b], policy="remote", prefill="tp2*1", decode="tp1*2",
             path=PathLatency(prefill_busy_s=0.003))
    ra, rb = (s.rounds[0] for s in r.sessions)
    da = P.t_pre(2, 0, 1000) + P.t_kv(1000, 2, 1)
    db = P.t_pre(2, 0, 500) + P.t_kv(500, 2, 1)
    assert ra.first_token == pytest.approx(da + 0.003, abs=1e-12)
    assert rb.first_token == pytest.approx(da + 0.003 + db + 0.003, abs=1e-12)


def test_path_latency_step_lengthens_every_decode_step_only():
    """step: each decode step takes step_s longer than modelled; prefills and TTFT do not move."""
    from ampd.sim import PathLatency

    s = Session("a", 0.0, (Round(1000, 6),))
    base = _run([s], policy="remote", prefill="tp2*1", decode="tp1*1")
    slow = _run([s], policy="remote", prefill="tp2*1", decode="tp1*1", path=PathLatency(step_s=0.004))
    (r0,), (r1,) = base.sessions[0].rounds, slow.sessions[0].rounds
    assert r1.first_token == pytest.approx(r0.first_token, abs=1e-12)
    g0, g1 = base.itl_gaps(r0), slow.itl_gaps(r1)
    assert len(g0) == len(g1) == 5
    assert [b - a for a, b in zip(g0, g1)] == pytest.approx([0.004] * 5, abs=1e-12)


@pytest.mark.parametrize("text, want", [
    ("none", PathLatency()),
    ("step=0.0003", PathLatency(step_s=0.0003)),
    ("", PathLatency()),
    ("dispatch=0.012, handoff=0.002", PathLatency(dispatch_s=0.012, handoff_s=0.002)),
    ("open=0.05,tool=1e-3", PathLatency(open_s=0.05, tool_s=0.001)),
    ("prefill_busy=0.0025", PathLatency(prefill_busy_s=0.0025)),
])
def test_path_latency_parse(text, want):
    got = PathLatency.parse(text)
    assert got == want
    assert PathLatency.parse(got.format()) == got


@pytest.mark.parametrize("bad, msg", [
    ("dispatch", "expected NAME=SECONDS"),
    ("dispatch=x", "is not a number"),
    ("dispatch=0.1,dispatch=0.2", "given twice"),
    ("tool=-0.1", "must be a number >= 0"),
    ("handoff=nan", "must be a number >= 0"),
])
def test_path_latency_parse_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        PathLatency.parse(bad)


def _collide():
    """Two sessions whose incremental rounds meet on one prefill worker: a's long round 1 computes
    when b's round 1 (history 101 tokens) arrives."""
    a = Session("a", 0.0, (Round(100, 1, 1.0), Round(2000, 2)))
    b = Session("b", 0.0, (Round(100, 1, 1.0), Round(500, 2)))
    return [a, b]


@pytest.mark.parametrize("overlap", [True, False])
def test_kv_overlap_hides_the_next_tasks_history_read(overlap):
    r = _run(_collide(), policy="remote", prefill="tp2*1", decode="tp1*1", kv_overlap=overlap)
    a1 = r.sessions[0].rounds[1]
    b1 = r.sessions[1].rounds[1]
    a_end = a1.first_token  # a's new KV written back: the prefill worker is free
    assert a1.input_ready < b1.input_ready < a_end - P.t_kv(2000, 2, 1)  # b arrives while a computes
    read_b = P.t_kv(101, 1, 2)
    rest_b = P.t_pre(2, 101, 500) + P.t_kv(500, 2, 1)
    # with the overlap b's history was read while a computed: b computes as soon as a is done
    expected = a_end + rest_b if overlap else a_end + read_b + rest_b
    assert b1.first_token == pytest.approx(expected, abs=1e-12)


def test_kv_admission_fail_fails_the_session_that_does_not_fit():
    """The decode worker's own KV admission, under the admission rule that lets every session in."""
    prof = _profile(cap=1500)
    a = Session("a", 0.0, (Round(1000, 3),))
    b = Session("b", 0.1, (Round(1000, 3),))
    wait = simulate([a, b], prof, policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1, admission="none")
    assert all(s.completed for s in wait.sessions)  # "wait": b starts once a frees its KV
    b0 = wait.sessions[1].rounds[0]
    assert b0.first_token == pytest.approx(wait.sessions[0].end + P.t_pre(1, 0, 1000), abs=1e-12)
    fail = simulate([a, b], prof, policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1,
                    kv_admission="fail", admission="none")
    sa, sb = fail.sessions
    assert sa.completed and not sb.completed and sb.error.startswith("KV exhausted on decode-0")
    assert fail.stats["kv_failed_sessions"] == 1
    rep = sim_report(fail, policy.SLO(5, 1))
    assert rep["completed"] == 1 and rep["failed"] == 1
    with pytest.raises(ValueError, match="kv_admission"):
        simulate([a], prof, policy="colocated", decode="tp1*1", ttft_slo_s=1.0, kv_admission="drop")


def test_kv_evict_lets_a_new_session_in_and_the_idle_one_re_prefills_its_history():
    prof = _profile(cap=1500)
    a = Session("a", 0.0, (Round(1000, 1, 5.0), Round(100, 2)))  # idle in a 5 s tool call, history 1001
    b = Session("b", 0.5, (Round(1000, 2),))
    kw = dict(policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1, admission="none", kv_host_ratio=0)
    keep = simulate([a, b], prof, **kw)
    assert keep.stats["kv_evictions"] == 0 and "kv_recomputed_tokens" not in keep.stats
    assert keep.sessions[1].rounds[0].first_token > keep.sessions[0].end  # b waits for a to end
    ev = simulate([a, b], prof, kv_evict=True, **kw)
    sa, sb = ev.sessions
    assert sa.completed and sb.completed and ev.stats["kv_used_end"] == [0]
    assert sb.rounds[0].first_token == pytest.approx(0.5 + P.t_pre(1, 0, 1000), abs=1e-12)  # at once
    a1 = sa.rounds[1]  # b has ended by then: a's round prefills its whole context, 1001 + 100 tokens
    assert a1.first_token - a1.input_ready == pytest.approx(P.t_pre(1, 0, 1101), abs=1e-12)
    assert ev.stats["kv_evictions"] == 1 and ev.stats["kv_recomputed_tokens"] == 1001


def test_worker_shape_prefill_auto_by_policy():
    """Issue 26: --prefill auto (not given) is none under a co-located policy; a disaggregated one
    gets `ampd up`'s tp1*1, or one clear error where the caller (simulate) asks for it; a policy that
    sends prefills to prefill workers and has none is an error; `local` may run none."""
    from ampd.deployment import SpecError, worker_shape

    assert worker_shape("colocated", "auto", "tp8*4").prefill == ()
    assert worker_shape("continuum", None, "tp8*4", auto_prefill=None).decode == ((8, 4),)
    assert worker_shape("ampd", "auto", "tp2*1").prefill == ((1, 1),)
    assert worker_shape("local", "none", "tp2*1").prefill == ()
    for pre, auto in (("auto", None), ("none", "tp1*1"), ("0", None)):
        with pytest.raises(SpecError, match="--prefill: policy remote"):
            worker_shape("remote", pre, "tp2*1", auto_prefill=auto)


def test_admission_promises_the_whole_session_and_waits_then_refuses_as_live():
    """Issue 26: the simulator binds through the coordinator's admission core
    (ampd.policy.admit.AdmissionBook): a session is bound where its whole KV (every round, plus a
    block) is promised; b waits for a to end (its TTFT counts from its arrival), c is refused after
    the admission wait; one bigger than any worker is refused at once."""
    prof = _profile(cap=3000)
    a = Session("a", 0.0, (Round(1000, 3, 1.0), Round(200, 3)))  # promises 1000+3+200+3+32 = 1238
    b = Session("b", 0.1, (Round(1500, 3),))  # 1535: fits beside a? 1238 + 1535 = 2773 <= 3000: yes
    c = Session("c", 0.2, (Round(1000, 3),))  # 1035: waits for KV (a or b must end)
    d = Session("d", 0.3, (Round(4000, 3),))  # more than the worker holds
    kw = dict(policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1)
    r = simulate([a, b, c, d], prof, **kw)
    sa, sb, sc, sd = r.sessions
    assert sa.completed and sb.completed and sc.completed and not sd.completed
    assert sd.error.startswith("admission: kv-size:") and r.stats["admission_refused"] == {"kv-size": 1}
    assert r.stats["admission_waited"] == 1 and r.stats["kv_overcommits"] == 0
    c0 = sc.rounds[0]
    assert c0.input_ready == 0.2 and c0.first_token > min(sa.end, sb.end)
    assert c0.first_token == pytest.approx(min(sa.end, sb.end) + P.t_pre(1, 0, 1000), abs=1e-9)
    short = simulate([a, b, c], prof, admission_wait=0.05, **kw)
    assert short.sessions[2].error.startswith("admission: kv-full:") and not short.sessions[2].rounds
    assert short.stats["admission_refused"] == {"kv-full": 1}
    none = simulate([a, b, c], prof, admission="none", **kw)
    assert none.stats["admission_waited"] == 0 and none.sessions[2].decode_worker == "decode-0"


def test_a_yielding_hint_in_a_trace_waits_behind_sessions_without_one():
    """Agent hints in a trace (a round's ``hints``, issue 29): the simulator's admission orders a
    session whose first turn yields (negative priority) behind a later one without hints, as the
    coordinator does; without the hint, arrival order; the tokens each session makes are unchanged."""
    from ampd.policy.hints import Hints

    prof = _profile(cap=3000)
    a = Session("a", 0.0, (Round(2000, 3, 1.0), Round(100, 3)))  # promises 2138: neither y nor p fits beside it
    p = Session("p", 0.2, (Round(1500, 3),))  # 1535 each: only one of y and p fits at once
    kw = dict(policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1, admission_wait=30)
    firsts = {}
    for hints in (None, Hints(priority=-5)):
        y = Session("y", 0.1, (Round(1500, 3, hints=hints),))
        r = simulate([a, y, p], prof, **kw)
        assert all(s.completed for s in r.sessions)
        firsts[hints] = {s.session_id: s.rounds[0].first_token for s in r.sessions}
        assert [len(s.rounds) for s in r.sessions] == [2, 1, 1]
    assert firsts[None]["y"] < firsts[None]["p"]  # arrival order
    yielded = firsts[Hints(priority=-5)]
    assert yielded["p"] < yielded["y"]  # the yielding session waits behind the later one
    assert yielded["p"] <= firsts[None]["y"] + 1e-9  # and p gets what y had: no one waits longer for y's hint
