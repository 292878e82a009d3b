"""A stopping Cluster lets a liveness poll in flight end before it returns: cut off mid-command, the
coordinator's liveness write (its on_poll) could reach Redis after its stop had deleted that key, and
a stopped deployment left the key behind (CI, test_redis_keys)."""
from __future__ import annotations

import asyncio
import time

import pytest

from ampd.state import StateStore, connect
from ampd.state.cluster import STOP_WAIT_S, Cluster

pytestmark = pytest.mark.timeout(30)


def test_stop_lets_a_poll_in_flight_end_and_cancels_a_sleeping_watch(redis_url):
    async def main() -> tuple[list[str], float, float]:
        store = StateStore(await connect(redis_url), f"stop{time.time_ns()}")
        steps: list[str] = []
        entered = asyncio.Event()

        async def slow_poll() -> None:
            steps.append("began")
            entered.set()
            await asyncio.sleep(0.3)  # a liveness write still on its way
            await store.coordinator_alive("c", 3.0)
            steps.append("ended")

        cluster = Cluster(store, "read", poll_s=0.05)
        cluster.on_poll = slow_poll
        await cluster.start()
        await asyncio.wait_for(entered.wait(), 5)
        t0 = time.monotonic()
        await cluster.stop()
        took = time.monotonic() - t0
        await store.coordinator_gone("c")
        assert not await store.r.exists(store.coordinator_key("c"))
        # between polls the watch is asleep: stop cancels it at once
        idle = Cluster(store, "read", poll_s=5.0)
        idle.on_poll = slow_poll
        await idle.start()
        t1 = time.monotonic()
        await idle.stop()
        idle_took = time.monotonic() - t1
        await store.r.aclose()
        return steps, took, idle_took

    steps, took, idle_took = asyncio.run(main())
    assert steps == ["began", "ended"]  # the poll in flight ran to its end, and no poll came after
    assert took < STOP_WAIT_S
    assert idle_took < 0.5
