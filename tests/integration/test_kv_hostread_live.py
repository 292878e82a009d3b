"""Remote prefill from the host copy on a live deployment (docs/kv.md "Remote prefill from the host
copy"): real coordinator, prefill worker, decode worker with its host KV tier (--kv-host-mb, every idle
session's KV moved: pressure threshold 0), sidecar and Redis on loopback, the mock engine, every
prefill routed to the prefill worker (policy remote).

Each session's rounds end in server-side tool calls long enough for the tier to move their KV to host,
so each next round starts with its KV on host. Its prefill task goes out at once, naming the host
copy (``PrefillTask.history_on_host``): the prefill worker reads the history from the decode worker's
host tier over NIXL, byte-checked, while the decode worker fetches it back to its device; the new KV is
written into the device pool. Checked: every such round was routed ``+kv-host`` and read from host
(its task sent before its fetch ended), the prefill worker read exactly those histories' tokens from
host and found no wrong byte, neither worker found a wrong byte, no prefill is overdue, every session
completes with every token right, and the device pools and the host pool are empty at the end.

Also, in one process: a round whose prefill worker could not read the host copy
(handed back before the fetch ended) runs on its decode worker once the fetch ended, nothing
prefilled again. (A fetch that fails: tests/unit/test_hostread.py; the torch engine's tokens
prefilled from the host copy: tests/integration/test_kv_tier_live.py.)"""
from __future__ import annotations

import pytest

from ampd.workload import Round, Session
from tests.integration.test_kv_route_live import KV_TOKENS, replay_on_host_tier

pytestmark = pytest.mark.timeout(120)

OUT = 6
SESSIONS = [Session(f"s{i}", 0.05 * i, (Round(input=300, output=OUT, tool_s=0.4),
                                        Round(input=100, output=OUT, tool_s=0.4), Round(input=50, output=OUT)))
            for i in range(4)]
# the history KV of the rounds after the tool calls: the rounds before, their inputs and outputs, but the
# last output token (its KV is computed by the next round's prefill)
HOST_HISTORY = len(SESSIONS) * ((300 + OUT - 1) + (300 + OUT + 100 + OUT - 1))


def test_rounds_on_host_are_prefilled_remotely_from_the_host_copy(redis_url, tmp_path):
    records, stats, coord, workers = replay_on_host_tier(redis_url, tmp_path, "remote", "kvhostread", SESSIONS)
    assert all(r.completed for r in records), [r.error for r in records]
    assert stats.token_mismatches == 0 and stats.tokens == len(SESSIONS) * 3 * OUT
    d, p = workers["decode-0"], workers["prefill-0"]
    routes = {k[len("route_"):]: v for k, v in coord.items() if k.startswith("route_") and v
              and not k.startswith("route_redis")}
    on_host = sum(v for k, v in routes.items() if k.endswith("+kv-host"))
    fetches = sum(v for k, v in d.items() if k.startswith("kv_tier_move_prefetch:"))
    failed = sum(v for k, v in d.items() if k.startswith("kv_tier_failed_"))
    print(f"routes {routes}; fetches {fetches:.0f}, failed {failed:.0f}, host reads {d['kv_tier_host_reads']:.0f} "
          f"(ahead of their fetch {d['kv_tier_host_read_ahead']:.0f}), host tokens read "
          f"{p['history_tokens_read_host']:.0f}, bytes verified decode {d['kv_bytes_verified']:.0f} "
          f"prefill {p['kv_bytes_verified']:.0f}")
    # the rounds after the tool calls (2 a session) had their KV on host, were routed saying so, and
    # were prefilled from the host copy: their tasks went out before their fetches back had ended
    assert fetches == 2 * len(SESSIONS) and failed == 0
    assert on_host == fetches and d["kv_tier_host_reads"] == fetches, routes
    assert d["kv_tier_host_read_ahead"] == fetches
    assert p["history_tokens_read_host"] == HOST_HISTORY
    assert d["prefills_remote"] == 3 * len(SESSIONS) and p["tasks_done"] == 3 * len(SESSIONS)
    # every byte checked: the history the prefill worker read from host, the new KV it wrote
    assert p["kv_bytes_verified"] > 0 and p["kv_bytes_mismatched"] == 0
    assert d["kv_bytes_verified"] > 0 and d["kv_bytes_mismatched"] == 0
    assert d["prefills_overdue"] == 0 and d["prefills_rerouted"] == 0 and d["sessions_failed"] == 0
    # no leak: the device pools and the host pool are empty, no session left
    assert d["kv_free_tokens"] == d["kv_capacity_tokens"] == KV_TOKENS and d["active_sessions"] == 0
    assert d["kv_tier_host_used_blocks"] == 0 and d["kv_tier_host_copies"] == 0
    assert p["kv_free_tokens"] == p["kv_capacity_tokens"]


