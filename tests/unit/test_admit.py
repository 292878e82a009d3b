"""Admission rules (ampd.policy.admit): kv is bind's rule; slo also refuses a session that would miss
its TTFT or ITL SLO, at once, and bounds a wait for KV by what is left of its TTFT budget."""

import math

import pytest

from ampd.perf import load_profile
from ampd.policy import SLO, WorkerView, bind
from ampd.policy.admit import (ITL, KV_FULL, KV_SIZE, TTFT, TTFT_FRACTION, decide, predicted_itl, predicted_ttft,
                              promise_room, promise_rooms)

COST = load_profile("qwen3-32b@h20")
SLO_ = SLO(2.0, 0.1)
PROMPT = 3000  # a 3,000-token first prefill: ~0.30 s at tp8


def dw(wid, cap, queue_s=0.0, itl=None):
    return WorkerView(wid, "decode", 8, itl, (), cap, queue_s)


def pw(wid, queue_s):
    return WorkerView(wid, "prefill", 8, None, (), 0, queue_s)


def slo(decode, prefills=(), promised=None, sessions=None, need=1000, waited=0.0):
    return decide("slo", decode, prefills, promised or {}, sessions or {}, need, PROMPT, waited, COST, SLO_)


def test_kv_rule_is_bind():
    ws = [dw("d0", 4000), dw("d1", 4000)]
    promised = {"d0": 1000}
    v = decide("kv", ws, (), promised, {}, 2000, PROMPT, 99.0, None, None)  # no SLO: waiting does not matter
    assert v.worker == bind(ws, promised, 2000) == "d1" and not v.reason
    v = decide("kv", ws, (), {"d0": 3000, "d1": 3000}, {}, 2000, PROMPT, 0.0, None, None)
    assert v.worker is None and not v.reason and v.wait_s == math.inf  # it waits for KV


def test_too_large_is_refused_by_either_rule():
    for rule in ("kv", "slo"):
        v = decide(rule, [dw("d0", 4000)], (), {}, {}, 5000, PROMPT, 0.0, COST, SLO_)
        assert v.reason == KV_SIZE and "more than any decode worker holds (4000)" in v.detail


def test_slo_admits_where_the_kv_rule_would_when_queues_are_short():
    ws = [dw("d0", 4000), dw("d1", 4000)]
    v = slo(ws, [pw("p0", 0.0)], promised={"d0": 500})
    assert v.worker == "d1" and v.ttft_s == pytest.approx(COST.t_pre(8, 0, PROMPT))  # local: no KV moves


def test_ttft_counts_the_best_route_and_what_was_waited():
    d = dw("d0", 4000, queue_s=1.0)
    local = COST.t_pre(8, 0, PROMPT) + 1.0
    remote = COST.t_pre(8, 0, PROMPT) + COST.t_kv(PROMPT, 8, 8) + 0.5
    assert predicted_ttft(COST, d, [pw("p0", 0.5), pw("p1", 3.0)], PROMPT, 0.25) == pytest.approx(0.25 + remote)
    assert predicted_ttft(COST, d, [pw("p0", 5.0)], PROMPT, 0.25) == pytest.approx(0.25 + local)
    assert predicted_ttft(COST, d, [], PROMPT, 0.0) == pytest.approx(local)


def test_long_prefill_queues_refuse_at_once():
    ws = [dw("d0", 4000, queue_s=2.0), dw("d1", 4000, queue_s=2.0)]
    v = slo(ws, [pw("p0", 1.7)])
    assert v.worker is None and v.reason == TTFT and v.ttft_s > TTFT_FRACTION * SLO_.ttft_s
    assert "predicted TTFT" in v.detail
    # the same queues with a short prefill queue on one route: admitted
    assert slo(ws, [pw("p0", 0.5)]).worker == "d0"


def test_time_already_waited_counts():
    ws = [dw("d0", 4000)]
    assert slo(ws, [pw("p0", 0.0)], waited=1.0).worker == "d0"
    assert slo(ws, [pw("p0", 0.0)], waited=1.6).reason == TTFT  # 1.6 + 0.31 > 0.9 * 2


