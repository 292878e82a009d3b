"""Shared state through Redis Sentinel (`--redis-url redis+sentinel://...`), on real redis-server
processes: a master, one replica, three Sentinels. The master is killed with SIGKILL: the store's
next calls reach the promoted replica with the registry intact. A service whose Sentinels do not
answer exits with one line naming them. (The whole deployment through a failover mid-replay:
tests/multihost/test_sentinel_failover.py.)"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from ampd.config import ConfigError
from ampd.state.local import free_port
from ampd.state.store import REDIS_ERRORS, REGISTERED, StateStore, WorkerInfo, WorkerStats, connect
from ampd.state.url import sync_client
from tests.sentinels import MASTER, SentinelSet

pytestmark = pytest.mark.timeout(90)


async def _until_ok(call, timeout_s: float = 30.0):
    """``call()`` until it stops raising Redis errors (as the services' back-off does)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except REDIS_ERRORS:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def test_failover_keeps_the_registry_and_unreachable_sentinels_fail_clearly(tmp_path):
    # started first: it waits out the start-up retry (10 s) while the Sentinel set comes up
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    bad = subprocess.Popen([sys.executable, "-m", "services.coordinator", "--redis-url",
                            f"redis+sentinel://{','.join(dead)}/ampd-main"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with SentinelSet(tmp_path) as s:
            async def scenario():
                store = StateStore(await connect(s.url), "sent")
                info = WorkerInfo("decode-0", "decode", "127.0.0.1:1", 1, "agent", {}, 1000)
                stats = WorkerStats("decode-0", time.time(), None, (), 0.0, 1000)
                await store.register_worker(info, b"md", stats, ttl_s=30)
                await store.put_session("s1", {"round": 1})
                # replication is asynchronous: the last writes must have reached the replica
                s.client().execute_command("WAIT", 1, 2000)
                old = s.kill_master()
                t0 = time.monotonic()
                answer = await _until_ok(lambda: store.heartbeat(stats, ttl_s=30))
                took = time.monotonic() - t0
                new = s.wait_failover(old)
                assert new != old and answer == REGISTERED
                assert set(await store.workers()) == {"decode-0"}
                assert await store.nixl_metadata("decode-0") == b"md"
                await store.delete_session("s1")
                # the writes went to the promoted master, not somewhere else
                assert s.client(new).hkeys("sent:workers") == [b"decode-0"]
                assert not s.client(new).exists("sent:session:s1")
                await store.r.aclose()
                return took

            took = asyncio.run(scenario())

            async def unknown_group():  # Sentinels that answer but monitor no such master
                with pytest.raises(ConfigError) as e:
                    await connect(s.url.replace(f"/{MASTER}/", "/nope/"), timeout_s=0.5)
                return str(e.value)
            said = asyncio.run(unknown_group())
            assert said.startswith("--redis-url: the Redis Sentinels 127.0.0.1:") and "know no master group 'nope'" in said
            print(f"\nheartbeat answered by the new master {took:.1f} s after the old one was killed")
            assert took < 20
            r = sync_client(s.url, socket_timeout=2)  # the blocking client (sglang's KV linker) too
            assert r.hget("sent:workers", "decode-0") is not None
            r.close()
        _, err = bad.communicate(timeout=60)
    finally:
        if bad.poll() is None:
            bad.kill()
            bad.wait()
    assert bad.returncode != 0
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ampd-coordinator: error: --redis-url: no Redis Sentinel answered"), err
    assert all(d in lines[0] for d in dead), err
