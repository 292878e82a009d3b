"""StopRound through the gRPC session API (issue 24 item 8): a client that stops reading a stream can
end the current turn's decoding without ending the session, which then serves its next turn."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from ampd import grpcserver
from ampd.coordinators import session_events
from ampd.launcher import Deployment, Options
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.integration.rpc_metrics import service_metrics

pytestmark = pytest.mark.timeout(120)

LONG = 20_000  # output tokens a round would make unstopped: minutes on the profile's decode steps


@pytest.fixture(scope="module")
def dep(redis_url, tmp_path_factory):
    opts = Options(prefill="1", decode="1", profile="qwen3-32b@h20", redis_url=redis_url, namespace="stopround",
                   run_dir=str(tmp_path_factory.mktemp("run")))
    with Deployment(opts) as d:
        yield d


def turn(n: int, out: int, **kw) -> common_pb2.Turn:
    return common_pb2.Turn(token_ids=list(range(1, n + 1)), sampling=common_pb2.SamplingParams(max_tokens=out),
                           **kw)


STOP = coordinator_pb2.ClientMessage(stop=coordinator_pb2.StopRound())


class Conversation:
    def __init__(self, stub) -> None:
        self.out: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (m := await self.out.get()) is not None:
                yield m

        self.call = stub.Session(requests(), timeout=60)
        self.events = session_events(self.call)

    def send(self, msg) -> None:
        self.out.put_nowait(msg)

    async def until(self, kind: str) -> tuple[coordinator_pb2.SessionEvent, list]:
        seen = []
        async for ev in self.events:
            seen.append(ev)
            if ev.WhichOneof("event") == kind:
                return ev, seen
        raise AssertionError(f"the stream ended before {kind}: {seen[-3:]}")


def test_stop_ends_the_turn_and_the_session_serves_its_next_turn(dep):
    async def scenario():
        ch = grpcserver.channel(dep.coordinator)
        c = Conversation(coordinator_pb2_grpc.CoordinatorStub(ch))
        replay = common_pb2.ScriptedCall(tool=common_pb2.ToolSpec(latency_s=0.0), result_tokens=5,
                                         sampling=common_pb2.SamplingParams(max_tokens=LONG))
        # a turn that would make LONG tokens, then run a tool and make LONG more
        c.send(coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(
            session_id=uuid.uuid4().hex, turn=turn(50, LONG, script=[replay]))))
        await c.until("tokens")
        t0 = time.monotonic()
        c.send(STOP)
        end, seen = await c.until("turn_end")
        assert time.monotonic() - t0 < 10
        assert end.turn_end.finish_reason == "stop_requested"
        assert not [e for e in seen if e.HasField("tool_call")], "a stopped turn calls no tool"
        rounds = [e.round_end.timing for e in seen if e.HasField("round_end")]
        assert len(rounds) == 1 and rounds[0].finish_reason == "stop_requested" and rounds[0].tokens < LONG
        # the session is reusable: its next turn runs to its max_tokens on the same KV
        history = end.turn_end.history_tokens
        c.send(STOP)  # between turns: nothing to stop
        c.send(coordinator_pb2.ClientMessage(turn=turn(7, 4)))
        end2, seen2 = await c.until("turn_end")
        assert end2.turn_end.finish_reason == "length"
        assert sum(len(e.tokens.token_ids) for e in seen2 if e.HasField("tokens")) == 4
        assert end2.turn_end.history_tokens == history + 7 + 4
        c.send(coordinator_pb2.ClientMessage(close=coordinator_pb2.Close()))
        done, _ = await c.until("done")
        assert len(done.done.rounds) == 2
        c.send(None)
        await ch.close()

    asyncio.run(scenario())
    infos = asyncio.run(_decode_metrics(dep))
    assert infos["active_sessions"] == 0 and infos["kv_free_tokens"] == infos["kv_capacity_tokens"]


def test_stop_after_close_ends_the_session_at_once(dep):
    async def scenario():
        ch = grpcserver.channel(dep.coordinator)
        c = Conversation(coordinator_pb2_grpc.CoordinatorStub(ch))
        c.send(coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(session_id=uuid.uuid4().hex,
                                                                          turn=turn(30, LONG))))
        await c.until("tokens")
        c.send(coordinator_pb2.ClientMessage(close=coordinator_pb2.Close()))
        c.send(STOP)
        t0 = time.monotonic()
        done, seen = await c.until("done")
        assert time.monotonic() - t0 < 10
        assert [e.turn_end.finish_reason for e in seen if e.HasField("turn_end")] == ["stop_requested"]
        c.send(None)
        await ch.close()

    asyncio.run(scenario())


async def _decode_metrics(dep) -> dict[str, float]:
    from ampd.state import StateStore, connect

    store = StateStore(await connect(dep.redis_url), "stopround")
    try:
        info = next(i for i in (await store.workers()).values() if i.kind == "decode")
    finally:
        await store.r.aclose()
    deadline = time.monotonic() + 5
    while True:  # the session's end reaches the worker a moment after the client's
        m = await service_metrics(info.address, "decode")
        if m["active_sessions"] == 0 or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.1)
