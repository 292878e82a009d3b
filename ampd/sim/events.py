"""The simulator's event codes: a heap entry is ``(time, seq, code, obj)`` (ints: cheap to compare
in the dispatch loop of ``ampd.sim.loop``; Final: compiled, each use is the constant, not a
lookup in the module's globals)."""
from typing import Final

STEP_DONE: Final = 0  # a run of decode steps ended (obj: (worker, run version))
PREFILL_DONE: Final = 1  # a local prefill or one of its chunks ended
REMOTE_DONE: Final = 2  # a remote prefill's new KV is written back
COMPUTE_DONE: Final = 3  # a remote prefill's compute ended (NIC contention: its write-back queues next)
ROUND_READY: Final = 4  # a round's input is ready at its decode worker
PIN_EXPIRED: Final = 5  # a session's KV pin expired during its tool call (Continuum)
DISPATCH: Final = 7  # a round reaches the coordinator and is routed (after PathLatency.dispatch_s)
HANDOFF: Final = 8  # a remote prefill's KV notification reaches the decode worker
COMPUTE_START: Final = 9  # a remote prefill's history read ended: its compute starts (KV overlap)
ADMIT_CHECK: Final = 10  # a session waiting for admission is judged again (its wait or TTFT budget ends)

TIER_READY: Final = 11  # a round whose KV came back from the host tier (or whose room a move freed) is routed
TIER_PREFETCH: Final = 12  # an offloaded session's prefetch time (its tool's expected end, less the transfer)
TIER_LOCAL: Final = 13  # a round routed locally before its KV was back on the device: its prefill is queued now
TIER_REMOTE: Final = 14  # a remote prefill timed to end as its KV is back on the device reaches its prefill worker
