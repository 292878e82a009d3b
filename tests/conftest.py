"""Fixtures shared by every test tier: a private Redis server on a free port."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A redis-server of our own on a free loopback port (never the machine's shared one), started
    by the same helper `ampd up` uses."""
    from ampd.state.local import RedisStartError, start_redis, stop_process

    try:
        proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    except RedisStartError as exc:
        pytest.fail(f"{exc}; .ci/run installs it")
    yield url
    stop_process(proc)
