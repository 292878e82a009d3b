"""Session binding: which decode worker owns a new session's KV for its whole life."""

from __future__ import annotations

from collections.abc import Sequence

from .types import WorkerView

__all__ = ["bind"]


def bind(decode_workers: Sequence[WorkerView]) -> str:
    """Return the id of the decode worker with the most free KV tokens.

    Ties go to the lowest ``worker_id`` (string order), so the choice does not depend on the
    order of ``decode_workers``. Raises ``ValueError`` when there is no decode worker.
    """
    if not decode_workers:
        raise ValueError("bind: no decode workers to bind the session to")
    it = iter(decode_workers)
    best = next(it)
    best_free = best.kv_free_tokens
    best_id = best.worker_id
    for w in it:
        free = w.kv_free_tokens
        if free > best_free or (free == best_free and w.worker_id < best_id):
            best_free = free
            best_id = w.worker_id
    return best_id
