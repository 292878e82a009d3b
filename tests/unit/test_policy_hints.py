"""Agent hints (ampd.agenthints, ampd.policy.hints): reading them off the wire; each consumer (admission's
order, the KV tier's decision and prefetch plan, live and in the simulator) changing its decision when a
hint is given, falling back to the windowed estimate when not, and a wrong or hostile hint never making
its own round cheaper than the same round without it (so never costing another session)."""

import math

import pytest

from ampd.agenthints import hints_from_body, hints_from_turn, hints_to_turn
from ampd.policy.hints import HintConfig, Hints, queue_enqueued_at
from ampd.policy.kvtier import DROP, KEEP, OFFLOAD, KVTierConfig, PoolState, ToolPause, decide_hinted
from ampd.v1 import common_pb2
from ampd.validate import InvalidArgument

CFG = HintConfig(yield_s=0.5)


def test_from_turn():
    assert hints_from_turn(common_pb2.Turn()) == Hints()
    t = common_pb2.Turn(hints=common_pb2.TurnHints(expected_tool_s=0.0))
    assert hints_from_turn(t) == Hints(0, None, 0.0)  # a present 0 is a hint, not an absence
    t = common_pb2.Turn(hints=common_pb2.TurnHints(priority=-2, expected_output_tokens=300, expected_tool_s=4.5))
    assert hints_from_turn(t) == Hints(-2, 300, 4.5)
    # the front's body hints forwarded on a Turn read back the same
    for h in (Hints(), Hints(-1, None, 0.0), Hints(-2, 300, 4.5)):
        t = common_pb2.Turn()
        hints_to_turn(h, t)
        assert hints_from_turn(t) == h


def test_from_body():
    assert hints_from_body({}) == Hints()
    assert hints_from_body({"ampd_hints": None}) == Hints()
    assert hints_from_body({"ampd_hints": {"priority": -1, "expected_tool_s": 3}}) == Hints(-1, None, 3.0)
    for body, field in [({"ampd_hints": [1]}, "ampd_hints:"),
                        ({"ampd_hints": {"prio": 1}}, "ampd_hints.prio:"),
                        ({"ampd_hints": {"expected_output_tokens": 0}}, "ampd_hints.expected_output_tokens:"),
                        ({"ampd_hints": {"expected_tool_s": -1}}, "ampd_hints.expected_tool_s:")]:
        with pytest.raises(InvalidArgument) as e:
            hints_from_body(body)
        assert str(e.value).startswith(field), str(e.value)


def test_priority_only_yields():
    assert queue_enqueued_at(10.0, 0, CFG) == 10.0
    assert queue_enqueued_at(10.0, -4, CFG) == 12.0
    assert queue_enqueued_at(10.0, 100, CFG) == 10.0  # a positive priority jumps nobody


def test_the_pure_parser_has_the_session_apis_ranges():
    """A trace round's hints (ampd.policy.hints.hints_from_obj, pure) are checked with the session
    API's ranges (ampd.validate), and name the bad key alike."""
    from ampd.policy import hints as ph
    from ampd.validate import MAX_OUTPUT_TOKENS, MAX_PRIORITY, MAX_TOOL_LATENCY_S

    assert (ph._MAX_PRIORITY, ph._MAX_OUTPUT, ph._MAX_TOOL_S) == (MAX_PRIORITY, MAX_OUTPUT_TOKENS, MAX_TOOL_LATENCY_S)
    assert ph.hints_from_obj({}, "h") == Hints()
    assert ph.hints_from_obj({"priority": -3, "expected_output_tokens": 9, "expected_tool_s": 2}, "h") == Hints(-3, 9, 2.0)
    for obj in ({"priority": 101}, {"priority": 1.5}, {"expected_output_tokens": 0}, {"expected_tool_s": math.inf},
                {"expected_tool_s": -1}, {"expected_tool_s": True}, {"x": 1}, [1]):
        with pytest.raises(ValueError) as pure:
            ph.hints_from_obj(obj, "ampd_hints")
        with pytest.raises(InvalidArgument) as wire:
            hints_from_body({"ampd_hints": obj})
        assert str(pure.value).split(":")[0] == str(wire.value).split(":")[0]


