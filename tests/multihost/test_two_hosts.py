"""Two hosts (network namespaces joined by veth, 10.213.0.1 and 10.213.0.2): Redis and the coordinator
on the first, prefill and decode workers on both, each bound to its host's address; KV moves over
NIXL with UCX over TCP, between the hosts for the rounds whose prefill and decode workers sit on
different ones. A mock replay checks every token and every KV byte; a torch replay gives the same
greedy tokens as the same deployment on one host; a NIXL read between the hosts moves checked bytes.
Needs root (`make test-multihost`); a namespace that cannot be made fails the test saying why.
"""
from __future__ import annotations

import pytest

from ampd.launcher import Deployment, Options
from ampd.trust import new_secret
from benchmarks.multihost_kv import measure
from tests.multihost.hosts import Hosts, HostsError, _ip
from tests.multihost.stack import Stack, run_driver

pytestmark = pytest.mark.timeout(420)

VOCAB = 512  # the tiny random Llama's (tests/integration/test_torch_sessions.py)


@pytest.fixture
def hosts():
    h = Hosts()
    try:
        h.__enter__()
    except HostsError as exc:
        pytest.fail(f"cannot build the two hosts: {exc}", pytrace=False)
    try:
        yield h
    finally:
        h.close()


def _ids(seed: int, n: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % (VOCAB - 3) for i in range(n)]


def _cross_host_rounds(result: dict, stack: Stack) -> int:
    """Rounds whose KV moved between the hosts: prefilled on one, decoded on the other."""
    n = 0
    for s in result["sessions"]:
        for r in s["rounds"]:
            if not r["local"] and r["prefill_worker"] and s["decode_workers"]:
                n += stack.host_of[r["prefill_worker"]] != stack.host_of[s["decode_workers"][0]]
    return n


def _options(**kw):
    return Options(prefill="tp1*2", decode="tp1*2", profile="qwen3-32b@h20", policy="remote",
                   internal_token=new_secret(), **kw)


def test_mock_replay_over_two_hosts(hosts, tmp_path):
    sessions = [{"id": f"m{i}", "start_s": 0.25 * i,
                 "turns": [[_ids(i, 200 + 40 * (i % 4)), 12, [[40, 8]]], [_ids(100 + i, 30), 6, []]]}
                for i in range(24)]
    with Stack(hosts, _options(namespace="twohosts"), tmp_path / "mock") as stack:
        out = stack.drive({"sessions": sessions, "verify_mock": True})
    failed = [s["error"] for s in out["sessions"] if s["error"]]
    assert not failed, failed
    assert sum(s["wrong_tokens"] for s in out["sessions"]) == 0
    assert sum(len(s["tokens"]) for s in out["sessions"]) == 24 * (12 + 8 + 6)
    cross = _cross_host_rounds(out, stack)
    print(f"\nmock: 24/24 sessions over two hosts in {out['wall_s']:.1f} s, {cross} rounds' KV between hosts")
    assert cross >= 1
    for wid, m in out["metrics"].items():  # every KV byte received was checked, none wrong
        assert m["kv_bytes_mismatched"] == 0, wid
        assert m["kv_free_tokens"] == m["kv_capacity_tokens"], wid
        if wid.startswith("decode"):
            assert m["kv_bytes_verified"] > 0, (wid, m)


def test_torch_tokens_over_two_hosts_equal_one_host(hosts, tmp_path):
    from ampd.engine.torch_models import save_tiny_llama

    tiny = save_tiny_llama(tmp_path / "tiny", vocab_size=VOCAB, layers=3)
    sessions = [{"id": f"t{i}", "start_s": 0.0,
                 "turns": [[_ids(i, 60 + 10 * i), 16, [[12, 10]]], [_ids(50 + i, 9), 10, []]]} for i in range(4)]
    spec = {"sessions": sessions, "sequential": True}
    opts = _options(namespace="twohosts-torch", engine="torch", model=str(tiny), ttft_slo=5.0, itl_slo=1.0)
    with Stack(hosts, opts, tmp_path / "two") as stack:
        two = stack.drive(spec)
    with Deployment(opts.with_(run_dir=str(tmp_path / "one"))) as dep:
        env = stack.env() | {"AMPD_INTERNAL_TOKEN": dep.internal_token}
        one = run_driver({**spec, "coordinator": dep.coordinator}, tmp_path, env)
    for out in (one, two):
        assert not [s["error"] for s in out["sessions"] if s["error"]]
    tokens_two = {s["id"]: s["tokens"] for s in two["sessions"]}
    tokens_one = {s["id"]: s["tokens"] for s in one["sessions"]}
    n = sum(len(t) for t in tokens_two.values())
    cross = _cross_host_rounds(two, stack)
    print(f"\ntorch: {n} greedy tokens over two hosts, {cross} rounds' KV between hosts; equal to one host: "
          f"{tokens_two == tokens_one}")
    assert n == 4 * (16 + 10 + 10)
    assert tokens_two == tokens_one
    assert cross >= 1
    for wid, m in two["metrics"].items():
        assert m["kv_bytes_mismatched"] == 0, wid


def test_nixl_reads_between_hosts_move_checked_bytes(hosts):
    result = measure(hosts, reps=3, sizes_mib=(1, 8))
    for case in result["cases"]:
        assert case["mismatched_bytes"] == 0, case
        assert case["gbps"] > 0, case
    print("\n" + "\n".join(f"{c['path']}: {c['label']} {c['gbps']:.2f} GB/s" for c in result["cases"]))


def test_a_namespace_that_cannot_be_made_fails_clearly():
    """The second namespace's name is taken: entering fails at once naming the command and the
    kernel's reason, and the first one, already made, is deleted again (the taken one is left)."""
    h = Hosts()
    _ip("netns", "add", h.names[1])
    try:
        with pytest.raises(HostsError) as e:
            h.__enter__()
        assert f"`ip netns add {h.names[1]}` failed" in str(e.value) and "exists" in str(e.value), str(e.value)
        names = _ip("netns", "list").stdout.split()
        assert h.names[0] not in names and h.names[1] in names
    finally:
        _ip("netns", "del", h.names[1], check=False)
