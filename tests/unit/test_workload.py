"""Presets (Table 1 means), Mooncake import, trace statistics."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ampd.workload import (PRESETS, Round, Session, TraceError, dump_trace, generate, import_mooncake, load_trace,
                           trace_stats)

TABLE1 = {
    "toolbench": (3.96, 703.79, 50.39),
    "gaia": (11.32, 6161.02, 528.76),
    "hotpotqa": (3.0, 1569.8, 80.03),
    "dureader": (3.0, 3081.23, 150.10),
}


@pytest.mark.parametrize("preset", sorted(TABLE1))
@pytest.mark.parametrize("seed", [0, 7, 12345])
def test_preset_means_within_5_percent(preset, seed):
    sessions = generate(preset, rate=20.0, duration=100.0, seed=seed)
    assert 1800 < len(sessions) < 2200
    st = trace_stats(sessions)
    rounds, inp, out = TABLE1[preset]
    assert st["mean_rounds"] == pytest.approx(rounds, rel=0.05)
    assert st["mean_input_per_round"] == pytest.approx(inp, rel=0.05)
    assert st["mean_output_per_round"] == pytest.approx(out, rel=0.05)
    # the initial prompt is longer than a typical tool result
    assert st["mean_initial_input"] > st["mean_incremental_input"]


def test_preset_targets_are_table1():
    for name, (r, i, o) in TABLE1.items():
        assert PRESETS[name].targets == {"mean_rounds": r, "mean_input_per_round": i,
                                         "mean_output_per_round": o}


@pytest.mark.parametrize("preset", ["hotpotqa", "dureader"])
def test_rag_presets_have_exactly_three_rounds(preset):
    assert {len(s.rounds) for s in generate(preset, 50, 10, 3)} == {3}


@pytest.mark.parametrize("preset", sorted(TABLE1))
def test_session_shape(preset):
    ss = generate(preset, 10, 20, 1)
    assert [s.id for s in ss] == [f"{preset}-{i:06d}" for i in range(len(ss))]
    arr = [s.arrival for s in ss]
    assert arr == sorted(arr) and 0 <= arr[0] and arr[-1] <= 20
    for s in ss:
        assert all(isinstance(r.input, int) and r.input >= 1 for r in s.rounds)
        assert all(isinstance(r.output, int) and r.output >= 1 for r in s.rounds)
        assert all(r.tool_s is not None and r.tool_s >= 0 for r in s.rounds[:-1])
        assert s.rounds[-1].tool_s is None


def test_deterministic_and_seed_sensitive():
    assert generate("toolbench", 5, 20, 42) == generate("toolbench", 5, 20, 42)
    assert generate("toolbench", 5, 20, 42) != generate("toolbench", 5, 20, 43)


def test_content_independent_of_rate_and_duration():
    a = generate("gaia", 2.0, 50, 9)
    b = generate("gaia", 4.0, 50, 9)
    k = min(len(a), len(b))
    assert k > 50
    assert [s.rounds for s in a[:k]] == [s.rounds for s in b[:k]]
    # arrivals at twice the rate are the same points, halved
    assert np.allclose([s.arrival for s in a[:k]], [2 * s.arrival for s in b[:k]], atol=1e-5)
    c = generate("gaia", 2.0, 25, 9)
    assert c == a[:len(c)]


def test_tool_latency_means():
    st = {p: trace_stats(generate(p, 5, 100, 5))["mean_tool_s"] for p in TABLE1}
    assert 0.8 < st["toolbench"] < 1.2
    assert 3.0 < st["gaia"] < 5.0
    assert 0.15 < st["hotpotqa"] < 0.5 and 0.2 < st["dureader"] < 0.6


@pytest.mark.parametrize("kwargs, text", [
    (dict(preset="nope"), "unknown preset"),
    (dict(rate=0), "rate"),
    (dict(rate=float("nan")), "rate"),
    (dict(duration=-1), "duration"),
    (dict(seed=-1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(rate=1e6, duration=1e6), "limit"),
])
def test_generate_rejects_bad_arguments(kwargs, text):
    args = dict(preset="toolbench", rate=1.0, duration=10.0, seed=0) | kwargs
    with pytest.raises(ValueError, match=text):
        generate(**args)


# ------------------------------------------------------------------------------------- mooncake

def _rows(tmp_path, rows, name="mc.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


def test_import_mooncake_groups_sessions(tmp_path):
    p = _rows(tmp_path, [
        {"timestamp": 1000, "input_length": 500, "output_length": 20, "hash_ids": [1, 2],
         "session_id": "a"},
        {"timestamp": 1500, "input_length": 300, "output_length": 7},          # single
        {"timestamp": 4000, "input_length": 900, "output_length": 30, "session_id": "a"},
        {"timestamp": 2500, "input_length": 600, "output_length": 10, "session_id": "a"},
        {"timestamp": 9000, "input_length": 100, "output_length": 5, "session_id": "a"},  # restart
        {"timestamp": 3000, "input_length": 40, "output_length": 4, "conversation_id": 17},
    ])
    ss = import_mooncake(p)
    assert [s.id for s in ss] == ["a", "row-000002", "17"]
    a = ss[0]
    assert a.arrival == 0.0
    assert a.rounds == (
        Round(500, 20, 1.5, hash_ids=(1, 2)),  # ts 1000 -> 2500; its hash ids kept
        Round(80, 10, 1.5),             # 600 - (500 + 20); 2500 -> 4000
        Round(290, 30, 5.0),            # 900 - (600 + 10); 4000 -> 9000
        Round(100, 5, None),            # 100 - 930 <= 0 -> whole input
    )
    assert ss[1] == Session("row-000002", 0.5, (Round(300, 7),))
    assert ss[2] == Session("17", 2.0, (Round(40, 4),))


def test_import_mooncake_keeps_hash_ids_through_a_trace_file(tmp_path):
    # two conversations sharing a 2-block system prompt (ids 1, 2); the second round of "a" resends
    # its history, so its ids extend the first round's
    p = _rows(tmp_path, [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3], "session_id": "a"},
        {"timestamp": 100, "input_length": 1030, "output_length": 5, "hash_ids": [1, 2, 4], "session_id": "b"},
        {"timestamp": 2000, "input_length": 1600, "output_length": 8, "hash_ids": [1, 2, 3, 5],
         "session_id": "a"},
    ])
    ss = import_mooncake(p)
    assert [[r.hash_ids for r in s.rounds] for s in ss] == [[(1, 2, 3), (1, 2, 3, 5)], [(1, 2, 4)]]
    out = tmp_path / "t.jsonl"
    dump_trace(ss, out)
    assert load_trace(out) == ss
    with pytest.raises(TraceError, match=r"field 'hash_ids\[0\]'"):
        import_mooncake(_rows(tmp_path, [{"timestamp": 0, "input_length": 1, "output_length": 1,
                                          "hash_ids": ["x"]}], "bad.jsonl"))


def test_import_mooncake_without_sessions(tmp_path):
    p = _rows(tmp_path, [{"timestamp": 27482, "input_length": 6955, "output_length": 52},
                         {"timestamp": 27000, "input_length": 6472, "output_length": 26,
                          "session": None}])
    ss = import_mooncake(p)
    assert [(s.id, s.arrival, len(s.rounds)) for s in ss] == [
        ("row-000002", 0.0, 1), ("row-000001", 0.482, 1)]


@pytest.mark.parametrize("row, text", [
    ({"input_length": 1, "output_length": 1}, "field 'timestamp': missing"),
    ({"timestamp": "x", "input_length": 1, "output_length": 1}, "field 'timestamp'"),
    ({"timestamp": 0, "input_length": 0, "output_length": 1}, "field 'input_length': must be an integer >= 1, got 0"),
    ({"timestamp": 0, "input_length": 1, "output_length": -2}, "field 'output_length'"),
    ({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": 3}, "field 'hash_ids'"),
    ({"timestamp": 0, "input_length": 1, "output_length": 1, "session_id": ""}, "field 'session_id'"),
    ({"timestamp": 0, "input_length": 1, "output_length": 1, "session": [1]}, "field 'session'"),
    ("[]", "must be a JSON object"),
    ("{", "invalid JSON"),
])
def test_import_mooncake_errors(tmp_path, row, text):
    p = _rows(tmp_path, [{"timestamp": 0, "input_length": 1, "output_length": 1}, row])
    with pytest.raises(TraceError) as e:
        import_mooncake(p)
    assert str(e.value).startswith(f"{p} line 2: ")
    assert text in str(e.value)


# ---------------------------------------------------------------------------------------- stats

def test_trace_stats_hand_computed():
    ss = [Session("a", 1.0, (Round(100, 10, 2.0), Round(20, 5))),
          Session("b", 3.0, (Round(60, 30),))]
    st = trace_stats(ss)
    assert st["sessions"] == 2 and st["rounds"] == 3
    assert st["mean_rounds"] == 1.5
    assert st["mean_input_per_round"] == 60.0
    assert st["mean_output_per_round"] == 15.0
    assert st["mean_initial_input"] == 80.0 and st["mean_incremental_input"] == 20.0
    assert st["mean_tool_s"] == 2.0
    assert st["max_context_tokens"] == 135
    assert st["arrival_rate_rps"] == 0.5


def test_trace_stats_empty():
    st = trace_stats([])
    assert st["sessions"] == 0 and st["mean_rounds"] is None and st["arrival_rate_rps"] is None
    assert st["first_round_hash_blocks"] == 0 and st["prefix_shared_frac"] is None


def test_trace_stats_prefix_sharing_from_hash_ids():
    ss = [Session("a", 0.0, (Round(1500, 10, 1.0, None, (1, 2, 3)), Round(600, 5, None, None, (1, 2, 3, 4, 5)))),
          Session("b", 1.0, (Round(1100, 10, None, None, (1, 2, 9)),)),   # shares 1, 2
          Session("c", 2.0, (Round(2600, 10, None, None, (1, 2, 3, 4, 5, 6)),)),  # 1..5 (5 from a's round 1)
          Session("d", 3.0, (Round(900, 10, None, None, (7, 1)),)),       # 7 is new: nothing
          Session("e", 4.0, (Round(100, 10),))]                           # no ids
    st = trace_stats(ss)
    assert st["first_round_hash_blocks"] == 3 + 3 + 6 + 2
    assert st["prefix_shared_frac"] == (0 + 2 + 5 + 0) / 14


def test_generated_rounds_equal_rounds_built_by_the_dataclass():
    # Round's and Session's __init__ are written out (tests/unit/test_inits.py holds them to their
    # fields): equal values hash equal, whatever the defaults given explicitly or not
    assert Round(5, 7, None) == Round(5, 7) and hash(Round(5, 7, None)) == hash(Round(5, 7))
    assert Round(5, 7, 1.25, None, None, None) == Round(5, 7, 1.25)
    rounds = (Round(5, 7, 1.25), Round(3, 2))
    assert hash(Session("x", 1.5, rounds)) == hash(dataclasses.replace(Session("y", 0.0, ()), id="x", arrival=1.5,
                                                                      rounds=rounds))
    s = generate("gaia", 0.5, 20.0, 3)
    assert all(type(x) is Session and x == Session(x.id, x.arrival, x.rounds) for x in s)
    assert all(type(r) is Round and r == Round(r.input, r.output, r.tool_s) for x in s for r in x.rounds)


def _reference_generate(preset: str, rate: float, duration: float, seed: int) -> list[Session]:
    """generate() as it was written first (every draw of the (n, rounds) blocks transformed, a mask
    per tool, Python's round, Round(...)): the trace the faster one must reproduce exactly."""
    from ampd.workload.presets import _arrivals

    p = PRESETS[preset]
    r_arr, r_rounds, r_in, r_out, r_kind, r_tool = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(6))
    arrival = _arrivals(r_arr, float(rate), float(duration))
    n, w = len(arrival), p.max_rounds
    nrounds = (p.rounds_shift + r_rounds.binomial(p.rounds_n, p.rounds_p, size=n) if p.rounds_n
               else np.full(n, p.rounds_shift))
    z_in = r_in.standard_normal((n, w))
    inputs = np.empty((n, w))
    inputs[:, :1] = p.first_input.transform(z_in[:, :1])
    inputs[:, 1:] = p.later_input.transform(z_in[:, 1:])
    inputs = np.maximum(np.rint(inputs), 1).astype(np.int64)
    outputs = np.maximum(np.rint(p.output.transform(r_out.standard_normal((n, w)))), 1).astype(np.int64)
    shares = np.array([t.share for t in p.tools], dtype=float)
    kind = np.minimum(np.searchsorted(np.cumsum(shares / shares.sum()), r_kind.random((n, w)), side="right"),
                      len(p.tools) - 1)
    z_tool = r_tool.standard_normal((n, w))
    tool_s = np.zeros((n, w))
    for k, t in enumerate(p.tools):
        tool_s[kind == k] = t.latency.transform(z_tool[kind == k])
    tool_s = np.round(tool_s, 4)
    out = []
    for i in range(n):
        k = int(nrounds[i])
        rounds = tuple(Round(int(inputs[i, j]), int(outputs[i, j]), float(tool_s[i, j]) if j < k - 1 else None)
                       for j in range(k))
        out.append(Session(f"{preset}-{i:06d}", round(float(arrival[i]), 6), rounds))
    return out