def test_a_trace_round_carries_hints_and_a_bad_one_is_named():
    from ampd.workload.trace import TraceError, session_from_obj, session_to_obj

    obj = {"id": "s", "arrival": 0.0, "rounds": [{"input": 3, "output": 2, "hints": {"priority": -2, "expected_tool_s": 1.5}},
                                                 {"input": 4, "output": 2}]}
    s = session_from_obj(obj, "t.jsonl:1")
    assert s.rounds[0].hints == Hints(-2, None, 1.5) and s.rounds[1].hints is None
    assert session_to_obj(s) == obj and session_from_obj(session_to_obj(s), "x") == s
    obj["rounds"][0]["hints"] = {"expected_output_tokens": 0}
    with pytest.raises(TraceError, match=r"t.jsonl:1: field 'rounds\[0\].hints.expected_output_tokens'"):
        session_from_obj(obj, "t.jsonl:1")


# ------------------------------------------------------------------ the KV tier (expected_tool_s)
KV = KVTierConfig(offload_pressure=0.5, margin_s=0.05, max_hint_s=3600.0)
PRESSED = PoolState(device_blocks=1000, device_used=800, waiting=0, host_free=500)  # over the pressure


def _pause(est: float | None, reprefill_s: float = 3.5) -> ToolPause:
    return ToolPause("s", "search", est, 100, 0.2, 0.2, reprefill_s)


def _act(est: float | None, hint: float | None, reprefill_s: float = 3.5) -> tuple[str, str, float | None]:
    d, plan_s = decide_hinted(_pause(est, reprefill_s), hint, PRESSED, KV)
    return d.action, d.reason, plan_s


def test_tier_decision_without_a_hint_is_decides_on_the_estimate():
    for est in (None, 0.1, 10.0):
        d, plan_s = decide_hinted(_pause(est), None, PRESSED, KV)
        plain = decide_hinted(_pause(est), math.nan, PRESSED, KV)[0]  # (a NaN is no hint)
        assert (d.action, d.reason, d.estimates, plan_s) == (plain.action, plain.reason, plain.estimates, est)
    assert _act(None, None) == (OFFLOAD, "unknown-tool", None)
    assert _act(0.1, None) == (KEEP, "short-tool", 0.1)
    assert _act(10.0, None) == (OFFLOAD, "long-tool", 10.0)


def test_a_long_hint_moves_its_own_kv_off_the_device_sooner():
    # the tool was short so far: the estimate keeps the KV; the agent says this call is long
    assert _act(0.1, 30.0) == (OFFLOAD, "long-tool", 30.0)  # prefetch planned by the hinted end
    assert _act(0.1, 30.0, reprefill_s=0.1) == (DROP, "reprefill-cheaper", 30.0)
    assert _act(None, 30.0) == (OFFLOAD, "long-tool", None)  # never observed: no early prefetch on a hint
    d, _ = decide_hinted(_pause(0.1), 30.0, PRESSED, KV)
    assert d.estimates["hint_s"] == 30.0 and d.estimates["expected_s"] == 30.0  # logged with the numbers


def test_a_short_or_hostile_hint_never_keeps_kv_the_estimate_moves_nor_fetches_it_back_sooner():
    # the tool is long (or never observed): a hint of 0 s would keep the KV on the device, holding
    # room another round then waits to evict; it is the estimate's decision, as without the hint
    assert _act(10.0, 0.0) == (OFFLOAD, "long-tool", 10.0)  # the prefetch by the later (estimated) end
    assert _act(None, 0.0) == (OFFLOAD, "unknown-tool", None)
    assert _act(10.0, 1.0)[2] == 10.0  # a shorter hint does not bring the prefetch forward
    assert _act(10.0, 60.0)[2] == 60.0  # a longer one delays its own
    # a huge hint is clamped to max_hint_s (and only delays its own prefetch)
    assert _act(10.0, 1e12) == (OFFLOAD, "long-tool", KV.max_hint_s)
    # every hint against every estimate: never a decision holding more room than without the hint
    holds = {DROP: 0, OFFLOAD: 1, KEEP: 2}
    for est in (None, 0.0, 0.1, 0.5, 10.0, 1e5):
        for hint in (0.0, 0.01, 0.3, 10.0, 1e5, 1e12, math.inf):
            for rp in (0.1, 3.5):
                base = _act(est, None, rp)
                act, _, plan_s = _act(est, hint, rp)
                assert holds[act] <= holds[base[0]], (est, hint, rp)
                assert (plan_s is None) == (est is None) and (plan_s is None or plan_s >= est)


