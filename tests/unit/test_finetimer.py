"""fine_sleep keeps sub-millisecond sleeps under uvloop, whose own timers round to 1 ms."""
import asyncio
import statistics
import time

import uvloop

from ampd.kv.finetimer import fine_sleep

ATTEMPTS = 5  # a loaded box (CI: 2 cores, two test processes) can stall any one batch of sleeps


async def _durations(delay: float, n: int = 30) -> list[float]:
    out = []
    for _ in range(n):
        t = time.monotonic()
        await fine_sleep(delay)
        out.append(time.monotonic() - t)
    return out


def test_sub_millisecond_sleeps_under_uvloop():
    async def main():
        for delay in (100e-6, 300e-6):
            medians = []
            for _ in range(ATTEMPTS):
                d = await _durations(delay)
                assert min(d) >= delay  # never early: uvloop's asyncio.sleep(0.0003) returns at once
                medians.append(statistics.median(d))
                if medians[-1] < 0.9e-3:
                    break
            # ... and asyncio.sleep(0.0006) takes ~1.1 ms: one unstalled batch shows the resolution
            assert min(medians) < 0.9e-3, (delay, medians)

    uvloop.run(main())


def test_concurrent_sleeps_end_in_deadline_order():
    async def main():
        done: list[int] = []
        deadline: dict[int, float] = {}

        async def one(i: int, delay: float) -> None:
            # fine_sleep reads the clock right after this: a stall between two tasks' starts can
            # reorder their deadlines, so the expected order is the deadlines', not the delays'
            deadline[i] = time.monotonic() + delay
            await fine_sleep(delay)
            done.append(i)

        await fine_sleep(1e-6)  # the loop's first fine sleep makes its timerfd (~0.3 ms): not in the race
        await asyncio.gather(one(0, 900e-6), one(1, 300e-6), one(2, 600e-6), one(3, 5e-3))
        assert done == sorted(deadline, key=deadline.__getitem__), (done, deadline)
        assert set(done) == {0, 1, 2, 3}

    uvloop.run(main())


def test_cancelled_sleep_does_not_break_the_others():
    async def main():
        t = asyncio.create_task(fine_sleep(500e-6))
        await asyncio.sleep(0)
        t.cancel()
        start = time.monotonic()
        await fine_sleep(800e-6)
        assert time.monotonic() - start >= 800e-6

    uvloop.run(main())
