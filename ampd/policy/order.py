"""One worker order for the whole tree: natural order of worker ids (``prefill-2`` before
``prefill-10``), the order the launcher and the simulator number workers in.

Algorithm 1 visits prefill workers in a seeded random order over list positions, and every tie
(binding, least-loaded, cost model, admission) goes to the first worker in this order: the
coordinator and the simulator must list workers alike for one seed to take the same decisions.
Pure.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TypeVar

__all__ = ["worker_key", "in_worker_order", "before"]

_DIGITS = re.compile(r"(\d+)")
_KEYS: dict[str, tuple] = {}  # worker id -> its key (a deployment has few ids; ties are rare)

T = TypeVar("T")


def worker_key(worker_id: str) -> tuple:
    """The sort key of ``worker_id``: its text and number runs, numbers compared as numbers
    (``decode-9`` < ``decode-10``; ``a-1`` < ``b-0``)."""
    key = _KEYS.get(worker_id)
    if key is None:
        parts = _DIGITS.split(worker_id)
        # (is_number, value) pairs keep text and numbers comparable across differently shaped ids
        key = tuple((1, int(p), p) if i % 2 else (0, 0, p) for i, p in enumerate(parts) if p)
        if len(_KEYS) < 65536:
            _KEYS[worker_id] = key
    return key


def before(a: str, b: str) -> bool:
    """``a`` comes before ``b`` in the worker order (a tie-break)."""
    return worker_key(a) < worker_key(b)


def in_worker_order(items: Iterable[T], key=lambda w: w.worker_id) -> list[T]:
    """``items`` (anything with a ``worker_id``, or ``key`` to get one) in the worker order."""
    return sorted(items, key=lambda x: worker_key(key(x)))
