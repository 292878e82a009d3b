"""Pure worker cores: the state and decisions of one decode worker and one prefill worker.

No I/O, no clock reads (time is an argument), no asyncio, gRPC or Redis: the live services drive
these cores with an engine, NIXL and gRPC, and the simulator (``ampd.sim``) drives the same cores on
its virtual clock. The shape follows a scheduler's two calls: ask what runs next
(``DecodeCore.schedule``, ``PrefillCore.next``), run it, report it back (``run_done``,
``prefill_done``, ``finish``). Each module's docstring gives its protocol; docs/simulator.md the
timing model.
"""
from .decode import (ADMITTED, FAILED, IDLE, KV_ADMISSION, KV_EXHAUSTED, PREFILLING, STEPPING, WAITING, DecodeCore,
                     DecodeRun, DecodeSession, LocalPrefill, affine_ctx_coef, steps_done)
from .prefill import KvRead, PrefillCore, PrefillWork

__all__ = ["DecodeCore", "DecodeSession", "DecodeRun", "LocalPrefill", "PrefillCore", "PrefillWork", "KvRead",
           "steps_done", "affine_ctx_coef", "IDLE", "STEPPING", "PREFILLING", "ADMITTED", "WAITING", "FAILED",
           "KV_ADMISSION", "KV_EXHAUSTED"]
