"""The session trace: data types and the JSON Lines file format (docs/workload.md).

One session per line::

    {"id": "s1", "arrival": 0.52, "rounds": [{"input": 703, "output": 50, "tool_s": 1.2},
                                              {"input": 95, "output": 60}]}

Only this module reads or writes trace files; everything else takes ``Session`` values.
"""
from __future__ import annotations

import gzip
import io
import json
import math
import os
from dataclasses import dataclass
from typing import IO, Any, Iterable, Iterator

from ampd.policy.hints import Hints, hints_from_obj, hints_to_obj

__all__ = ["Round", "Session", "TraceError", "load_trace", "dump_trace", "session_from_obj",
           "session_to_obj", "check_hash_ids", "sessions_from_columns"]


class TraceError(ValueError):
    """A trace file (or row) is malformed; the message names the file, line and field."""


@dataclass(frozen=True, slots=True, init=False)
class Round:
    """One round of a session: ``input`` new tokens to prefill, then ``output`` tokens to decode,
    then (unless it is the last round) an environment/tool interaction of ``tool_s`` seconds whose
    result is the next round's input. ``tool_s`` None means 0; ``tool`` optionally names a sidecar
    tool (None: the built-in replay tool, which sleeps ``tool_s``). ``hash_ids`` optionally names
    the blocks of the round's whole prompt (history and input) by prefix hashes, as Mooncake's
    traces do (512-token blocks): rounds, of any session, with equal leading ids share that prefix's
    KV under prefix sharing (None: unknown, nothing shared). ``hints`` optionally carries the agent
    hints the round's turn is sent with (``ampd.policy.hints``; the session API's ``Turn.hints``)."""

    input: int
    output: int
    tool_s: float | None = None
    tool: str | None = None
    hash_ids: tuple[int, ...] | None = None
    hints: Hints | None = None

    # (written out: the dataclass's generated __init__ runs as interpreted Python even where compiled,
    # one object.__setattr__ by name per field; here, compiled, they are direct stores: 1.1M rounds
    # for 100k GAIA sessions. tests/unit/test_inits.py holds it to the fields)
    def __init__(self, input: int, output: int, tool_s: float | None = None, tool: str | None = None,
                 hash_ids: tuple[int, ...] | None = None, hints: Hints | None = None) -> None:
        object.__setattr__(self, "input", input)
        object.__setattr__(self, "output", output)
        object.__setattr__(self, "tool_s", tool_s)
        object.__setattr__(self, "tool", tool)
        object.__setattr__(self, "hash_ids", hash_ids)
        object.__setattr__(self, "hints", hints)

    @property
    def tool_delay_s(self) -> float:
        """``tool_s`` with None read as 0.0."""
        return 0.0 if self.tool_s is None else float(self.tool_s)


@dataclass(frozen=True, slots=True, init=False)
class Session:
    """A multi-round conversation arriving ``arrival`` seconds after the trace start."""

    id: str
    arrival: float
    rounds: tuple[Round, ...]

    # (written out, as Round's)
    def __init__(self, id: str, arrival: float, rounds: tuple[Round, ...]) -> None:
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "arrival", arrival)
        object.__setattr__(self, "rounds", rounds)

    @property
    def input_tokens(self) -> int:
        return sum(r.input for r in self.rounds)

    @property
    def output_tokens(self) -> int:
        return sum(r.output for r in self.rounds)

    @property
    def context_tokens(self) -> int:
        """KV tokens the session holds after its last round (every input and output)."""
        return self.input_tokens + self.output_tokens


def sessions_from_columns(prefix: str, first: int, arrivals: list[float], nrounds: list[int], inputs: list[int],
                          outputs: list[int], tool_s: list[float]) -> list[Session]:
    """Generated sessions (``ampd.workload.presets``) from their columns: the i-th (id
    ``PREFIX-nnnnnn``, n = ``first`` + i, arriving at ``arrivals[i]``) has the next ``nrounds[i]``
    entries of ``inputs``, ``outputs`` and ``tool_s``, its last round no tool call.
    Here, compiled, so that building 1M rounds costs no interpreted call per round."""
    sessions: list[Session] = []
    o = 0
    for i in range(len(arrivals)):
        k = nrounds[i]
        rounds = [Round(inputs[j], outputs[j], tool_s[j]) for j in range(o, o + k - 1)]
        if k:
            rounds.append(Round(inputs[o + k - 1], outputs[o + k - 1], None))
        o += k
        sessions.append(Session(f"{prefix}-{first + i:06d}", arrivals[i], tuple(rounds)))
    return sessions


# --------------------------------------------------------------------------------------------
# validation helpers (shared with the Mooncake importer)

def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_int(v: Any, field: str, minimum: int, where: str) -> int:
    """An integer >= minimum (an integral float such as 703.0 is accepted)."""
    if _is_number(v) and math.isfinite(v) and float(v).is_integer() and v >= minimum:
        return int(v)
    raise TraceError(f"{where}: field '{field}': must be an integer >= {minimum}, got {_show(v)}")


def check_time(v: Any, field: str, where: str) -> float:
    """A finite number >= 0 (seconds)."""
    if _is_number(v) and math.isfinite(v) and v >= 0:
        return float(v)
    raise TraceError(f"{where}: field '{field}': must be a finite number >= 0, got {_show(v)}")


MAX_HASH_ID = (1 << 64) - 1