def _sim_tier(hints: Hints | None):
    """4 sessions idle in 30 s "search" calls fill a 5000-token decode pool; 3 new ones come at 5 s
    (tests/unit/test_decode_tier.py's scenario), the idle ones' first rounds carrying ``hints``."""
    from ampd.sim import simulate
    from ampd.workload.trace import Round, Session
    from tests.unit.test_sim import _profile

    idle = [Session(f"idle-{i}", 0.01 * i, (Round(1100, 2, 30.0, "search", hints=hints), Round(100, 2)))
            for i in range(4)]
    new = [Session(f"new-{i}", 5.0, (Round(1200, 2),)) for i in range(3)]
    return simulate(idle + new, _profile(cap=5000), policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1,
                    admission="none", block_tokens=16, kv_host_mb=3)


def test_simulator_tier_reads_the_rounds_tool_hint_and_a_hostile_one_costs_no_other_session():
    """The simulator hands a round's ``expected_tool_s`` to the decode core as the live decode worker
    hands its turn's: the decision changes with a hint (``long-tool`` for the never observed tool,
    instead of ``unknown-tool``), and a hostile 0 s on the 30 s call leaves every session's timing as
    without hints (without the bound it kept the KV and the new sessions waited to evict it)."""
    plain = _sim_tier(None)
    assert plain.stats["kv_tier"]["decisions"]["offload:unknown-tool"] == 1
    honest = _sim_tier(Hints(expected_tool_s=30.0))
    d = honest.stats["kv_tier"]["decisions"]
    assert d["offload:long-tool"] == 1 and "offload:unknown-tool" not in d

    def timing(r):
        return [(x.input_ready, x.first_token, x.last_token) for s in r.sessions for x in s.rounds]

    for h in (Hints(expected_tool_s=0.0), Hints(expected_tool_s=86400.0), Hints(100, 1, None),
              Hints(-100, 1 << 20, None), Hints(100, 1, 0.0)):
        r = _sim_tier(h)
        assert all(s.completed for s in r.sessions) and r.stats["kv_used_end"] == [0], h
        assert r.stats["kv_tier"]["host_used_end"] == [0], h
        assert timing(r) == timing(plain), h  # here every hint (and so no hint) gives the same times


def test_the_simulator_reads_a_sessions_hints_off_its_first_round_as_the_replay_sends_them():
    """The live replay sends a session as one turn carrying round 0's hints (server-side tools), so
    they cover every round and a later round's reach no decision; in the simulator alike
    (docs/workload.md). y's second round queues behind a long prefill before p comes."""
    from ampd.sim import simulate
    from ampd.workload.trace import Round, Session
    from tests.unit.test_sim import _profile

    def run(h0, h1):
        y = Session("y", 0.0, (Round(10, 1, 0.0, hints=h0), Round(200, 2, hints=h1)))
        a = Session("a", 0.005, (Round(8000, 2),))  # ~0.8 s of prefill
        p = Session("p", 0.3, (Round(200, 2),))
        r = simulate([y, a, p], _profile(), policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1,
                     admission="none")
        assert all(s.completed for s in r.sessions)
        return {s.session_id: [(x.input_ready, x.first_token) for x in s.rounds] for s in r.sessions}

    plain = run(None, None)
    assert plain["y"][1][1] < plain["p"][0][1]
    first = run(Hints(priority=-1), None)  # the session's turn yields: its second round too
    assert first["p"][0][1] < first["y"][1][1]
    assert run(None, Hints(-1, 1 << 20, 0.0)) == plain  # never sent live


