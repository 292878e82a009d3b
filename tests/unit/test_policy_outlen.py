"""The expected output length (ampd.policy.outlen) and its consumer, the slo admission rule's ITL
prediction: the windowed mean of the rounds served, raised (never lowered) by an
``expected_output_tokens`` hint, at most the round's bound; the bound itself with no rounds in the
window. An honest long hint refuses its own session where the mean admits it; a hostile short one
changes nothing against no hint (live: services/coordinator; the simulator: ampd.sim)."""

import pytest

from ampd.policy.admit import ITL, decide, predicted_itl
from ampd.policy.hints import Hints
from ampd.policy.outlen import OutputLengths, OutputLengthsConfig, expected_output, rounds_kv_tokens
from ampd.v1 import common_pb2
from services.coordinator.core import turn_kv_tokens
from tests.unit.test_admit import COST, PROMPT, SLO_, dw, pw


def test_windowed_mean_of_the_rounds_served():
    o = OutputLengths(OutputLengthsConfig(window_s=10.0))
    assert o.mean(0.0) is None
    o.observe(0.0, 100)
    o.observe(1.0, 0)  # a round cancelled before its first token says nothing
    o.observe(2.0, 300)
    assert o.mean(2.0) == 200.0
    assert o.mean(11.0) == 300.0  # the first left the window
    assert o.mean(13.0) is None


def test_expected_output_is_the_mean_raised_by_a_hint_within_the_bound():
    # no rounds in the window: the bound, hint or not (what every decision counted before)
    for hint in (None, 1, 500, 5000):
        assert expected_output(1000, hint, None) == 1000
    assert expected_output(1000, None, 199.2) == 200
    assert expected_output(1000, 500, 199.2) == 500  # an honest longer round
    assert expected_output(1000, 5000, 199.2) == 1000  # never more than the round may make
    assert expected_output(150, None, 199.2) == 150
    for hint in (1, 100, 200):  # a shorter hint is no hint: it never lowers the estimate
        assert expected_output(1000, hint, 199.2) == expected_output(1000, None, 199.2)


def test_rounds_kv_tokens_count_the_bound_without_a_mean_and_the_expected_output_with_one():
    rounds = [(100, 1000), (50, 400)]  # (input, output bound)
    assert rounds_kv_tokens(rounds) == rounds_kv_tokens(rounds, 600) == 1550  # the promise reads no hint
    assert rounds_kv_tokens(rounds, None, 200.0) == 100 + 200 + 50 + 200
    assert rounds_kv_tokens(iter(rounds), 600, 200.0) == 100 + 600 + 50 + 400  # one pass over the rounds
    assert rounds_kv_tokens([]) == rounds_kv_tokens([], 5, 1.0) == 0


def test_coordinator_expected_kv_of_a_turn():
    t = common_pb2.Turn(token_ids=list(range(100)), sampling=common_pb2.SamplingParams(max_tokens=1000))
    t.script.add(result_tokens=50, sampling=common_pb2.SamplingParams(max_tokens=400))
    assert turn_kv_tokens(t) == 100 + 1000 + 50 + 400  # the bound, admission's promise
    assert turn_kv_tokens(t, out_mean=200.0) == 100 + 200 + 50 + 200
    assert turn_kv_tokens(t, 300, out_mean=250.0) == 100 + 250 + 50 + 250  # max_output caps the bound first
    t.hints.expected_output_tokens = 600  # the hint covers every round of the turn, at most its bound
    assert turn_kv_tokens(t, out_mean=200.0) == 100 + 600 + 50 + 400
    t.hints.expected_output_tokens = 300
    assert turn_kv_tokens(t, out_mean=200.0) == 100 + 300 + 50 + 300
    assert turn_kv_tokens(t) == 1550  # the promise does not read it
    t.hints.expected_output_tokens = 1
    assert turn_kv_tokens(t, out_mean=200.0) == 100 + 200 + 50 + 200


def _slo(need: int, expect: int | None, itl: float):
    return decide("slo", [dw("d0", 100_000, itl=itl)], [pw("p0", 0.0)], {"d0": 20_000}, {"d0": 3}, need, PROMPT,
                  0.0, COST, SLO_, expect=expect)


def test_slo_admission_predicts_itl_from_the_expected_kv():
    """The worker's ITL is just under the SLO: a session promised 20,000 tokens (max_tokens) would push
    it over, one expected to hold 4,000 (the windowed mean) does not. The promise is the bound all the
    same; with an honest hint that the round is long, its own session is refused again."""
    need, mean = PROMPT + 17_000, 1000.0
    step = (predicted_itl(COST, dw("d0", 0, itl=0.0), 3, 20_000, need)
            + predicted_itl(COST, dw("d0", 0, itl=0.0), 3, 20_000, PROMPT + 1000)) / 2
    itl = SLO_.itl_s - step  # the SLO falls between the two predictions
    expect = PROMPT + expected_output(17_000, None, mean)
    assert _slo(need, None, itl).reason == ITL  # the bound: refused
    v = _slo(need, expect, itl)
    assert v.worker == "d0" and v.itl_s <= SLO_.itl_s
    assert _slo(need, PROMPT + expected_output(17_000, 16_000, mean), itl).reason == ITL  # honest: its own loss
    for hostile in (1, 999):
        assert _slo(need, PROMPT + expected_output(17_000, hostile, mean), itl) == v


