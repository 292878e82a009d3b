"""Trace file format: load_trace / dump_trace and their error messages."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ampd.workload import Round, Session, TraceError, dump_trace, load_trace


def _write(tmp_path, lines, name="trace.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    return p


GOOD = {"id": "s1", "arrival": 0.5, "rounds": [{"input": 703, "output": 50, "tool_s": 1.2},
                                                {"input": 95, "output": 60}]}


def test_load_valid_and_sorted(tmp_path):
    p = _write(tmp_path, [
        {"id": "b", "arrival": 2.0, "rounds": [{"input": 5, "output": 1}]},
        "",
        "   ",
        GOOD,
        {"id": "c", "arrival": 2.0, "rounds": [{"input": 7, "output": 2}], "note": "x"},
    ])
    ss = load_trace(p)
    assert [s.id for s in ss] == ["s1", "b", "c"]          # by arrival, stable for ties
    s1 = ss[0]
    assert s1 == Session("s1", 0.5, (Round(703, 50, 1.2), Round(95, 60)))
    assert s1.rounds[1].tool_s is None and s1.rounds[1].tool_delay_s == 0.0
    assert s1.input_tokens == 798 and s1.output_tokens == 110 and s1.context_tokens == 908


def test_tool_name_and_integral_floats(tmp_path):
    p = _write(tmp_path, [{"id": "x", "arrival": 0, "rounds": [
        {"input": 10.0, "output": 3, "tool_s": 0, "tool": "search"}, {"input": 1, "output": 1}]}])
    (s,) = load_trace(p)
    assert s.rounds[0] == Round(10, 3, 0.0, "search")
    assert isinstance(s.rounds[0].input, int)


@pytest.mark.parametrize("line, field, text", [
    ('{"id": "a", "arrival": 0, "rounds": [{"input": 1, "output": 1}, {"input": 2, "output": -3}]}',
     "rounds[1].output", "must be an integer >= 1, got -3"),
    ('{"id": "a", "arrival": 0, "rounds": [{"input": 0, "output": 1}]}', "rounds[0].input", "got 0"),
    ('{"id": "a", "arrival": 0, "rounds": [{"input": 1.5, "output": 1}]}', "rounds[0].input", "got 1.5"),
    ('{"id": "a", "arrival": 0, "rounds": [{"input": true, "output": 1}]}', "rounds[0].input", "got true"),
    ('{"id": "a", "arrival": 0, "rounds": [{"output": 1}]}', "rounds[0].input", "missing"),
    ('{"id": "a", "arrival": 0, "rounds": [{"input": 1, "output": 1, "tool_s": -1}]}',
     "rounds[0].tool_s", "finite number >= 0"),
    ('{"id": "a", "arrival": 0, "rounds": [{"input": 1, "output": 1, "tool": 3}]}', "rounds[0].tool", "string"),
    ('{"id": "a", "arrival": 0, "rounds": ["x"]}', "rounds[0]", "must be an object"),
    ('{"id": "a", "arrival": 0, "rounds": []}', "rounds", "non-empty list"),
    ('{"id": "a", "arrival": 0, "rounds": {}}', "rounds", "non-empty list"),
    ('{"id": "a", "arrival": 0}', "rounds", "missing"),
    ('{"id": "a", "arrival": -1, "rounds": [{"input": 1, "output": 1}]}', "arrival", "got -1"),
    ('{"id": "a", "arrival": "1", "rounds": [{"input": 1, "output": 1}]}', "arrival", "finite"),
    ('{"id": "a", "arrival": NaN, "rounds": [{"input": 1, "output": 1}]}', "arrival", "finite"),
    ('{"id": "a", "arrival": Infinity, "rounds": [{"input": 1, "output": 1}]}', "arrival", "finite"),
    ('{"id": "", "arrival": 0, "rounds": [{"input": 1, "output": 1}]}', "id", "non-empty string"),
    ('{"id": 5, "arrival": 0, "rounds": [{"input": 1, "output": 1}]}', "id", "non-empty string"),
    ('{"arrival": 0, "rounds": [{"input": 1, "output": 1}]}', "id", "missing"),
    ('{"id": "s1", "arrival": 0, "rounds": [{"input": 1, "output": 1}]}', "id", "duplicate id \"s1\" (first used on line 2)"),
])
def test_errors_name_line_and_field(tmp_path, line, field, text):
    p = _write(tmp_path, ["", json.dumps(GOOD), "", "", "", "", line])
    with pytest.raises(TraceError) as e:
        load_trace(p)
    msg = str(e.value)
    assert msg.startswith(f"{p} line 7: field '{field}': "), msg
    assert text in msg


@pytest.mark.parametrize("line, text", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ("3", "must be a JSON object"),
])
def test_errors_whole_line(tmp_path, line, text):
    p = _write(tmp_path, [json.dumps(GOOD), line])
    with pytest.raises(TraceError, match=rf"line 2: .*{text}"):
        load_trace(p)


def test_not_utf8(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match="line 2: not UTF-8"):
        load_trace(p)


def test_missing_file_is_oserror(tmp_path):
    with pytest.raises(OSError):
        load_trace(tmp_path / "nope.jsonl")


def test_empty_file(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text("\n\n")
    assert load_trace(p) == []


def test_dump_omits_absent_fields(tmp_path):
    s = Session("a", 1.25, (Round(3, 4, 0.5, "web"), Round(5, 6)))
    p = tmp_path / "o.jsonl"
    assert dump_trace([s], p) == 1
    obj = json.loads(p.read_text())
    assert obj == {"id": "a", "arrival": 1.25, "rounds": [
        {"input": 3, "output": 4, "tool_s": 0.5, "tool": "web"}, {"input": 5, "output": 6}]}


def test_hash_ids_kept_and_old_traces_load(tmp_path):
    old = load_trace(_write(tmp_path, [GOOD]))
    assert [r.hash_ids for r in old[0].rounds] == [None, None]
    s = Session("a", 0.0, (Round(3, 4, 1.0, None, (7, 2**64 - 1)), Round(5, 6, None, None, ())))
    p = tmp_path / "h.jsonl"
    dump_trace([s], p)
    assert json.loads(p.read_text())["rounds"] == [
        {"input": 3, "output": 4, "tool_s": 1.0, "hash_ids": [7, 2**64 - 1]},
        {"input": 5, "output": 6, "hash_ids": []}]
    assert load_trace(p) == [s]


@pytest.mark.parametrize("value, text", [
    (3, "field 'rounds[0].hash_ids': must be a list, got 3"),
    ([1, -1], "field 'rounds[0].hash_ids[1]': must be an integer in [0, 2^64), got -1"),
    ([1.5], "field 'rounds[0].hash_ids[0]'"),
    ([True], "field 'rounds[0].hash_ids[0]'"),
    ([2**64], "field 'rounds[0].hash_ids[0]'"),
])
def test_bad_hash_ids(tmp_path, value, text):
    p = _write(tmp_path, [{"id": "s", "arrival": 0, "rounds": [{"input": 1, "output": 1, "hash_ids": value}]}])
    with pytest.raises(TraceError) as e:
        load_trace(p)
    assert str(e.value).startswith(f"{p} line 1: {text}")


def test_gzip_roundtrip(tmp_path):
    s = [Session("a", 0.0, (Round(3, 4),)), Session("b", 1.0, (Round(1, 1, 2.0), Round(2, 2)))]
    p = tmp_path / "t.jsonl.gz"
    dump_trace(s, p)
    assert load_trace(p) == s


_round = st.builds(Round, st.integers(1, 10**6), st.integers(1, 10**5),
                   st.one_of(st.none(), st.floats(0, 1e4, allow_nan=False)),
                   st.one_of(st.none(), st.text(min_size=1, max_size=8)),
                   st.one_of(st.none(), st.lists(st.integers(0, 2**64 - 1), max_size=4).map(tuple)))
_session = st.builds(Session, st.text(min_size=1, max_size=12),
                     st.floats(0, 1e6, allow_nan=False),
                     st.lists(_round, min_size=1, max_size=5).map(tuple))


@settings(max_examples=25, deadline=None)
@given(st.lists(_session, max_size=6, unique_by=lambda s: s.id))
def test_roundtrip_property(tmp_path_factory, sessions):
    p = tmp_path_factory.mktemp("rt") / "t.jsonl"
    dump_trace(sessions, p)
    assert load_trace(p) == sorted(sessions, key=lambda s: s.arrival)
