"""The coordinator's choice of workers to fence (ampd.state.liveness): a worker is heard at each
heartbeat (its liveness value changes) or new registration, and is due once silent for the bound;
the watcher's own gaps never count against the workers."""
from ampd.state.liveness import Liveness


def polls(lv: Liveness, start: float, end: float, regs, beats_at) -> dict[float, list]:
    """Observes every 0.5 s from ``start`` to ``end``; ``beats_at(t)`` gives the liveness values."""
    out, t = {}, start
    while t <= end + 1e-9:
        out[t] = lv.observe(regs(t) if callable(regs) else regs, beats_at(t), t)
        t += 0.5
    return out


def test_a_worker_silent_past_the_bound_is_due_and_a_beating_one_never():
    lv = Liveness(fence_after=10.0)
    due = polls(lv, 0.0, 20.0, {"d0": 5, "d1": 7},
                lambda t: {"d1": repr(t).encode(), **({"d0": repr(t).encode()} if t <= 4 else {})})
    assert all(d == [] for t, d in due.items() if t <= 14.0)
    assert all(d == [("d0", 5)] for t, d in due.items() if t > 14.0)  # last heard at 4


def test_an_unchanged_or_expired_key_is_silence_and_a_new_epoch_is_heard():
    lv = Liveness(fence_after=3.0)
    due = polls(lv, 0.0, 3.0, {"p0": 1}, lambda t: {"p0": b"same"} if t < 2 else {})
    assert due[3.0] == [] and lv.observe({"p0": 1}, {}, 3.5) == [("p0", 1)]
    lv.forget("p0")  # fenced
    due = polls(lv, 4.0, 7.5, {"p0": 2}, lambda t: {})  # registered anew (restarted): heard at 4
    assert due[7.0] == [] and due[7.5] == [("p0", 2)]


def test_the_watchers_own_gap_does_not_fence_anyone():
    lv = Liveness(fence_after=10.0)
    lv.observe({"d0": 1}, {"d0": b"x"}, 0.0)
    # the coordinator was stopped (or Redis unreachable) for 60 s: nobody is due on its return
    due = polls(lv, 60.0, 70.5, {"d0": 1}, lambda t: {"d0": b"x"})
    assert all(d == [] for t, d in due.items() if t <= 70.0) and due[70.5] == [("d0", 1)]


def test_a_worker_that_left_is_forgotten_and_due_ones_come_oldest_first():
    lv = Liveness(fence_after=2.0)
    lv.observe({"a": 1, "b": 1}, {"a": b"0"}, 0.0)
    lv.observe({"a": 1, "b": 1}, {"b": b"1"}, 0.5)  # b heard at 0.5, a at 0
    polls(lv, 1.0, 2.0, {"a": 1, "b": 1}, lambda t: {})
    assert [w for w, _ in lv.observe({"a": 1, "b": 1}, {}, 2.6)] == ["a", "b"]
    lv.observe({"b": 1}, {}, 3.0)
    assert "a" not in lv.heard and "a" not in lv.epochs
