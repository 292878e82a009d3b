"""Faults under `ampd up`: a replay of 50 sessions through real Redis, NIXL and gRPC while a decode
worker and a prefill worker are killed with SIGKILL and Redis is killed and restarted. The supervisor
restarts each; sessions on the lost decode worker move to the other one (their history prefilled
again there), rounds on the lost prefill worker run on their decode worker, and every service
reconnects to the new Redis. Every session must complete or end with a clear status (none hangs),
every token must be the right one at the right position (none duplicated or missing), and no KV
block, session or Redis key may be left behind.

Then the torch engine: a session whose decode worker is killed mid-round continues on the other
one with greedy tokens equal to one transformers model running the same conversation.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
import redis

from ampd import grpcserver
from ampd.bench.client import replay
from ampd.coordinators import session_events
from ampd.launcher import Deployment, Options
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from ampd.workload.trace import Round, Session
from tests.integration.rpc_metrics import service_metrics

pytestmark = pytest.mark.timeout(240)

NS = "faults"


def _trace(n: int = 50) -> list[Session]:
    """Short sessions (three rounds, server-side tools) arriving over ~12 s."""
    out = []
    for i in range(n):
        k = i % 5
        out.append(Session(f"f{i}", 0.24 * i, (
            Round(300 + 40 * k, 14 + k, 0.4),
            Round(60 + 10 * k, 10 + k, 0.3),
            Round(40, 8 + k),
        )))
    return out


def _kill(dep: Deployment, name: str) -> None:
    """SIGKILL, and wait until it is gone (a large process takes a moment to die: until then the
    supervisor, and wait_serving, still see it running)."""
    proc = dep.child(name).proc
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _wait_registered(r: redis.Redis, workers: set[str], timeout_s: float = 60.0, ns: str = NS) -> None:
    """Until every worker is registered and alive again (the restarted ones too)."""
    have = alive = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            have = {k.decode() for k in r.hkeys(f"{ns}:workers")}
            alive = {w for w in workers if r.exists(f"{ns}:alive:{w}")}
            if have == workers and alive == workers:
                return
        except redis.ConnectionError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"workers not all back: registered {have}, alive {alive}")


async def _records_written(r, n: int, run: asyncio.Task, prefix: str = "") -> None:
    """Waits until the coordinator has written ``n`` records of sessions whose ids start with ``prefix``;
    fails, naming the count, when the replay ends first or they do not appear (a lost record used to
    make this wait forever)."""
    deadline = time.monotonic() + 30
    while (have := len(r.keys(f"{NS}:session:{prefix}*"))) < n:
        assert not run.done() and time.monotonic() < deadline, f"{have} of {n} session records written"
        await asyncio.sleep(0.1)


def test_replay_survives_killed_workers_and_a_redis_restart(tmp_path):
    # reattach_grace: the killed coordinator's sessions (no other coordinator to reattach them
    # through) are freed, and their records swept, within the checks' bounds
    opts = Options(prefill="tp1*2", decode="tp1*2", profile="qwen3-32b@h20", policy="remote", namespace=NS,
                   ttft_slo=2.0, itl_slo=0.1, run_dir=str(tmp_path), reattach_grace=3.0)
    sessions = _trace()
    with Deployment(opts) as dep:
        r = redis.Redis.from_url(dep.redis_url)
        workers = {"decode-0", "decode-1", "prefill-0", "prefill-1"}

        async def faults():
            await asyncio.sleep(3.0)
            _kill(dep, "decode-0")
            await asyncio.sleep(3.0)
            _kill(dep, "prefill-0")
            await asyncio.sleep(3.0)
            _kill(dep, "redis")

        async def scenario():
            injector = asyncio.create_task(faults())
            out = await replay(dep.coordinator, sessions, verify_tokens=True, progress=False, timeout_s=75)
            await injector
            return out

        records, stats, wall, _ = asyncio.run(scenario())
        failed = [x for x in records if not x.completed]
        # None hangs: a session that ran into its deadline would say DEADLINE_EXCEEDED.
        assert not [x for x in failed if "DEADLINE_EXCEEDED" in x.error], [x.error for x in failed]
        for x in failed:  # a clear status, naming what happened
            assert x.error.split(":")[0] in ("UNAVAILABLE", "ABORTED"), x.error
        completed = len(records) - len(failed)
        print(f"\nfaults: {completed}/{len(records)} sessions completed, {len(failed)} ended with an error "
              f"({[x.error for x in failed]}), wall {wall:.1f} s; supervisor: {dep.events}")
        assert completed >= 45, [x.error for x in failed]
        assert stats.token_mismatches == 0  # every token right, at its position: none duplicated or missing
        expected = sum(r_.output for s in sessions for r_ in s.rounds)
        done_ids = {x.session_id for x in records if x.completed}
        assert stats.tokens >= sum(r_.output for s in sessions if s.id in done_ids for r_ in s.rounds)
        assert stats.tokens <= expected

        for name in ("decode-0", "prefill-0", "redis"):
            assert any(e.startswith(f"{name} restarted") for e in dep.events), dep.events
        dep.wait_serving()
        _wait_registered(r, workers)
        coord = asyncio.run(service_metrics(dep.coordinator, "coordinator"))
        print(f"coordinator: {({k: v for k, v in coord.items() if k.startswith(('sessions', 'prefills'))})}")
        assert coord["sessions_moved"] >= 1
        assert coord["sessions_live"] == 0

        _nothing_left(r, workers)

        # The coordinator dies with sessions in flight: each ends with a clear status at once, the
        # restarted coordinator serves new sessions, and the dead one's records are swept.
        async def coordinator_killed():
            slow = [Session(f"c{i}", 0.0, (Round(100, 5, 30.0), Round(20, 5))) for i in range(4)]
            run = asyncio.create_task(replay(dep.coordinator, slow, progress=False, timeout_s=60))
            await _records_written(r, len(slow), run, "c")
            await asyncio.sleep(0.5)  # their first rounds are in their tool calls
            t = time.monotonic()
            _kill(dep, "coordinator")
            records, _, _, _ = await run
            return records, time.monotonic() - t

        records, took = asyncio.run(coordinator_killed())
        assert all(not x.completed and x.error.startswith("UNAVAILABLE") for x in records), [x.error for x in records]
        assert took < 10, took
        dep.wait_serving()
        again, _, _, _ = asyncio.run(replay(dep.coordinator, _trace(3), progress=False, timeout_s=60))
        assert all(x.completed for x in again), [x.error for x in again]
        # The dead coordinator's records are swept by the restarted one's orphan sweep (every ~10 s, a
        # record reattach_grace after it was first found): checked, with nothing else left, after the
        # next scenario, which runs meanwhile (its sessions are not orphans: the coordinator serves them).

        # SIGTERM to a decode worker serving sessions (in their tool calls): it leaves routing and
        # exits within seconds, and its sessions move and complete (their tool calls run again).
        async def decode_stopped():
            slow = [Session(f"t{i}", 0.0, (Round(100, 5, 2.0), Round(20, 5))) for i in range(6)]
            run = asyncio.create_task(replay(dep.coordinator, slow, progress=False, timeout_s=60))
            await _records_written(r, len(slow), run, "t")
            await asyncio.sleep(0.5)
            proc = dep.child("decode-1").proc
            t = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            while proc.poll() is None and time.monotonic() - t < 15:
                await asyncio.sleep(0.05)
            stopped_s = time.monotonic() - t
            records, _, _, _ = await run
            return records, stopped_s

        records, stopped_s = asyncio.run(decode_stopped())
        assert stopped_s < 10, stopped_s  # the stop watchdog's bound (ampd.grpcserver)
        print(f"decode-1 stopped {stopped_s:.1f} s after SIGTERM; its {len(records)} sessions moved and completed")
        assert all(x.completed for x in records), [x.error for x in records]
        dep.wait_serving()
        _wait_registered(r, workers)
        deadline = time.monotonic() + 30  # the killed coordinator's records too (see above)
        while r.keys(f"{NS}:session:*") and time.monotonic() < deadline:
            time.sleep(0.2)
        _nothing_left(r, workers)


def _nothing_left(r: redis.Redis, workers: set[str], ns: str = NS) -> None:
    """No session record, no KV block held, only the live workers' and coordinators' keys."""
    import json

    keys = {k.decode() for k in r.keys(f"{ns}:*") if not k.decode().startswith(f"{ns}:coordinator:")}
    # --prefix-sharing (on by default): a live decode worker publishes the prompt blocks it still caches
    # for binding; an owned key (a TTL the worker renews, deleted when it deregisters), of live workers only
    prefixes = {k for k in keys if k.startswith(f"{ns}:prefix:")}
    assert prefixes <= {f"{ns}:prefix:{w}" for w in workers}, prefixes
    assert all(r.pttl(k) > 0 for k in prefixes), {k: r.pttl(k) for k in prefixes}
    keys -= prefixes
    assert keys == {f"{ns}:workers", f"{ns}:nixl", f"{ns}:stats"} | {f"{ns}:alive:{w}" for w in workers}, keys
    deadline = time.monotonic() + 10
    for wid, raw in r.hgetall(f"{ns}:workers").items():
        info = json.loads(raw)
        while True:  # a session ended by a lost coordinator is freed once its worker sees the stream go
            m = asyncio.run(service_metrics(info["address"], info["kind"]))
            if m["kv_free_tokens"] == m["kv_capacity_tokens"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert m["kv_free_tokens"] == m["kv_capacity_tokens"], f"{wid} still holds KV"
        assert m["kv_bytes_mismatched"] == 0, wid
        if info["kind"] == "decode":
            assert m["active_sessions"] == 0, wid


# ------------------------------------------------------------------------------- torch, greedy
def _sampling(n: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=n, ignore_eos=True)


async def _killed_session(dep: Deployment, sid: str, turns, kill_at=()):
    """Runs the conversation; SIGKILLs the bound decode worker (whichever it is then) each time the
    output tokens reach the next count of ``kill_at``. Returns every output token in order, the
    rounds' timings and the status the session ended with ("" when it completed)."""
    ch = grpcserver.channel(dep.coordinator)
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    outbox: asyncio.Queue = asyncio.Queue()

    def turn(i: int) -> common_pb2.Turn:
        ids, out, calls = turns[i]
        return common_pb2.Turn(token_ids=ids, sampling=_sampling(out), script=[common_pb2.ScriptedCall(
            tool=common_pb2.ToolSpec(name="replay", latency_s=0.3), result_tokens=n_in, sampling=_sampling(n_out))
            for n_in, n_out in calls])

    await outbox.put(coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(session_id=sid, turn=turn(0))))

    async def requests():
        while (m := await outbox.get()) is not None:
            yield m

    tokens, rounds, nxt, bound, kills, error = [], [], 1, "", list(kill_at), ""
    try:
        async for ev in session_events(stub.Session(requests(), timeout=120)):
            bound = ev.decode_worker or bound
            kind = ev.WhichOneof("event")
            if kind == "tokens":
                tokens.extend(ev.tokens.token_ids)
                if kills and len(tokens) >= kills[0]:
                    _kill(dep, bound)
                    kills.pop(0)
            elif kind == "turn_end":
                await outbox.put(coordinator_pb2.ClientMessage(turn=turn(nxt)) if nxt < len(turns) else None)
                nxt += 1
            elif kind == "done":
                rounds = list(ev.done.rounds)
    except grpc.aio.AioRpcError as exc:
        error = f"{exc.code().name}: {exc.details()}"
    await ch.close()
    return tokens, rounds, error


