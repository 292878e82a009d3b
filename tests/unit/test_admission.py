"""The coordinator's admission shell (services/coordinator/admission.py) over ampd.policy.admit: who
gets KV that frees (kv: the oldest waiter; slo: the newest) and how long a session waits (slo: no
longer than its TTFT budget, then refused with reason ttft)."""

import asyncio
import time

import pytest

from ampd.perf import load_profile
from ampd.policy import SLO, WorkerView
from ampd.policy.admit import KV_FULL, TTFT, TTFT_FRACTION
from services.coordinator.admission import Admission, Refused

COST = load_profile("qwen3-32b@h20")
PROMPT = 100


async def rooms():
    return [WorkerView("d0", "decode", 8, None, (), 1000, 0.0)], [WorkerView("p0", "prefill", 8, None, (), 0, 0.0)]


async def race(adm: Admission) -> tuple[list[str], list[tuple[str, str, float]]]:
    """d0 full; A waits, B waits 0.1 s later, the full session ends 0.1 s after that."""
    assert await adm.admit(1000, rooms, PROMPT) == "d0"
    order, refused = [], []

    async def one(name: str, delay: float) -> None:
        await asyncio.sleep(delay)
        t0 = time.monotonic()
        try:
            await adm.admit(1000, rooms, PROMPT)
            order.append(name)
        except Refused as exc:
            refused.append((name, exc.reason, time.monotonic() - t0))

    async def release() -> None:
        await asyncio.sleep(0.2)
        adm.release("d0", 1000)

    await asyncio.gather(one("A", 0.0), one("B", 0.1), release())
    return order, refused


def test_kv_rule_serves_the_oldest_waiter_first():
    order, refused = asyncio.run(race(Admission(0.6, 8)))
    assert order == ["A"] and [(n, r) for n, r, _ in refused] == [("B", KV_FULL)]


def test_slo_rule_serves_the_newest_and_refuses_the_oldest_when_its_ttft_budget_is_spent():
    slo = SLO(0.5, 0.1)
    order, refused = asyncio.run(race(Admission(5.0, 8, "slo", COST, slo)))
    assert order == ["B"] and [(n, r) for n, r, _ in refused] == [("A", TTFT)]
    budget = TTFT_FRACTION * slo.ttft_s - COST.t_pre(8, 0, PROMPT)  # the best route: local, no queue
    assert refused[0][2] == pytest.approx(budget, abs=0.1)  # not the 5 s admission wait


def test_an_accepted_session_is_bound_again_by_the_kv_rule_only():
    adm = Admission(0.0, 8, "slo", COST, SLO(0.5, 0.1))

    async def moved():  # waited 10 s already (its TTFT budget long spent): still not refused for it
        return await adm.admit(500, rooms, PROMPT, since=time.monotonic() - 10.0, new=False)

    assert asyncio.run(moved()) == "d0"
    with pytest.raises(Refused) as exc:
        asyncio.run(adm.admit(500, rooms, PROMPT, since=time.monotonic() - 10.0))
    assert exc.value.reason == TTFT


def test_slo_rule_needs_the_model_and_the_slo():
    with pytest.raises(ValueError, match="needs the cost model and the SLO"):
        Admission(1.0, 8, "slo")


def test_a_yielding_hint_lets_a_later_session_take_the_freed_kv():
    """Agent hints on the asyncio driver: A yields (its arrival made later, ``order_at``), B comes
    0.1 s later without hints: B gets the KV that frees; without A's hint, A gets it (as above)."""
    async def run() -> list[str]:
        adm = Admission(0.6, 8)
        assert await adm.admit(1000, rooms, PROMPT) == "d0"
        order: list[str] = []

        async def one(name: str, delay: float, order_at: float | None) -> None:
            await asyncio.sleep(delay)
            try:
                await adm.admit(1000, rooms, PROMPT, order_at=order_at)
                order.append(name)
            except Refused:
                pass

        async def release() -> None:
            await asyncio.sleep(0.2)
            adm.release("d0", 1000)

        await asyncio.gather(one("A", 0.0, time.monotonic() + 5.0), one("B", 0.1, None), release())
        assert not adm.book.waiting and not adm.book.yielded
        return order

    assert asyncio.run(run()) == ["B"]


def test_a_decode_worker_with_a_host_tier_takes_promises_beyond_its_device_pool_once_idle_kv_is_seen():
    from ampd.v1 import common_pb2

    async def tiered():
        return [WorkerView("d0", "decode", 8, None, (), 1000, 0.0, 1000)], []

    async def go():
        adm = Admission(0.0, 8, cost=load_profile("qwen3-32b@h20"))
        # no estimate of the KV idle in tool calls yet: the device pool only
        assert [await adm.admit(400, tiered, PROMPT) for _ in range(2)] == ["d0", "d0"]
        with pytest.raises(Refused) as exc:
            await adm.admit(400, tiered, PROMPT)
        assert exc.value.reason == KV_FULL
        # sessions whose rounds (1 s) end in 20 s tool calls: their KV is on host most of the time,
        # so the host pool stands in for device room
        t0, prev = time.time() - 120.0, None
        for r in range(5):
            t = common_pb2.RoundTiming(round=r, input_ready=t0 + 21.0 * r, last_token=t0 + 21.0 * r + 1.0,
                                       l_hist=100 * r, l_incr=90, tokens=10)
            prev = adm.round_ended(t, prev, 8)
            assert prev == (t.last_token, 100 * (r + 1))
        assert 0.9 < adm.book.off_device.share(time.time()) < 1.0
        assert [await adm.admit(400, tiered, PROMPT) for _ in range(3)] == ["d0", "d0", "d0"]
        with pytest.raises(Refused) as exc:  # never past device + host (2000)
            await adm.admit(400, tiered, PROMPT)
        assert exc.value.reason == KV_FULL
        with pytest.raises(Refused) as exc:  # a session must fit the device alone
            await adm.admit(1500, tiered, PROMPT)
        assert exc.value.reason == "kv-size"

    asyncio.run(go())