def test_a_wait_for_kv_lasts_no_longer_than_the_ttft_budget():
    ws = [dw("d0", 4000, queue_s=1.0)]  # its local queue is longer: the best route is remote
    full = {"d0": 3500}
    v = slo(ws, [pw("p0", 0.5)], promised=full, waited=0.2)
    route = COST.t_pre(8, 0, PROMPT) + COST.t_kv(PROMPT, 8, 8) + 0.5
    assert v.worker is None and not v.reason
    assert v.wait_s == pytest.approx(TTFT_FRACTION * SLO_.ttft_s - 0.2 - route)
    # once that budget is spent, it is refused rather than admitted late
    v = slo(ws, [pw("p0", 0.5)], promised=full, waited=0.2 + v.wait_s + 0.01)
    assert v.reason == TTFT and "no decode worker has KV" in v.detail


def test_itl_over_the_slo_moves_to_the_next_worker_or_refuses():
    busy, calm = dw("d0", 8000, itl=0.2), dw("d1", 4000, itl=0.01)
    assert slo([busy, calm], [pw("p0", 0.0)]).worker == "d1"  # d0 has more KV but would miss ITL
    v = slo([busy], [pw("p0", 0.0)])
    assert v.reason == ITL and "ITL" in v.detail


def test_predicted_itl_adds_one_sequence_to_the_step():
    d = dw("d0", 4000, itl=0.05)
    step = COST.t_dec(8, 4, 9000) - COST.t_dec(8, 3, 8000)
    assert predicted_itl(COST, d, 3, 8000, 1000) == pytest.approx(0.05 + step)
    assert predicted_itl(COST, dw("d0", 4000), 0, 0, 1000) == pytest.approx(COST.t_dec(8, 1, 1000))


def test_bad_calls_raise():
    with pytest.raises(ValueError, match="admission rule must be one of kv, slo"):
        decide("fast", [dw("d0", 1)], (), {}, {}, 0, 0, 0.0, None, None)
    with pytest.raises(ValueError, match="no decode worker"):
        decide("kv", [], (), {}, {}, 0, 0, 0.0, None, None)
    with pytest.raises(ValueError, match="needs the cost model"):
        decide("slo", [dw("d0", 1)], (), {}, {}, 0, 0, 0.0, None, None)


def test_book_kv_rule_first_come_first_served_then_refused_after_the_wait():
    """The pure book both drivers run (issue 26): B waits behind A, A gets the KV that frees, B is
    refused once its admission wait is spent; a queue of 1 refuses a third session at once."""
    from ampd.policy.admit import QUEUE_FULL, AdmissionBook

    book = AdmissionBook("kv", wait_s=2.0, queue_max=1)
    d = [WorkerView("decode-0", "decode", 8, None, (), 1000, 0.0)]
    assert book.judge("X", 1000, 10, 0.0, d, ()).worker == "decode-0"
    v = book.judge("A", 600, 10, 0.0, d, ())
    assert v.worker is None and not v.reason and v.wait_s == 2.0 and book.head == "A"
    assert book.judge("B", 600, 10, 0.1, d, ()).reason == QUEUE_FULL
    book.release("decode-0", 1000)
    assert book.judge(book.head, 600, 10, 0.5, d, ()).worker == "decode-0"
    assert book.leave("A") and book.head is None
    assert book.promised == {"decode-0": 600} and book.sessions == {"decode-0": 1}
    v = book.judge("C", 600, 10, 0.0, d, ())
    assert v.wait_s == 2.0 and book.judge("C", 600, 10, 2.0, d, ()).reason == KV_FULL


def test_book_rule_none_admits_every_session_on_the_least_promised_worker():
    from ampd.policy.admit import AdmissionBook

    book = AdmissionBook("none", wait_s=0.0, queue_max=0)
    d = [WorkerView(w, "decode", 8, None, (), 1000, 0.0) for w in ("decode-10", "decode-2")]
    assert book.judge("a", 5000, 10, 0.0, d, ()).worker == "decode-2"  # over capacity, ties in worker order
    assert book.judge("b", 10, 10, 0.0, d, ()).worker == "decode-10"
    assert book.judge("c", 10, 10, 0.0, d, (), new=False).worker == "decode-10"


