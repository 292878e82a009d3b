"""Summary statistics of a trace, so users can check a trace against Table 1 or their own data."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .trace import Session

__all__ = ["trace_stats", "format_stats", "prefix_sharing"]


def _mean(xs) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def _pct(xs, q: float) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def prefix_sharing(sessions: Sequence[Session]) -> tuple[int, int]:
    """(round-0 hash blocks, those a session could share): a session, in arrival order, shares the
    leading hash ids of its first round that any earlier session's rounds named. An upper bound on
    cross-session prefix sharing (an unbounded cache, every earlier session's blocks still held);
    a session's later rounds reuse its own history anyway. (0, 0) without ``hash_ids``."""
    seen: set[int] = set()
    total = shared = 0
    for s in sorted(sessions, key=lambda s: s.arrival):
        ids = s.rounds[0].hash_ids or ()
        total += len(ids)
        for h in ids:
            if h not in seen:
                break
            shared += 1
        for r in s.rounds:
            seen.update(r.hash_ids or ())
    return total, shared


def trace_stats(sessions: Sequence[Session]) -> dict:
    """Means as Table 1 reads them: rounds per session; input ("prefill length") and output
    ("decode length") tokens per round, pooled over every round of every session."""
    nr = np.array([len(s.rounds) for s in sessions], dtype=float)
    inp = np.array([r.input for s in sessions for r in s.rounds], dtype=float)
    out = np.array([r.output for s in sessions for r in s.rounds], dtype=float)
    first = np.array([s.rounds[0].input for s in sessions], dtype=float)
    later = np.array([r.input for s in sessions for r in s.rounds[1:]], dtype=float)
    tools = np.array([r.tool_delay_s for s in sessions for r in s.rounds[:-1]], dtype=float)
    ctx = np.array([s.context_tokens for s in sessions], dtype=float)
    arr = np.array([s.arrival for s in sessions], dtype=float)
    span = float(arr.max() - arr.min()) if len(arr) > 1 else 0.0
    hash_blocks, shared_blocks = prefix_sharing(sessions)
    return {
        "sessions": len(sessions),
        "rounds": int(nr.sum()),
        "mean_rounds": _mean(nr),
        "max_rounds": int(nr.max()) if len(nr) else None,
        "mean_input_per_round": _mean(inp),
        "mean_output_per_round": _mean(out),
        "mean_initial_input": _mean(first),
        "mean_incremental_input": _mean(later),
        "p99_input_per_round": _pct(inp, 99),
        "p99_output_per_round": _pct(out, 99),
        "mean_tool_s": _mean(tools),
        "p99_tool_s": _pct(tools, 99),
        "mean_context_tokens": _mean(ctx),
        "max_context_tokens": int(ctx.max()) if len(ctx) else None,
        "first_arrival_s": float(arr.min()) if len(arr) else None,
        "last_arrival_s": float(arr.max()) if len(arr) else None,
        "arrival_rate_rps": (len(arr) - 1) / span if span > 0 else None,
        "first_round_hash_blocks": hash_blocks,
        "prefix_shared_frac": shared_blocks / hash_blocks if hash_blocks else None,
    }


_ROWS = (
    ("sessions", "sessions", "{:d}"),
    ("rounds", "rounds", "{:d}"),
    ("mean_rounds", "mean rounds / session", "{:.2f}"),
    ("max_rounds", "max rounds / session", "{:d}"),
    ("mean_input_per_round", "mean input tokens / round", "{:.2f}"),
    ("mean_output_per_round", "mean output tokens / round", "{:.2f}"),
    ("mean_initial_input", "mean initial input (round 0)", "{:.2f}"),
    ("mean_incremental_input", "mean incremental input (>= 1)", "{:.2f}"),
    ("p99_input_per_round", "p99 input tokens / round", "{:.0f}"),
    ("p99_output_per_round", "p99 output tokens / round", "{:.0f}"),
    ("mean_tool_s", "mean tool latency (s)", "{:.3f}"),
    ("p99_tool_s", "p99 tool latency (s)", "{:.3f}"),
    ("mean_context_tokens", "mean final context (tokens)", "{:.0f}"),
    ("max_context_tokens", "max final context (tokens)", "{:d}"),
    ("first_arrival_s", "first arrival (s)", "{:.3f}"),
    ("last_arrival_s", "last arrival (s)", "{:.3f}"),
    ("arrival_rate_rps", "arrival rate (sessions/s)", "{:.3f}"),
    ("prefix_shared_frac", "round-0 blocks shareable (frac)", "{:.3f}"),
)


def format_stats(stats: dict, targets: dict[str, float] | None = None) -> str:
    """A two- (or four-, with Table 1 ``targets``) column text table."""
    lines = []
    for key, label, fmt in _ROWS:
        v = stats.get(key)
        text = "-" if v is None else fmt.format(v)
        line = f"{label:<32}{text:>12}"
        if targets and key in targets and v is not None:
            t = targets[key]
            line += f"   table 1 {t:>9.2f}  ({(v - t) / t * 100:+.1f} %)"
        lines.append(line)
    return "\n".join(lines)
