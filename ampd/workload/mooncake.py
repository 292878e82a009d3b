"""Import Mooncake-style request traces (JSON Lines of requests) as sessions.

A row is one request: ``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens), optional
``hash_ids`` (prefix-cache block hashes of the request's whole input, one per 512-token block; kept
on the round, so the simulator sees the sharing) and optionally a
session key: ``session_id``, ``session`` or ``conversation_id`` (first present wins). Rows with
the same session key are the rounds of one session; a row without one is a single-round session.
The rules that turn requests into rounds are documented in docs/workload.md.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from .trace import Round, Session, TraceError, _show, check_hash_ids, check_int, iter_json_lines

__all__ = ["import_mooncake", "SESSION_KEYS", "HASH_BLOCK_TOKENS"]

SESSION_KEYS = ("session_id", "session", "conversation_id")
HASH_BLOCK_TOKENS = 512  # tokens a Mooncake hash id covers


@dataclass(slots=True)
class _Row:
    lineno: int
    ts_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None


def _check_ts(v: Any, where: str) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    raise TraceError(f"{where}: field 'timestamp': must be a finite number (ms), got {_show(v)}")


def import_mooncake(path: str | os.PathLike) -> list[Session]:
    """Group a Mooncake-style trace into sessions, sorted by arrival.

    - arrival: first row's timestamp minus the earliest timestamp in the file, in seconds;
    - round 0 input: the first row's ``input_length``;
    - round k >= 1 input: ``input_length`` minus (previous row's ``input_length`` +
      ``output_length``), i.e. the tokens appended since the previous request; when that is not
      positive (the client did not resend the history) the row's whole ``input_length``;
    - tool_s after round k: the gap between row k's and row k+1's timestamps (seconds, >= 0).
      It includes the time the original system spent serving row k, so it is an upper bound on
      the real tool/think time;
    - output: ``output_length``;
    - hash_ids: the row's ``hash_ids`` (the blocks of its whole input), when present.
    Raises TraceError naming the line and field of the first bad row."""
    groups: dict[str, list[_Row]] = {}
    singles: list[tuple[str, _Row]] = []
    hinted: set[str] = set()
    for lineno, where, obj in iter_json_lines(path):
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: a request must be a JSON object, got {type(obj).__name__}")
        for field in ("timestamp", "input_length", "output_length"):
            if field not in obj:
                raise TraceError(f"{where}: field '{field}': missing")
        hashes = obj.get("hash_ids")
        row = _Row(lineno, _check_ts(obj["timestamp"], where),
                   check_int(obj["input_length"], "input_length", 1, where),
                   check_int(obj["output_length"], "output_length", 1, where),
                   None if hashes is None else check_hash_ids(hashes, "hash_ids", where))
        key = next((k for k in SESSION_KEYS if obj.get(k) is not None), None)
        if key is None:
            singles.append((f"row-{lineno:06d}", row))
            continue
        sid = obj[key]
        if isinstance(sid, bool) or not isinstance(sid, (str, int)) or sid == "":
            raise TraceError(f"{where}: field '{key}': must be a non-empty string or an integer, "
                             f"got {_show(sid)}")
        sid = str(sid)
        hinted.add(sid)
        groups.setdefault(sid, []).append(row)

    all_rows = [r for rows in groups.values() for r in rows] + [r for _, r in singles]
    t0 = min((r.ts_ms for r in all_rows), default=0.0)
    sessions = []
    for sid, rows in groups.items():
        rows.sort(key=lambda r: (r.ts_ms, r.lineno))
        sessions.append(_to_session(sid, rows, t0))
    for sid, row in singles:
        while sid in hinted:            # a session key that happens to look like ours
            sid += "_"
        hinted.add(sid)
        sessions.append(_to_session(sid, [row], t0))
    sessions.sort(key=lambda s: s.arrival)
    return sessions


def _to_session(sid: str, rows: list[_Row], t0_ms: float) -> Session:
    rounds = []
    for k, row in enumerate(rows):
        if k == 0:
            inp = row.input_length
        else:
            prev = rows[k - 1]
            inp = row.input_length - (prev.input_length + prev.output_length)
            if inp <= 0:
                inp = row.input_length
        tool_s = None
        if k + 1 < len(rows):
            tool_s = round(max(0.0, rows[k + 1].ts_ms - row.ts_ms) / 1000.0, 6)
        rounds.append(Round(inp, row.output_length, tool_s, None, row.hash_ids))
    return Session(sid, round((rows[0].ts_ms - t0_ms) / 1000.0, 6), tuple(rounds))