def test_a_session_past_its_migration_limit_ends_unavailable(tmp_path):
    """--migration-limit 1: the session moves once when its decode worker is killed, and ends with
    UNAVAILABLE naming the limit when its second one is; nothing is left behind."""
    ns = "faults-limit"
    opts = Options(prefill="tp1*1", decode="tp1*2", profile="qwen3-32b@h20", policy="remote", namespace=ns,
                   migration_limit=1, run_dir=str(tmp_path))
    turns = [(list(range(3, 203)), 400, [])]  # one long round: both kills land in it
    with Deployment(opts) as dep:
        tokens, rounds, error = asyncio.run(_killed_session(dep, "limited", turns, (5, 15)))
        assert error.startswith("UNAVAILABLE: ") and "already moved 1 times" in error, error
        assert "--migration-limit" in error and 15 <= len(tokens) < 400 and not rounds
        coord = asyncio.run(service_metrics(dep.coordinator, "coordinator"))
        assert coord["sessions_moved"] == 1 and coord["sessions_failed"] == 1 and coord["sessions_live"] == 0
        dep.wait_serving()
        r = redis.Redis.from_url(dep.redis_url)
        workers = {"decode-0", "decode-1", "prefill-0"}
        _wait_registered(r, workers, ns=ns)
        _nothing_left(r, workers, ns)


