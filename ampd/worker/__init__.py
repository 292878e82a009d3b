"""Pure worker cores: the state and decisions of one decode worker and one prefill worker.

No I/O, no clock reads (time is an argument), no asyncio, gRPC or Redis: the live services drive
these cores with an engine, NIXL and gRPC, and the simulator (``ampd.sim``) drives the same cores on
its virtual clock. Both cores have a scheduler's shape: ``schedule(now)`` says what runs next (a
dataclass: ``LocalPrefill``, ``DecodeRun``, ``PrefillWork``, or None), the driver runs it, and
``update(work, now)`` applies its end; the rest of their calls are events (a round is ready, a task
arrives, a session ends). Each module's docstring gives its protocol; docs/simulator.md the timing
model.
"""
from .decode import (ADMITTED, FAILED, IDLE, KV_ADMISSION, KV_EXHAUSTED, PREFILLING, STEPPING, WAITING, DecodeCore,
                     DecodeRun, DecodeSession, LocalPrefill, affine_ctx_coef, steps_done)
from .prefill import KvRead, PrefillCore, PrefillWork

__all__ = ["DecodeCore", "DecodeSession", "DecodeRun", "LocalPrefill", "PrefillCore", "PrefillWork", "KvRead",
           "steps_done", "affine_ctx_coef", "IDLE", "STEPPING", "PREFILLING", "ADMITTED", "WAITING", "FAILED",
           "KV_ADMISSION", "KV_EXHAUSTED"]