def _sim(b_hints: Hints | None):
    """a makes 10 tokens and ends; b comes 20 s later (a's ITL out of the window, its output in), to
    make 2,000 tokens. Its first step with a 2,116-token context takes 20.31 ms, over the 20.2 ms SLO;
    with the 126 tokens it is expected to hold (a's output), 20.11 ms."""
    from ampd.sim import simulate
    from ampd.workload.trace import Round, Session
    from tests.unit.test_sim import _profile

    a = Session("a", 0.0, (Round(100, 10),))
    b = Session("b", 20.0, (Round(100, 2000, hints=b_hints),))
    return simulate([a, b], _profile(), policy="colocated", decode="tp1*1", ttft_slo_s=5, itl_slo_s=0.0202,
                    admission="slo", block_tokens=16)


def test_simulator_admission_reads_the_mean_and_the_rounds_hint():
    plain = _sim(None)
    assert plain.stats["admission_refused"] == {} and all(s.completed for s in plain.sessions)
    honest = _sim(Hints(expected_output_tokens=2000))
    assert honest.stats["admission_refused"] == {ITL: 1}  # it says it is long: judged at its bound

    def timing(r):
        return [(s.session_id, x.input_ready, x.first_token, x.last_token) for s in r.sessions for x in s.rounds]

    for h in (Hints(expected_output_tokens=1), Hints(expected_output_tokens=10), Hints(100, 1, 0.0)):
        assert timing(_sim(h)) == timing(plain), h


@pytest.mark.parametrize("rule", ["kv", "none"])
def test_the_kv_rules_do_not_read_it(rule):
    v = decide(rule, [dw("d0", 4000)], (), {}, {}, 3000, PROMPT, 0.0, COST, SLO_, expect=10)
    assert v.worker == "d0"
    assert decide(rule, [dw("d0", 4000)], (), {"d0": 2000}, {}, 3000, PROMPT, 0.0, COST, SLO_, expect=10).worker \
        is (None if rule == "kv" else "d0")


def test_coordinator_feeds_the_mean_from_round_timings_and_admits_by_the_expected_kv():
    """services/coordinator/admission.py: each RoundTiming's tokens go to the mean (``out_mean``), and
    ``admit``'s ``expect`` is what the slo rule predicts the ITL from (the promise stays ``need``)."""
    import asyncio
    import time

    from ampd.policy import WorkerView
    from services.coordinator.admission import Admission, Refused

    adm = Admission(0.0, 8, "slo", COST, SLO_)
    assert adm.out_mean() is None
    now = time.time()
    for tokens in (100, 300):
        adm.round_ended(common_pb2.RoundTiming(input_ready=now - 1, last_token=now, tokens=tokens), None, 8)
    assert adm.out_mean() == 200.0
    need = PROMPT + 17_000
    step = (predicted_itl(COST, dw("d0", 0, itl=0.0), 0, 0, need)
            + predicted_itl(COST, dw("d0", 0, itl=0.0), 0, 0, PROMPT + 200)) / 2

    async def rooms():
        return [WorkerView("d0", "decode", 8, SLO_.itl_s - step, (), 100_000, 0.0)], [pw("p0", 0.0)]

    async def admit(expect):
        try:
            return await adm.admit(need, rooms, PROMPT, expect=expect)
        except Refused as exc:
            return exc.reason

    assert asyncio.run(admit(None)) == ITL
    assert asyncio.run(admit(PROMPT + expected_output(17_000, None, adm.out_mean()))) == "d0"
    assert adm.promised["d0"] == need


def test_the_simulator_expects_what_the_coordinator_does_of_a_replayed_session():
    """The replayed session is one turn scripting every later round and carrying round 0's hints
    (ampd.bench.client.open_request): the simulator's expected KV is the coordinator's of that
    turn, round 0's hint covering every round and a later round's unread."""
    from types import SimpleNamespace

    from ampd.bench.client import open_request
    from ampd.sim.admitting import Admitting
    from ampd.sim.workers import Waiting
    from ampd.workload.trace import Round, Session

    outputs = OutputLengths()
    outputs.observe(0.0, 200)
    sim = SimpleNamespace(book=SimpleNamespace(outputs=outputs), block_tokens=16)
    for h0, h1 in ((None, None), (Hints(expected_output_tokens=600), None), (Hints(expected_output_tokens=1), None),
                   (None, Hints(expected_output_tokens=900)), (Hints(expected_output_tokens=300), Hints(-1, 900, 2.0))):
        s = Session("s", 0.0, (Round(100, 1000, 1.0, hints=h0), Round(50, 400, 1.0, hints=h1), Round(30, 250)))
        coordinator = turn_kv_tokens(open_request(s).turn, 0, outputs.mean(1.0)) + 16
        assert Admitting.expected_kv(sim, Waiting(s, None, 0, 0.0), 1.0) == coordinator, (h0, h1)
