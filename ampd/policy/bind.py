"""Session binding: which decode worker owns a new session's KV for its whole life."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .order import before
from .types import WorkerView

__all__ = ["bind"]


def bind(decode_workers: Sequence[WorkerView], promised: Mapping[str, int] | None = None,
         need: int = 0) -> str | None:
    """Return the id of the decode worker with the most free KV tokens, net of the tokens
    ``promised`` to sessions in flight there (``kv_free_tokens - promised[id]``), among those with at
    least ``need`` such tokens (any worker when ``need`` is 0); None when none has (admission then
    waits or refuses).

    Counting what is promised, and not only what a worker last published, spreads sessions opened
    at once: each open sees the ones before it even before any worker has reported them.
    Ties go to the first worker in the worker order (``ampd.policy.order``: ``decode-2`` before
    ``decode-10``), so the choice does not depend on the order of ``decode_workers``. Raises ``ValueError`` when there is no decode worker.
    """
    if not decode_workers:
        raise ValueError("bind: no decode workers to bind the session to")
    promised = promised or {}
    best_id: str | None = None
    best_free = 0
    for w in decode_workers:
        free = w.kv_free_tokens - promised.get(w.worker_id, 0)
        if need > 0 and free < need:  # (need 0: any worker, even one over its capacity)
            continue
        if best_id is None or free > best_free or (free == best_free and before(w.worker_id, best_id)):
            best_free = free
            best_id = w.worker_id
    return best_id
