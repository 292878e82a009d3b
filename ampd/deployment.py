"""Deployment SPEC strings: replica groups ``tpN*R``, comma-separated (DESIGN section 8).

``tp4*2`` is two replicas of TP 4; ``tp4*1,tp2*2`` mixes degrees; ``tp8`` is short for ``tp8*1``.
An empty string, ``none`` or ``-`` is the empty deployment (no workers of that kind).
"""
from __future__ import annotations

import re

__all__ = ["SpecError", "parse_spec", "format_spec", "expand_spec"]

_GROUP = re.compile(r"^tp(\d+)(?:\*(\d+))?$")
_EMPTY = {"", "none", "-", "0"}


class SpecError(ValueError):
    """A malformed deployment SPEC; the message is one line naming the bad part."""


def parse_spec(spec: str | None) -> tuple[tuple[int, int], ...]:
    """``"tp4*1,tp2*2"`` -> ``((4, 1), (2, 2))``: (tp, replicas) per group, in the order given."""
    if spec is None:
        return ()
    text = spec.strip().lower()
    if text in _EMPTY:
        return ()
    groups: list[tuple[int, int]] = []
    for part in text.split(","):
        part = part.strip()
        m = _GROUP.match(part)
        if not m:
            raise SpecError(f"bad replica group {part!r} in SPEC {spec!r}: expected tpN*R, e.g. tp4*2")
        tp = int(m.group(1))
        reps = int(m.group(2)) if m.group(2) is not None else 1
        if tp < 1:
            raise SpecError(f"bad replica group {part!r} in SPEC {spec!r}: TP degree must be >= 1")
        if reps < 1:
            raise SpecError(f"bad replica group {part!r} in SPEC {spec!r}: replica count must be >= 1")
        groups.append((tp, reps))
    return tuple(groups)


def expand_spec(groups) -> list[int]:
    """((4, 1), (2, 2)) -> [4, 2, 2]: one TP degree per worker."""
    return [tp for tp, reps in groups for _ in range(reps)]


def format_spec(groups) -> str:
    """Inverse of parse_spec (``"none"`` for the empty deployment)."""
    return ",".join(f"tp{tp}*{reps}" for tp, reps in groups) or "none"
