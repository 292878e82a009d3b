"""Fixtures shared by every test tier: a private Redis server on a free port. And what running the
tests in two processes (`make test`: pytest-xdist, ``-n 2 --dist loadfile``) needs: a test marked
``alone`` (the fidelity tests, whose live side must not share the cores) runs while no other test
does, and SmolLM2's tokenizer is converted once before the workers start."""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

if os.environ.get("AMPD_TEST_COMPILED") == "1":  # tests/unit/test_compiled.py: these tests on the compiled cores
    from ampd import compiled

    compiled.install()
    assert compiled.active(), compiled.STATE


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: runs while no other test does, also under pytest-xdist")
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        # The xdist controller, before its workers start: the tokenizer's one conversion into
        # ~/.cache/ampd/models (a folder renamed into place) happens here, not in two workers at once.
        from ampd.engine.torch_models import smollm2_tokenizer_dir

        smollm2_tokenizer_dir()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("fidelity"):  # timing compared with the simulator's
            item.add_marker(pytest.mark.alone)


@contextlib.contextmanager
def _flock(path: Path, mode: int):
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _turn_to_run(item):
    """Under pytest-xdist: every test holds a shared lock while it runs (its setup and teardown too,
    so a module's deployment starts and stops inside it), an ``alone`` test the exclusive one. A
    second lock, the turnstile, lets a waiting ``alone`` test in before the next shared holder."""
    if not hasattr(item.config, "workerinput"):
        yield
        return
    run = Path(item.config.option.basetemp).parent  # this run's temporary folder, above each worker's
    turnstile, lock = run / "alone.turnstile", run / "alone.lock"
    if item.get_closest_marker("alone"):
        with open(lock, "a") as f:
            with _flock(turnstile, fcntl.LOCK_EX):  # no new shared holder from here on
                fcntl.flock(f, fcntl.LOCK_EX)  # once the running ones have finished
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    else:
        with _flock(turnstile, fcntl.LOCK_EX):
            pass
        with _flock(lock, fcntl.LOCK_SH):
            yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _turn_to_run(item):
        yield


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
