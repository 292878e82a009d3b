"""Unit tests of the worker cores' calls for live drivers: a measured decode step (step_by_step), the
batch a driver feeds its engine, a session dropped wherever it is (drop: its KV charge goes), a
failed prefill task (abort), and removing a queued task (PrefillQueue.discard)."""
from __future__ import annotations

import pytest

from ampd.policy import PrefillTask, make_queue
from ampd.worker import ADMITTED, WAITING, DecodeRun, LocalPrefill, PrefillCore
from tests.unit.test_worker_decode import SLO_, _core, _local, _sess
from tests.unit.test_worker_prefill import P


def test_step_by_step_uses_the_measured_end_and_runs_one_step():
    core = _core(step_by_step=True)
    s = _sess("s", 500, 10)
    core.round_ready(s, 0.0)
    core.first_token(s, 0.0)
    r = core.schedule(0.0)
    assert isinstance(r, DecodeRun) and r.steps == 9 and core.batch() == [s]
    assert list(core.update(r, 0.05)) == []  # measured: 50 ms, not the planned first_s
    assert core.step_idx == 1 and core.kv_used == 502
    assert core.view(0.05).window_mean_s == pytest.approx(0.05)
    r = core.schedule(0.05)
    core.update(r, 0.07)
    assert core.view(0.07).window_mean_s == pytest.approx((0.05 + 0.02) / 2)


def test_drop_releases_the_charge_wherever_the_session_is():
    core = _core(cap=10_000, step_by_step=True)
    queued, batch, pending = _sess("q", 300, 3), _sess("b", 400, 5), _sess("p", 100, 4)
    for s in (queued, batch, pending):
        assert core.round_ready(s, 0.0) == ADMITTED
    waiting_new = _sess("w", 20_000, 2)
    assert core.round_ready(waiting_new, 0.0) == WAITING
    core.first_token(batch, 0.0)
    r = core.schedule(0.0)
    core.update(r, 0.02)  # batch: 400 + 1 + 1 step
    _local(core, queued, 0.02)
    core.first_token(pending, 0.02)
    assert core.kv_used == 300 + 402 + 101 and core.queue_len == 1
    assert core.drop(waiting_new) is False and core.wait_need == 0
    assert core.drop(queued) is True and core.queue_len == 0 and len(core.queue) == 0
    assert core.drop(pending) is True and not core.pending
    assert core.drop(batch) is True and core.batch() == [] and core.batch_size == 0 and not core.exit_heap
    assert core.kv_used == 0 and core.admitted == 0 and not core.sessions and core.ctx_sum == 0
    assert core.schedule(0.03) is None


def test_drop_of_a_session_in_its_tool_call_and_of_a_chunked_prefill():
    core = _core(chunk=100)
    t = _sess("t", 50, 1)
    core.round_ready(t, 0.0)
    assert core.first_token(t, 0.0) is False
    core.round_end(t, last=False)
    core.tool_call(t)
    c = _sess("c", 300, 2)
    core.round_ready(c, 0.0)
    _local(core, c, 0.0)
    p = core.schedule(0.0)
    assert isinstance(p, LocalPrefill) and not p.last
    assert core.drop(t) and core.drop(c)
    assert core.update(p, p.end) == () and core.kv_used == 0 and core.schedule(p.end) is None


def test_prefill_abort_leaves_no_sample_and_keeps_the_read_ahead():
    core = PrefillCore("prefill-0", 1, P, make_queue("fcfs", P, SLO_, 1), kv_overlap=True)
    a, b = (PrefillTask(x, 1, 1000, 100, 0.0, "decode-0", 1) for x in "ab")
    core.submit(a, 0.0)
    core.submit(b, 0.0)
    assert core.schedule(0.0).task is a
    assert core.compute_started(0.01).task is b
    assert core.abort(0.02) is a and core.view(0.02).window_mean_s is None
    assert core.schedule(0.02).task is b
    with pytest.raises(RuntimeError, match="abort"):
        PrefillCore("p", 1, P, make_queue("fcfs", P, SLO_, 1)).abort(0.0)


@pytest.mark.parametrize("name", ["fcfs", "ttft-aware", "continuum"])
def test_queue_discard(name):
    q = make_queue(name, P, SLO_, 1)
    tasks = [PrefillTask(f"s{i}", i % 2, 10, 100 * (i + 1), 0.0) for i in range(4)]
    for t in tasks:
        q.push(t)
    assert q.discard("s2", 0) and not q.discard("s2", 0) and not q.discard("s1", 0)
    assert [t.session_id for t in q.tasks()] == [t.session_id for t in q.tasks() if t.session_id != "s2"]
    assert len(q) == 3 and "s2" not in {t.session_id for t in q.tasks()}
    assert q.predicted_total() == pytest.approx(sum(q.predict(t) for t in q.tasks()))
    for sid, rnd in (("s0", 0), ("s1", 1), ("s3", 1)):
        assert q.discard(sid, rnd)
    assert len(q) == 0 and q.predicted_total() == 0.0
