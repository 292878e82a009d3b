"""A first round that waits for prefix blocks still being written (--prefix-sharing;
services/decode/prefixwait.py, ampd/policy/prefixwait.py) on a live mock deployment: real Redis on a
free port, the services on loopback, one prefill and one decode worker, a profile whose prefill
takes about a second. A session opened while another one's prefill is writing the same 1,024-token
prefix waits for it and shares it (its first round's history), with the tokens of the run alone; when
the writer is cancelled during the wait, the waiter prefills the prefix itself and completes. The
decode worker's pool holds nothing but cached prefix blocks at the end."""
from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest

from ampd import grpcserver
from ampd.launcher import Deployment, Options
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.integration.live_replay import fast_profile
from tests.integration.rpc_metrics import worker_metrics
from tests.integration.test_stop_round import Conversation

pytestmark = pytest.mark.timeout(120)

PREFIX = list(range(1, 1025))  # 32 blocks of 32 tokens


def _profile(tmp_path: Path) -> str:
    path = Path(fast_profile(tmp_path, "prefixwait@test"))
    d = json.loads(path.read_text())
    t = d["tp"]["1"]["t_pre"]["l_incr"]
    t["beta"] = [1e-3] * len(t["beta"])  # 1 ms a token: a 1,100-token prompt takes ~1.1 s
    path.write_text(json.dumps(d))
    return str(path)


def _open(stub, own: int) -> Conversation:
    c = Conversation(stub)
    turn = common_pb2.Turn(token_ids=PREFIX + [5000 + own + i for i in range(60)],
                           sampling=common_pb2.SamplingParams(max_tokens=6))
    c.send(coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(session_id=uuid.uuid4().hex, turn=turn)))
    return c


async def _answer(c: Conversation) -> tuple[list[int], common_pb2.RoundTiming]:
    end, seen = await c.until("round_end")
    c.send(coordinator_pb2.ClientMessage(close=coordinator_pb2.Close()))
    await c.until("done")
    c.send(None)
    return [t for e in seen if e.HasField("tokens") for t in e.tokens.token_ids], end.round_end.timing


@pytest.fixture(scope="module")
def dep(redis_url, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefixwait")
    opts = Options(prefill="tp1*1", decode="tp1*1", profile=_profile(tmp), policy="ampd", prefix_sharing=True,
                   redis_url=redis_url, namespace="prefixwait", run_dir=str(tmp / "run"))
    with Deployment(opts) as d:
        yield d


def _decode(dep) -> dict:
    return asyncio.run(worker_metrics(dep.redis_url, "prefixwait"))["decode-0"][1]


def test_a_session_opened_during_the_prefill_of_its_prefix_waits_and_shares_it(dep):
    async def scenario():
        ch = grpcserver.channel(dep.coordinator)
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        a = _open(stub, 0)
        await asyncio.sleep(0.4)  # its prefill (~1.1 s) is writing the prefix
        b = _open(stub, 100)
        (ta, ra), (tb, rb) = await asyncio.gather(_answer(a), _answer(b))
        await ch.close()
        return ta, ra, tb, rb

    before = _decode(dep)
    ta, ra, tb, rb = asyncio.run(scenario())
    m = _decode(dep)
    assert m["prefix_waits"] - before.get("prefix_waits", 0) == 1
    assert ra.l_hist == 0 and rb.l_hist == len(PREFIX) and rb.prefix_shared_tokens == len(PREFIX), (ra, rb)
    assert rb.first_token > ra.first_token
    assert len(ta) == len(tb) == 6
    assert m["kv_bytes_mismatched"] == 0 and m["sessions_failed"] == before.get("sessions_failed", 0)
    assert m["active_sessions"] == 0 and m["kv_free_tokens"] == m["kv_capacity_tokens"]


def test_a_waiting_session_whose_writer_is_cancelled_prefills_itself(dep):
    async def scenario():
        ch = grpcserver.channel(dep.coordinator)
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        a = _open(stub, 200)
        await asyncio.sleep(0.4)
        b = _open(stub, 300)
        await asyncio.sleep(0.2)  # b waits for a's blocks
        a.send(coordinator_pb2.ClientMessage(cancel=coordinator_pb2.Cancel(reason="test")))
        tb, rb = await _answer(b)
        a.send(None)
        await ch.close()
        return tb, rb

    # a different prefix from the first test's (that one is cached now): 1,024 other tokens
    global PREFIX
    PREFIX = list(range(20_001, 21_025))
    before = _decode(dep)
    tb, rb = asyncio.run(scenario())
    m = _decode(dep)
    assert m["prefix_waits"] - before.get("prefix_waits", 0) == 1
    assert rb.l_hist == 0 and rb.prefix_shared_tokens == 0, rb  # nothing landed: it prefilled all
    assert len(tb) == 6
    assert m["sessions_failed"] - before.get("sessions_failed", 0) == 1  # the cancelled writer
    assert m["kv_bytes_mismatched"] == 0
    assert m["active_sessions"] == 0 and m["kv_free_tokens"] == m["kv_capacity_tokens"]
