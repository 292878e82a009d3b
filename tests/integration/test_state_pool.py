"""A process's Redis client under more concurrent calls than its pool holds (ampd.state.connect):
the calls beyond the pool wait for a connection instead of failing (issue 24: redis-py's default
pool raised MaxConnectionsError at its 100th connection, which the front answered with HTTP 500)."""
from __future__ import annotations

import asyncio
import time

import pytest

from ampd.state import connect
from ampd.state.store import POOL_CONNECTIONS

pytestmark = pytest.mark.timeout(60)


def test_calls_beyond_the_pool_wait_for_a_connection(redis_url):
    async def main() -> tuple[list, float, int]:
        r = await connect(redis_url)
        try:
            t0 = time.monotonic()
            # each BLPOP holds its connection for 0.2 s: 3 pools' worth must queue, not fail
            out = await asyncio.gather(*(r.blpop([f"pool-test:{i}"], timeout=0.2)
                                         for i in range(3 * POOL_CONNECTIONS + 10)), return_exceptions=True)
            return out, time.monotonic() - t0, len(r.connection_pool._in_use_connections)
        finally:
            await r.aclose()

    out, took, in_use = asyncio.run(main())
    assert [o for o in out if o is not None] == []  # no error, every BLPOP timed out empty
    assert took >= 0.2 * 3  # they waited their turn, POOL_CONNECTIONS at a time
    assert in_use == 0


def test_a_pooled_connection_survives_a_redis_restart(tmp_path):
    """After Redis restarts, every connection the pool kept is closed by the server: the next call
    on one must reconnect and succeed, not fail once per stale connection (a coordinator's session
    record was lost this way, and test_faults waited for it forever)."""
    from urllib.parse import urlparse

    from ampd.state.local import start_redis, stop_process

    proc, url = start_redis(tmp_path / "a")
    port = urlparse(url).port

    restarted = []

    async def main() -> list:
        r = await connect(url)
        try:
            # several pooled connections, each opened before the restart
            await asyncio.gather(*(r.blpop([f"restart-test:{i}"], timeout=0.1) for i in range(4)))
            stop_process(proc)
            restarted.append(start_redis(tmp_path / "b", port=port)[0])
            return [await r.set(f"restart-test:{i}", b"x") for i in range(4)]
        finally:
            await r.aclose()

    try:
        assert asyncio.run(main()) == [True] * 4
    finally:
        for p in (proc, *restarted):
            stop_process(p)
