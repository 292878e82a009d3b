"""Fixtures shared by every test tier: a private Redis server on a free port."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _free_port() -> int:
    from ampd.launcher import free_port

    return free_port()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A redis-server of our own on a free loopback port (never the machine's shared one)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is required (apt-get install redis-server); .ci/run installs it")
    port = _free_port()
    d = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(d)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 15
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)