@pytest.mark.parametrize("rule", ["kv", "slo"])
def test_book_a_yielding_hint_waits_behind_others_and_never_moves_ahead(rule):
    """Agent hints (issue 29): a session whose turn yields (negative priority, ``order_at``) waits
    behind every session that does not, and is not admitted while another waits; a session without
    hints is judged as if no yielding one waited (it is admitted at once when KV is free)."""
    from ampd.policy.admit import AdmissionBook
    from ampd.policy.hints import HintConfig, queue_enqueued_at

    cfg = HintConfig(yield_s=1.0)
    book = AdmissionBook(rule, wait_s=10.0, queue_max=8, cost=COST, slo=SLO(100.0, 10.0))
    d = [WorkerView("decode-0", "decode", 8, None, (), 1000, 0.0)]
    assert book.judge("full", 1000, 10, 0.0, d, ()).worker == "decode-0"
    # Y yields (priority -3): it waits; Z yields less (-1) and arrives later but orders before it
    assert book.judge("Y", 100, 10, 0.0, d, (), order_at=queue_enqueued_at(0.0, -3, cfg)).wait_s > 0
    assert book.judge("Z", 100, 10, 0.0, d, (), order_at=queue_enqueued_at(0.5, -1, cfg)).wait_s > 0
    assert list(book.waiting) == ["Z", "Y"]
    # A and B send no hints: they wait ahead of both yielding sessions, in the rule's own order
    book.judge("A", 100, 10, 0.0, d, ())
    book.judge("B", 100, 10, 0.0, d, ())
    assert list(book.waiting) == (["A", "B", "Z", "Y"] if rule == "kv" else ["B", "A", "Z", "Y"])
    # KV frees: the sessions without hints get it first; a yielding one judged meanwhile waits
    book.release("decode-0", 1000)
    assert book.judge("Y", 100, 10, 0.1, d, (), order_at=queue_enqueued_at(0.0, -3, cfg)).worker is None
    first = book.head
    assert first in ("A", "B") and book.judge(first, 100, 10, 0.1, d, ()).worker == "decode-0"
    book.leave(first)
    second = book.head
    assert second in ("A", "B") and book.judge(second, 100, 10, 0.1, d, ()).worker == "decode-0"
    book.leave(second)
    assert book.head == "Z" and book.judge("Z", 100, 10, 0.1, d, (), order_at=1.5).worker == "decode-0"
    book.leave("Z")
    # a new session without hints is admitted at once though Y still waits (Y never stands before it)
    assert book.judge("C", 100, 10, 0.0, d, ()).worker == "decode-0"
    # a new yielding session is not admitted at once while another waits
    assert book.judge("W", 100, 10, 0.0, d, (), order_at=9.0).worker is None
    assert list(book.waiting) == ["Y", "W"]
    assert book.leave("Y") and book.leave("W") and not book.yielded


def test_book_without_hints_orders_as_before():
    """No ``order_at`` anywhere: the queue is exactly the rule's (kv: arrival; slo: newest first)."""
    from ampd.policy.admit import AdmissionBook

    for rule, want in (("kv", ["A", "B", "C"]), ("slo", ["C", "B", "A"])):
        book = AdmissionBook(rule, wait_s=10.0, queue_max=8, cost=COST, slo=SLO(100.0, 10.0))
        d = [WorkerView("decode-0", "decode", 8, None, (), 100, 0.0)]
        book.judge("full", 100, 10, 0.0, d, ())
        for t in "ABC":
            book.judge(t, 50, 10, 0.0, d, ())
        assert list(book.waiting) == want and not book.yielded