def check_hash_ids(v: Any, field: str, where: str) -> tuple[int, ...]:
    """A list of integers in [0, 2^64) (block hashes), as a tuple."""
    if not isinstance(v, list):
        raise TraceError(f"{where}: field '{field}': must be a list, got {_show(v)}")
    for i, h in enumerate(v):
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID:
            raise TraceError(f"{where}: field '{field}[{i}]': must be an integer in [0, 2^64), got {_show(h)}")
    return tuple(v)


def _show(v: Any) -> str:
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def session_from_obj(obj: Any, where: str) -> Session:
    """Validate one decoded JSON value as a session; ``where`` prefixes error messages."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a session must be a JSON object, got {type(obj).__name__}")
    if "id" not in obj:
        raise TraceError(f"{where}: field 'id': missing")
    sid = obj["id"]
    if not isinstance(sid, str) or not sid:
        raise TraceError(f"{where}: field 'id': must be a non-empty string, got {_show(sid)}")
    if "arrival" not in obj:
        raise TraceError(f"{where}: field 'arrival': missing")
    arrival = check_time(obj["arrival"], "arrival", where)
    if "rounds" not in obj:
        raise TraceError(f"{where}: field 'rounds': missing")
    raw_rounds = obj["rounds"]
    if not isinstance(raw_rounds, list) or not raw_rounds:
        raise TraceError(f"{where}: field 'rounds': must be a non-empty list, got {_show(raw_rounds)}")
    rounds = []
    for i, r in enumerate(raw_rounds):
        f = f"rounds[{i}]"
        if not isinstance(r, dict):
            raise TraceError(f"{where}: field '{f}': must be an object, got {_show(r)}")
        for key in ("input", "output"):
            if key not in r:
                raise TraceError(f"{where}: field '{f}.{key}': missing")
        inp = check_int(r["input"], f"{f}.input", 1, where)
        out = check_int(r["output"], f"{f}.output", 1, where)
        tool_s = r.get("tool_s")
        if tool_s is not None:
            tool_s = check_time(tool_s, f"{f}.tool_s", where)
        tool = r.get("tool")
        if tool is not None and (not isinstance(tool, str) or not tool):
            raise TraceError(f"{where}: field '{f}.tool': must be a non-empty string, got {_show(tool)}")
        hash_ids = r.get("hash_ids")
        if hash_ids is not None:
            hash_ids = check_hash_ids(hash_ids, f"{f}.hash_ids", where)
        hints = r.get("hints")
        if hints is not None:
            try:
                hints = hints_from_obj(hints, f"{f}.hints")
            except ValueError as exc:
                raise TraceError(f"{where}: field '{str(exc).split(':', 1)[0]}': {str(exc).split(':', 1)[1].strip()}"
                                 ) from None
        rounds.append(Round(inp, out, tool_s, tool, hash_ids, hints))
    return Session(sid, arrival, tuple(rounds))


def session_to_obj(s: Session) -> dict:
    rounds = []
    for r in s.rounds:
        d: dict[str, Any] = {"input": r.input, "output": r.output}
        if r.tool_s is not None:
            d["tool_s"] = r.tool_s
        if r.tool is not None:
            d["tool"] = r.tool
        if r.hash_ids is not None:
            d["hash_ids"] = list(r.hash_ids)
        if r.hints is not None:
            d["hints"] = hints_to_obj(r.hints)
        rounds.append(d)
    return {"id": s.id, "arrival": s.arrival, "rounds": rounds}


# --------------------------------------------------------------------------------------------
# files

def open_text(path: str | os.PathLike, mode: str) -> IO[str]:
    """Open a UTF-8 text file for writing; a name ending in .gz is gzip-compressed."""
    if str(path).endswith(".gz"):
        return io.TextIOWrapper(gzip.GzipFile(path, mode + "b"), encoding="utf-8", newline="")
    return open(path, mode, encoding="utf-8", newline="")


def iter_json_lines(path: str | os.PathLike) -> Iterator[tuple[int, str, Any]]:
    """Yield (lineno, where, value) for every non-blank line; where is "FILE line N"."""
    name = os.fspath(path)
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rb") as fh:
        lineno = 0
        while True:
            try:
                raw = fh.readline()
            except (EOFError, gzip.BadGzipFile) as exc:
                raise TraceError(f"{name}: unreadable gzip data ({exc})") from None
            if not raw:
                return
            lineno += 1
            where = f"{name} line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceError(f"{where}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
            yield lineno, where, value


def load_trace(path: str | os.PathLike) -> list[Session]:
    """Read and validate a trace; sessions come back sorted by arrival (stable for ties).

    Raises TraceError naming the line and field of the first problem, OSError if the file
    cannot be opened."""
    sessions: list[Session] = []
    first_line: dict[str, int] = {}
    for lineno, where, obj in iter_json_lines(path):
        s = session_from_obj(obj, where)
        if s.id in first_line:
            raise TraceError(f"{where}: field 'id': duplicate id {_show(s.id)} "
                             f"(first used on line {first_line[s.id]})")
        first_line[s.id] = lineno
        sessions.append(s)
    sessions.sort(key=lambda s: s.arrival)
    return sessions


def dump_trace(sessions: Iterable[Session], path: str | os.PathLike) -> int:
    """Write sessions as JSON Lines (in the given order); returns how many were written."""
    n = 0
    with open_text(path, "w") as fh:
        for s in sessions:
            fh.write(json.dumps(session_to_obj(s), separators=(", ", ": ")))
            fh.write("\n")
            n += 1
    return n