def test_a_replayed_trace_sends_its_rounds_hints():
    """Live replay sends what the simulator reads: a round's hints on its gRPC turn (server-side tools:
    the turn scripting the later rounds carries its first round's), and ``ampd_hints`` as the OpenAI
    body field the front reads back to the same Hints."""
    from ampd.bench.client import replay_turn
    from ampd.policy.hints import hints_to_obj
    from ampd.workload.trace import Round, Session

    h = Hints(-3, 40, 2.5)
    s = Session("s", 0.0, (Round(5, 2, 1.0, hints=h), Round(4, 2, 1.0), Round(3, 2, hints=Hints(expected_tool_s=0.0))))
    for client_tools in (False, True):
        assert hints_from_turn(replay_turn(s, 0, 0, client_tools)) == h
        assert not replay_turn(s, 1, 7, client_tools).HasField("hints")
        assert hints_from_turn(replay_turn(s, 2, 13, client_tools)) == Hints(0, None, 0.0)
    for hints in (h, Hints(), Hints(expected_tool_s=0.0), Hints(7, None, None)):
        assert hints_from_body({"ampd_hints": hints_to_obj(hints)}) == hints


def test_simulator_admission_a_hostile_priority_or_output_hint_jumps_no_queue():
    """test_sim's yield scenario (only one of y and p fits beside a): p, arriving after y, claims the
    top priority and a 1-token output (or the most a round may claim); q, alone beside a, fits only
    if its 1-token claim were promised instead of its max_tokens. Admission still promises max_tokens
    and serves by arrival: every session's times are those without hints (p after y, q after a)."""
    from ampd.sim import simulate
    from ampd.workload.trace import Round, Session
    from tests.unit.test_sim import _profile

    a = Session("a", 0.0, (Round(2000, 3, 1.0), Round(100, 3)))  # promises 2138 of 3000
    y = Session("y", 0.1, (Round(1500, 3),))
    kw = dict(policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1, admission_wait=30)

    def times(sessions):
        r = simulate(sessions, _profile(cap=3000), **kw)
        assert all(s.completed for s in r.sessions)
        return {s.session_id: [(x.input_ready, x.first_token, x.last_token) for x in s.rounds] for s in r.sessions}

    def p(hints):
        return Session("p", 0.2, (Round(1500, 3, hints=hints),))

    def q(hints):
        return Session("q", 0.2, (Round(700, 300, hints=hints),))  # 1000 (+ a block) > 862 left; 701 would fit

    plain_p, plain_q = times([a, y, p(None)]), times([a, q(None)])
    assert plain_p["y"][0][1] < plain_p["p"][0][1] and plain_q["q"][0][1] > plain_q["a"][1][2]  # q waits for a to end
    for h in (Hints(100, 1, None), Hints(100, 1 << 20, 0.0), Hints(0, 1, None)):
        assert times([a, y, p(h)]) == plain_p and times([a, q(h)]) == plain_q, h


# ------------------------------------------------------------------ priority in the prefill queues
def _queue_task(sid: str, ready: float, priority: int = 0):
    from ampd.policy import PrefillTask
    from ampd.policy.hints import queue_yield_s

    return PrefillTask(sid, 1, 0, 100, ready, "decode-0", 1, queue_yield_s=queue_yield_s(priority, HintConfig()))


@pytest.mark.parametrize("queue", ["fcfs", "ttft-aware", "continuum"])
def test_a_yielding_task_is_queued_as_if_ready_later(queue):
    """A yielding round (priority -1: 1 s later) is served after a task that does not yield whose input
    was ready 0.1 s after its own, and before one ready 2 s after it; a positive priority, or none,
    keeps arrival order. Every queue kind (a prefill worker's and the decode worker's local one)."""
    from ampd.policy import SLO, make_queue
    from tests.unit.test_worker_prefill import P

    def order(priority: int) -> list[str]:
        q = make_queue(queue, P, SLO(ttft_s=100.0, itl_s=1.0), 1)  # every order meets TTFT: none is reordered for it
        for t in (_queue_task("y", 0.0, priority), _queue_task("n1", 0.1), _queue_task("n2", 2.0)):
            q.push(t)
        return [q.pop(3.0).session_id for _ in range(3)]

    assert order(0) == ["y", "n1", "n2"]
    assert order(5) == order(100) == ["y", "n1", "n2"]  # no hint jumps a queue
    assert order(-1) == ["n1", "y", "n2"]
    assert order(-5) == ["n1", "n2", "y"]  # 5 s later: behind the one ready 2 s later too


