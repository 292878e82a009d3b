"""The hot dataclasses' written-out ``__init__`` (compiled, a generated one runs as interpreted
Python) sets every field, on the sources and on the compiled cores. Its signature (the fields, in
their order, with their defaults): tests/unit/test_inits_signature.py."""
import dataclasses

import pytest

from ampd.policy.admit import Verdict
from ampd.policy.kvtier import PoolState, TierDecision, ToolPause
from ampd.policy.types import PrefillTask, RouteDecision, WorkerView
from ampd.worker.decode_kv import DecodeSession
from ampd.worker.decode_run import DecodeRun, LocalPrefill
from ampd.worker.decode_tier import KVMove
from ampd.worker.prefill import KvRead, PrefillWork
from ampd.workload.trace import Round, Session

WRITTEN_OUT = (PrefillTask, WorkerView, RouteDecision, DecodeRun, PrefillWork, ToolPause, PoolState, TierDecision,
               KVMove, KvRead, LocalPrefill, Verdict, Round, Session)


# a value for each field without a default, of its type (compiled, __init__ checks the types)
TASK = PrefillTask("s", 1, 2, 3)
SAMPLES = {"session_id": "s", "round": 1, "l_hist": 2, "l_incr": 3, "worker_id": "w", "kind": "decode", "tp": 2,
           "window_mean_s": 0.5, "target": "t", "local": True, "reason": "r", "steps": 4, "first_s": 0.25,
           "growth_s": 0.125, "batch": 5, "end": 9.5, "task": TASK, "read_s": 0.1, "compute_s": 0.2, "write_s": 0.3,
           "total_s": 0.6, "tool": "search", "expected_s": 1.5, "kv_blocks": 6, "offload_s": 0.7, "prefetch_s": 0.8,
           "reprefill_s": 0.9, "device_blocks": 10, "device_used": 3, "action": "keep", "direction": "to_host",
           "tokens": 11, "seconds": 0.4, "session": DecodeSession("s"), "last": False, "input": 12,
           "output": 13, "id": "i", "arrival": 1.75, "rounds": (Round(1, 2),)}


@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda c: c.__name__)
def test_init_sets_every_field(cls):
    fields = dataclasses.fields(cls)
    required = {f.name: SAMPLES[f.name] for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    obj = cls(**required)
    for f in fields:
        want = required.get(f.name, f.default if f.default is not dataclasses.MISSING else None)
        if f.default_factory is not dataclasses.MISSING:
            want = f.default_factory()
        got = getattr(obj, f.name)
        assert got is want or got == want, f.name
    assert dataclasses.replace(obj) == obj