@pytest.mark.parametrize("preset", sorted(TABLE1))
def test_generate_reproduces_the_reference_trace_exactly(preset):
    from ampd.workload.presets import CHUNK

    def fields(ss: list[Session]) -> list[str]:  # repr: the exact floats, and int/float/None kept apart
        return [repr((s.id, s.arrival, [(r.input, r.output, r.tool_s, r.tool, r.hash_ids, r.hints)
                                        for r in s.rounds])) for s in ss]

    for seed, rate in ((0, 2.0), (11, 7.3)):
        got = generate(preset, rate, (2 * CHUNK + 100) / rate, seed)  # over two chunks
        assert len(got) > 2 * CHUNK
        assert fields(got) == fields(_reference_generate(preset, rate, (2 * CHUNK + 100) / rate, seed))
    assert generate(preset, 1e-3, 1.0, 0) == _reference_generate(preset, 1e-3, 1.0, 0) == []


def test_round6_is_pythons_round():
    from ampd.workload.presets import _round6

    rng = np.random.default_rng(4)
    x = np.concatenate([rng.random(20_000) * 10.0 ** rng.integers(-8, 12, 20_000),
                        np.arange(-3000, 3000) / 128,                      # exact ties: to even
                        (np.arange(1, 3000) + 0.5) / 1e6,                  # ties as written, not as stored
                        np.nextafter((np.arange(1, 3000) + 0.5) / 1e6, 1),
                        [0.0, -0.0, 1e-9, -1e-9, 2.0 ** 53, 1e300, 5e-324, np.inf, -np.inf, np.nan]])
    assert [repr(v) for v in _round6(x)] == [repr(round(v, 6)) for v in x.tolist()]