async def _handed_back(redis_url: str, profile_path: str) -> None:
    from ampd.engine.mock import token_at
    from ampd.v1 import common_pb2, decode_pb2, prefill_pb2
    from services.decode.session import take_events
    from tests.integration.test_kv_tier_live import _answered, _turn, tier_worker
    from tests.kv_helpers import until

    dw, _, pool, _ = await tier_worker(redis_url, profile_path, "d-hostread", "hostread-unit")
    dw.start()
    live = dw.tier
    try:
        s = dw.open(decode_pb2.AttachRequest(open=common_pb2.OpenSession(session_id="h1", turn=_turn(100, 1)),
                                             session_secret="secret", route=decode_pb2.Route(l_hist=0, l_incr=100)))
        after, call, tokens, _ = await _answered(s, 0)
        await until(lambda: "h1" in live.copies, what="the offload")
        host_blocks = list(live.copies["h1"].blocks)
        dw.turn("h1", _turn(20, 2, answers=call, call=False), "secret")  # no route: it asks with a task
        events, after, _ = take_events(s, after)
        (task,) = [ev.prefill_task for ev in events if ev.WhichOneof("event") == "prefill_task"]
        # the task names the host copy's blocks, sent before the copy was back on the device
        assert task.history_on_host and [x.block for x in task.history] == host_blocks and task.l_hist == 103
        assert live.counts["kv_tier_host_reads"] == live.counts["kv_tier_host_read_ahead"] == 1
        # its prefill worker could not read the host copy: it hands the round back, before the fetch ended
        assert not live.reads.active["h1"].fetched
        dw.remote.on_done(prefill_pb2.PrefillDone(session_id="h1", round=1, task_token=task.task_token,
                                                  prefill_worker="p0", error="host read failed").SerializeToString())
        after, _, more, (timing,) = await _answered(s, after)
        tokens.update(more)
        # it ran here, on the history fetched back meanwhile: nothing prefilled again, every token right
        assert (timing.l_hist, timing.l_incr, timing.kv_recomputed_tokens, timing.local) == (103, 21, 0, True)
        assert sorted(tokens) == [100, 101, 102, 103, 124, 125, 126, 127]
        assert all(tok == token_at("h1", pos) for pos, tok in tokens.items())
        assert dw.metrics["prefills_rerouted"] == 1 and dw.metrics["sessions_failed"] == 0
        assert live.counts["kv_tier_move_prefetch:result-arrived"] == 1 and not live.reads.active
        dw.close_session("h1", "secret")
        await until(lambda: pool.free_tokens == pool.capacity_tokens, what="device pool empty")
        await until(lambda: live.pool.free_blocks == live.pool.num_blocks and not live.busy, what="host pool empty")
    finally:
        await dw.stop()
        await live.stop()


def test_a_host_read_the_prefill_worker_could_not_make_runs_on_the_decode_worker(redis_url, tmp_path):
    """One process, a decode worker with its tier (real NIXL agents): the prefill task of a round on
    host names the host copy; its prefill worker hands it back (the host read failed): the round runs
    on the decode worker once its fetch ended, every token right, both pools empty at the end."""
    import asyncio

    from tests.integration.test_kv_tier_live import _profile

    asyncio.run(_handed_back(redis_url, _profile(tmp_path, 2048)))