def test_torch_session_moved_mid_round_gives_the_undisturbed_greedy_tokens(tmp_path):
    import torch

    from ampd.engine.torch_models import save_tiny_llama

    vocab = 512  # the tiny random Llama of tests/integration/test_torch_sessions.py

    def _ids(seed: int, n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    tiny = save_tiny_llama(tmp_path / "tiny", vocab_size=vocab, layers=3)
    turns = [(_ids(1, 70), 40, [(12, 30)]), (_ids(2, 9), 20, [])]
    opts = Options(prefill="tp1*1", decode="tp1*2", engine="torch", model=str(tiny), policy="remote",
                   profile="qwen3-32b@h20", namespace="faults-torch", ttft_slo=5.0, itl_slo=1.0,
                   run_dir=str(tmp_path / "run"))
    with Deployment(opts) as dep:
        plain, _, _ = asyncio.run(_killed_session(dep, "undisturbed", turns))
        # killed at two points: mid-round 0 (the first worker's), mid-round 1 (a tool result's round);
        # each time with the other decode worker serving (the one killed before is back)
        r = redis.Redis.from_url(dep.redis_url)
        moved = []
        for k in (5, 45):
            dep.wait_serving()
            _wait_registered(r, {"decode-0", "decode-1", "prefill-0"}, ns="faults-torch")
            moved.append(asyncio.run(_killed_session(dep, f"moved-{k}", turns, (k,)))[:2])
    assert len(plain) == 40 + 30 + 20
    for tokens, rounds in moved:
        assert tokens == plain
        assert [(t.round, t.tokens) for t in rounds] == [(0, 40), (1, 30), (2, 20)]
        assert any(t.recovered for t in rounds)