def test_round_ids_follow_hash_ids_so_shared_blocks_share_tokens():
    from ampd.workload.ids import filler_ids, round_ids

    assert round_ids(40, 7) == filler_ids(40, 7)  # no hash ids: fillers as before
    # ... and a session's prompt begins with ids of its own, so nothing the trace does not share is shared
    a0, b0 = round_ids(40, 0, session="a"), round_ids(40, 0, session="b")
    assert a0[2:] == b0[2:] == filler_ids(40)[2:] and a0[:2] != b0[:2] and a0 == round_ids(40, 0, session="a")
    assert round_ids(40, 7, session="a") == filler_ids(40, 7)  # a later round's input: as before
    a = round_ids(1100, 0, (1, 2, 3), block_tokens=512)
    b = round_ids(1200, 0, (1, 2, 9), block_tokens=512)
    c = round_ids(600, 0, (5, 2), block_tokens=512)
    assert len(a) == 1100 and len(b) == 1200 and len(c) == 600
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]  # blocks 1, 2 shared; 3 and 9 differ
    assert a[:512] != c[:512]
    assert round_ids(100, 0, (1, 2), block_tokens=512) == a[:100]  # a prompt shorter than its blocks
    assert round_ids(1300, 0, (1,), block_tokens=512)[512:] == filler_ids(788, 512)  # past the hashed blocks
