"""The hot dataclasses' written-out ``__init__`` (compiled, a generated one runs as interpreted
Python) takes exactly the fields, in their order, with their defaults; a factory default is None."""
import dataclasses
import inspect

import pytest

from ampd.policy.admit import Verdict
from ampd.policy.kvtier import PoolState, TierDecision, ToolPause
from ampd.policy.types import PrefillTask, RouteDecision, WorkerView
from ampd.worker.decode_kv import DecodeSession
from ampd.worker.decode_run import DecodeRun, LocalPrefill
from ampd.worker.decode_tier import KVMove
from ampd.worker.prefill import KvRead, PrefillWork

WRITTEN_OUT = (PrefillTask, WorkerView, RouteDecision, DecodeRun, PrefillWork, ToolPause, PoolState, TierDecision,
               KVMove, KvRead, LocalPrefill, Verdict)


@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda c: c.__name__)
def test_init_takes_the_fields(cls):
    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if [p.kind for p in params] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        pytest.skip("compiled: __init__ shows no signature (the run on the sources checks it)")
    assert [p.name for p in params] == [f.name for f in fields]
    for f, p in zip(fields, params):
        if f.default is not dataclasses.MISSING:
            assert p.default == f.default and type(p.default) is type(f.default), f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert p.default is None, f.name
        else:
            assert p.default is inspect.Parameter.empty, f.name


# a value for each field without a default, of its type (compiled, __init__ checks the types)
TASK = PrefillTask("s", 1, 2, 3)
SAMPLES = {"session_id": "s", "round": 1, "l_hist": 2, "l_incr": 3, "worker_id": "w", "kind": "decode", "tp": 2,
           "window_mean_s": 0.5, "target": "t", "local": True, "reason": "r", "steps": 4, "first_s": 0.25,
           "growth_s": 0.125, "batch": 5, "end": 9.5, "task": TASK, "read_s": 0.1, "compute_s": 0.2, "write_s": 0.3,
           "total_s": 0.6, "tool": "search", "expected_s": 1.5, "kv_blocks": 6, "offload_s": 0.7, "prefetch_s": 0.8,
           "reprefill_s": 0.9, "device_blocks": 10, "device_used": 3, "action": "keep", "direction": "to_host",
           "tokens": 11, "seconds": 0.4, "session": DecodeSession("s"), "last": False}


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
