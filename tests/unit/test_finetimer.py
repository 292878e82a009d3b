"""fine_sleep keeps sub-millisecond sleeps under uvloop, whose own timers round to 1 ms."""
import asyncio
import statistics
import time

import uvloop

from ampd.kv.finetimer import fine_sleep


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
            d = await _durations(delay)
            assert min(d) >= delay  # uvloop's asyncio.sleep(0.0003) returns at once
            assert statistics.median(d) < 0.9e-3, (delay, d)  # ... and asyncio.sleep(0.0006) takes ~1.1 ms
        # concurrent sleeps end in deadline order
        done: list[int] = []

        async def one(i: int, delay: float) -> None:
            await fine_sleep(delay)
            done.append(i)

        await asyncio.gather(one(0, 900e-6), one(1, 300e-6), one(2, 600e-6), one(3, 5e-3))
        assert done == [1, 2, 0, 3]

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
