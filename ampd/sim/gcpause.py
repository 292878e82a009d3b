"""``gc_paused``: the cyclic garbage collector off for a paper-scale run or report."""
from __future__ import annotations

import gc
from contextlib import contextmanager

__all__ = ["gc_paused"]


@contextmanager
def gc_paused():
    """Pause CPython's cyclic garbage collector for a block (restored after).

    A paper-scale run keeps millions of long-lived objects (sessions, rounds, heap entries); every
    generation-2 collection walks all of them, and collections are triggered by allocation counts,
    so their cost grows with the run (benchmarks/sim_speed.py measures it). Reference counting
    still frees everything that is not in a cycle; cycles wait for the block to end.

    On the way out, what the block allocated goes straight to the oldest generation: left in the
    youngest, the first collections after the block would walk all of it (the next allocation
    triggers one: ~4 % of a 10k-session simulation, before its own pause began). ``freeze`` then
    ``unfreeze`` moves every tracked object there, two list splices; a full collection still
    finds any cycle among them."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if was:
            gc.enable()