def test_yielding_tasks_keep_their_order_among_themselves_and_others_theirs():
    """Tasks that do not yield keep push order whatever yields; yielding ones go by their order time."""
    from ampd.policy import SLO, make_queue
    from tests.unit.test_worker_prefill import P

    q = make_queue("fcfs", P, SLO(ttft_s=100.0, itl_s=1.0), 1)
    for t in (_queue_task("y2", 0.0, -2), _queue_task("y1", 0.1, -1), _queue_task("n", 0.2), _queue_task("m", 0.15)):
        q.push(t)
    assert [t.session_id for t in q.tasks()] == ["n", "m", "y1", "y2"]
    assert q.discard("y1", 1) and [q.pop(1.0).session_id for _ in range(3)] == ["n", "m", "y2"]


def test_algorithm_2_scores_a_yielding_tasks_wait_from_its_order_time():
    """Algorithm 2 counts a yielding task as ready ``queue_yield_s`` later. n, queued first, was ready
    at 1.5 s; y behind it at 0 s. At 1.97 s (each prefill 0.02 s, TTFT 2 s) y misses its TTFT behind
    n unless it goes first, so without a hint the queue serves y first; yielding (ready at 1 s as the
    queue counts it) it is not late and FCFS holds."""
    from ampd.policy import SLO, make_queue
    from tests.unit.test_worker_prefill import P

    def first(priority: int) -> str:
        q = make_queue("ttft-aware", P, SLO(ttft_s=2.0, itl_s=1.0), 1)
        q.push(_queue_task("n", 1.5))
        q.push(_queue_task("y", 0.0, priority))
        return q.pop(1.97).session_id

    assert first(0) == first(3) == "y"
    assert first(-1) == "n"


def test_a_yielding_tasks_ttft_counts_from_its_real_input():
    """The prefill core's TTFT window measures from ``enqueued_at`` (the input's real readiness), not
    the order time a yield gives it."""
    from tests.unit.test_worker_prefill import _core

    core = _core(False)
    y, n = _queue_task("y", 0.0, -3), _queue_task("n", 0.01)
    assert y.enqueued_at == 0.0 and y.order_at == 3.0
    core.submit(y, 0.01)
    core.submit(n, 0.01)
    w = core.schedule(0.01)
    assert w.task is n
    end_n = core.busy_until
    core.update(w, end_n)
    w = core.schedule(end_n)
    assert w.task is y
    end_y = core.busy_until
    core.update(w, end_y)
    assert core.view(end_y).window_mean_s == pytest.approx(((end_n - 0.01) + (end_y - 0.0)) / 2)


def test_the_decode_worker_reads_a_turns_yield():
    """``PrefillTask.queue_yield_s`` from a turn's hints: only a negative priority yields."""
    from ampd.agenthints import turn_queue_yield_s

    def turn(priority=None):
        t = common_pb2.Turn(token_ids=[1])
        if priority is not None:
            t.hints.priority = priority
        return t

    assert turn_queue_yield_s(None) == turn_queue_yield_s(turn()) == turn_queue_yield_s(turn(7)) == 0.0
    assert turn_queue_yield_s(turn(-3)) == 3.0 * HintConfig().yield_s


def test_simulator_prefill_queue_serves_a_yielding_round_after_a_later_one():
    """Two sessions queue behind a long prefill on one colocated worker (no admission, so only the
    queue can order them): y, ready first, yields (priority -1) and is served after p; its TTFT
    still counts from its real input. A positive priority changes no time."""
    from ampd.sim import simulate
    from ampd.workload.trace import Round, Session
    from tests.unit.test_sim import _profile

    def run(hints):
        a = Session("a", 0.0, (Round(8000, 2),))  # ~0.8 s of prefill: y and p queue behind it
        y = Session("y", 0.01, (Round(200, 2, hints=hints),))
        p = Session("p", 0.02, (Round(200, 2),))
        r = simulate([a, y, p], _profile(), policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=1,
                     admission="none")
        assert all(s.completed for s in r.sessions)
        return {s.session_id: s.rounds[0] for s in r.sessions}

    plain = run(None)
    assert plain["y"].first_token < plain["p"].first_token
    yielded = run(Hints(priority=-1))
    assert yielded["p"].first_token < yielded["y"].first_token
    assert yielded["y"].input_ready == 0.01 and yielded["y"].ttft == yielded["y"].first_token - 0.01
    assert yielded["p"].first_token < plain["p"].first_token  # p gains what y gave
    assert run(Hints(priority=5)) == plain