def test_host_tier_extends_the_promises_as_far_as_idle_kv_can_be_on_host():
    """A worker with a host KV tier may promise beyond its device pool only as far as the KV idle in
    tool calls can be on host (the share, ampd.policy.offshare): (share * device - need) / (1 - share),
    at most its host pool; none without an estimate or with short tools. A session must still fit
    the device pool alone (kv-size)."""
    tiered = WorkerView("d0", "decode", 8, None, (), 4000, 0.0, 6000)
    plain = dw("d1", 4000)

    def kv(promised, need=2000, share=None, ws=(tiered, plain)):
        return decide("kv", list(ws), (), promised, {}, need, PROMPT, 0.0, None, None, share)

    # no estimate, or tools too short to move KV: the device only
    for share in (None, 0.0, 0.2):
        assert promise_room(tiered, share, 2000) == 4000
        v = kv({"d0": 3000, "d1": 3000}, share=share)
        assert v.worker is None and not v.reason  # it waits
    # long tools (0.9 of the KV's time on host): 3600 of the device's worth idle, less this session's
    # 2000, stands in for 16000 tokens: the whole host pool
    assert promise_room(tiered, 0.9, 2000) == 10000
    assert kv({"d0": 7000, "d1": 3000}, share=0.9).worker == "d0"
    v = kv({"d0": 8500, "d1": 3000}, share=0.9)
    assert v.worker is None and not v.reason  # 10000 - 8500 < 2000: it waits
    # 0.75: (3000 - 2000) / 0.25 = 4000 tokens of host; a smaller session gets more
    assert promise_room(tiered, 0.75, 2000) == 8000 and promise_room(tiered, 0.75, 1000) == 10000
    assert kv({"d0": 6000, "d1": 3000}, share=0.75).worker == "d0"
    assert kv({"d0": 7000, "d1": 3000}, share=0.75).worker is None
    # all of it: device + host, never more
    assert promise_room(tiered, 1.0, 2000) == 10000
    v = kv({}, need=5000, share=1.0, ws=(tiered,))
    assert v.reason == KV_SIZE and "(4000)" in v.detail  # the host does not hold a round's KV
    v = decide("slo", [tiered], (), {"d0": 7000}, {}, 1000, PROMPT, 0.0, COST, SLO_, 0.9)
    assert v.worker == "d0"
    assert slo([tiered], promised={"d0": 7000}).worker is None  # no estimate: the device's 4000
    # without a tier, the views are the caller's own
    ws = [plain]
    assert promise_rooms(ws, 0.9, 2000) is ws and promise_room(plain, 1.0, 0) == 4000
    assert [w.kv_free_tokens for w in promise_rooms([tiered, plain], 0.9, 2000)] == [10000, 4000]


def test_promise_rooms_keeps_every_other_field_of_a_view():
    """promise_rooms builds the promised view by position (the simulator judges admission per
    arrival): a field added to or moved in WorkerView must not be lost or shifted there."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(WorkerView)]
    assert names == ["worker_id", "kind", "tp", "window_mean_s", "queue", "kv_free_tokens", "queue_predicted_s",
                     "kv_host_tokens"]  # the order promise_rooms writes them in
    tiered = WorkerView("d7", "decode", 4, 0.03, (), 4000, 1.25, 6000)
    (got,) = promise_rooms([tiered], 0.9, 2000)
    assert (got.kv_free_tokens, got.kv_host_tokens) == (promise_room(tiered, 0.9, 2000), 0)
    for name in names:
        if name not in ("kv_free_tokens", "kv_host_tokens"):
            assert getattr(got, name) == getattr(tiered, name), name


def test_the_book_passes_the_share_and_promises_as_far_as_it_goes():
    from ampd.policy.admit import AdmissionBook

    tiered = [WorkerView("d0", "decode", 8, None, (), 4000, 0.0, 6000)]
    book = AdmissionBook("kv", wait_s=10.0, queue_max=8)
    assert book.judge("a", 3000, 10, 0.0, tiered, (), host_share=0.9).worker == "d0"
    # the same session, with no estimate: 3000 + 3000 > 4000, it waits
    v = book.judge("b", 3000, 10, 0.0, tiered, ())
    assert v.worker is None and not v.reason and list(book.waiting) == ["b"]
    assert book.judge("b", 3000, 10, 0.0, tiered, (), host_share=0.9).worker == "d0"
    assert book.promised["d0"] == 6000
