"""The host KV tier of a live decode worker (--kv-host-ratio / --kv-host-mb; services/decode/tier.py), through real NIXL
(the worker's agent and its host pool's agent), Redis and, for the deployments, gRPC.

- In one process, a decode worker on the mock engine: a session whose round ends in a client-side
  call has its KV offloaded to the host pool (the pressure threshold is 0), and its next turn brings
  it back (prefetch) and goes on from it; a host copy changed while it sat there (one byte) fails its
  prefetch's check, and one whose transfer fails (the host agent is unknown to the worker's) too:
  both sessions prefill their history again and complete with every token right. Every pool,
  device and host, is empty at the end.
- A deployment on the mock engine whose sessions (server-side tool calls through the sidecar)
  outgrow the decode worker's KV pool: every session completes, tokens right, KV moved both ways.
- With --prefix-sharing, a session whose prompt matches cached blocks that sit in a running round's
  output room (charged, not made yet) does not take them: the running round completes.
- On the torch engine (a tiny Llama, greedy) the tokens with the tier on equal those with it off, the
  prefills on the decode worker or on a prefill worker (then from the host copy).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ampd import perf
from ampd.bench.client import replay
from ampd.engine.mock import token_at
from ampd.launcher import Deployment, Options
from ampd.workload import Round, Session
from ampd.workload.ids import filler_ids
from tests.integration.rpc_metrics import worker_metrics
from tests.kv_helpers import until

pytestmark = pytest.mark.timeout(300)

PRE_S = 0.02  # every prefill: re-prefilling a history costs more than moving it (zero-cost transfers)


def _profile(tmp_path: Path, kv_tokens: int) -> str:
    """zero@none with a constant prefill time, 5 ms decode steps and a KV pool of ``kv_tokens``."""
    d = json.loads((Path(perf.__file__).parent / "profiles" / "zero@none.json").read_text())
    d["name"] = "kvtier@test"
    t1 = d["tp"]["1"]
    t1["kv_capacity_tokens"] = kv_tokens
    t1["t_pre"]["l_incr"]["alpha"] = [PRE_S] * len(t1["t_pre"]["l_incr"]["alpha"])
    t1["t_dec"]["batch"]["alpha"] = [0.005] * len(t1["t_dec"]["batch"]["alpha"])
    path = tmp_path / "kvtier@test.json"
    path.write_text(json.dumps(d))
    return str(path)


# ------------------------------------------------------------------------------ one process
def _turn(n: int, seed: int, out: int = 4, answers: str = "", call: bool = True, tool_s: float = 5.0):
    from ampd.v1 import common_pb2

    script = [common_pb2.ScriptedCall(tool=common_pb2.ToolSpec(name="lookup", client_side=True))] if call else []
    # the agent expects its call to take tool_s: long enough to move the KV (the policy's "long-tool")
    return common_pb2.Turn(token_ids=filler_ids(n, seed, 512), script=script, tool_call_id=answers,
                           sampling=common_pb2.SamplingParams(max_tokens=out, ignore_eos=True),
                           hints=common_pb2.TurnHints(expected_tool_s=tool_s) if call else None)


async def _answered(s, after: int) -> tuple[int, str, dict[int, int], list]:
    """The session's events up to its turn's end: (seq, the call's id, position -> token, timings)."""
    from services.decode.session import take_events

    call, tokens, timings = "", {}, []
    async with asyncio.timeout(20):
        while True:
            batch, after, failed = take_events(s, after)
            assert failed is None, failed.error
            if not batch:
                s.notify.clear()
                await s.notify.wait()
            for ev in batch:
                kind = ev.WhichOneof("event")
                if kind == "tokens":
                    tokens.update((ev.tokens.position + i, t) for i, t in enumerate(ev.tokens.token_ids))
                elif kind == "tool_call":
                    call = ev.tool_call.call_id
                elif kind == "round_end":
                    timings.append(ev.round_end.timing)
                elif kind == "turn_end":
                    return after, call, tokens, timings


async def tier_worker(redis_url: str, profile_path: str, worker_id: str = "d-tier", namespace: str = "tier-unit"):
    """A decode worker in this process on the mock engine, its host tier on (1 MiB, every idle
    session's KV moved): (the worker, its runtime, its device pool, its core's HostTier)."""
    from ampd.engine import make_engine
    from ampd.perf import load_profile
    from ampd.policy import SLO, make_queue, policy_spec
    from ampd.policy.kvtier import KVTierConfig
    from ampd.runtime import WorkerRuntime, pool_for, worker_config
    from ampd.state.store import StateStore, connect
    from ampd.worker import DecodeCore, HostTier
    from services.decode.server import build_parser
    from services.decode.worker import DecodeWorker

    args = build_parser().parse_args(["--worker-id", worker_id, "--redis-url", redis_url, "--namespace", namespace,
                                      "--engine", "mock", "--profile", profile_path, "--fence-after", "0.25",
                                      "--kv-host-mb", "1", "--kv-offload-pressure", "0"])
    cfg = worker_config(args, "decode", 1)
    profile = load_profile(cfg.profile)
    engine = make_engine("mock", profile, 1, "")
    pool = pool_for(profile, cfg, engine)
    rt = WorkerRuntime(cfg, StateStore(await connect(redis_url), namespace), pool)
    tier = HostTier.from_mb(cfg.kv_host_mb, pool.block_tokens, pool.bytes_per_token, pool.capacity_tokens,
                            KVTierConfig(offload_pressure=cfg.kv_offload_pressure))
    core = DecodeCore(cfg.worker_id, 1, profile, make_queue(policy_spec(cfg.policy).decode_queue, profile,
                                                            SLO(cfg.ttft_slo_s, cfg.itl_slo_s), 1),
                      kv_capacity_tokens=pool.capacity_tokens, step_by_step=True, tier=tier)
    dw = DecodeWorker(rt, engine, core)
    return dw, rt, pool, tier


async def _in_process(redis_url: str, profile_path: str) -> None:
    from ampd.v1 import common_pb2, decode_pb2

    dw, rt, pool, tier = await tier_worker(redis_url, profile_path)
    core = dw.core
    dw.start()
    live = dw.tier
    try:
        for seed, (sid, spoil) in enumerate((("kept", ""), ("corrupted", "mismatch"), ("unreachable", "transfer"),
                                              ("early", ""))):
            # "early": --kv-prefetch-early, and a call hinted 0.3 s: its KV comes back at 0.25 s, unasked
            tier.prefetch_early = sid == "early"
            # a prompt of its own: with --prefix-sharing (the default) one another session prefilled
            # would be shared and stay on the device (test_prefix_tier_live), where this moves it all
            first = _turn(100, 1 + seed, tool_s=0.3 if sid == "early" else 5.0)
            s = dw.open(decode_pb2.AttachRequest(open=common_pb2.OpenSession(session_id=sid, turn=first),
                                                 session_secret="secret",
                                                 route=decode_pb2.Route(l_hist=0, l_incr=100)))
            after, call, tokens, _ = await _answered(s, 0)
            assert call and sorted(tokens) == [100, 101, 102, 103]
            # its round ended in a call: the KV (103 tokens) went to the host pool, its device blocks free
            await until(lambda: sid in live.copies, what=f"{sid}'s offload")
            # (available: its prompt blocks the prefix index keeps cached meanwhile count free)
            assert s.kv.tokens == 0 and live.copies[sid].tokens == 103 and pool.available_tokens == pool.capacity_tokens
            if spoil == "mismatch":  # one byte of the host copy changes while it sits there
                live.pool.buffer[live.copies[sid].blocks[1] * live.pool.block_bytes + 5] ^= 0x5A
            elif spoil == "transfer":  # the worker's agent no longer knows the host pool's
                rt.transport.remove_peer(live.name)
            if sid == "early":
                await until(lambda: s.kv.tokens == 103 and not live.copies, timeout_s=5, what="the early prefetch")
            # the coordinator's route, decided for the KV on host (resident again for "early"): it holds
            where = "" if sid == "early" else "host"
            dw.turn(sid, _turn(20, 2, answers=call, call=False), "secret",
                    decode_pb2.Route(l_hist=103, l_incr=21, kv_state=where))
            after, _, more, (timing,) = await _answered(s, after)
            tokens.update(more)
            assert sorted(tokens) == [100, 101, 102, 103, 124, 125, 126, 127], sid
            assert all(tok == token_at(sid, pos) for pos, tok in tokens.items()), sid
            # a prefetched history is the round's history; a failed one is prefilled again
            assert (timing.l_hist, timing.l_incr, timing.kv_recomputed_tokens) == \
                ((103, 21, 0) if not spoil else (0, 124, 103)), sid
            if spoil == "transfer":
                rt.transport.add_peer(live.name, live.transport.metadata(), live.pool.layout)
            dw.close_session(sid, "secret")
        m = live.metrics()
        assert m["kv_tier_move_offload:long-tool"] == 4 and m["kv_tier_move_prefetch:result-arrived"] == 1
        assert m["kv_tier_move_prefetch:expected-end"] == m["kv_tier_decision_prefetch:expected-end"] == 1
        assert m["kv_tier_failed_prefetch:mismatch"] == 1 and m["kv_tier_failed_prefetch:transfer"] == 1
        assert m["kv_tier_bytes_from_host"] == 2 * 103 * pool.bytes_per_token
        assert m["kv_tier_decision_offload:long-tool"] == 4
        assert dw.metrics["kv_recomputed_tokens"] == 2 * 103 and dw.metrics["sessions_failed"] == 0
        # the routes held but for the two re-prefills (sized for the history): those asked, unanswered here
        assert dw.metrics["prefills_overdue"] == 2
        # no leak: every device and host block is free, and the core charges nothing
        await until(lambda: pool.available_tokens == pool.capacity_tokens, what="device pool empty")
        assert live.pool.free_blocks == live.pool.num_blocks and not live.copies and not live.busy
        assert core.kv_used == 0 and core.tier.host.empty and not core.sessions
    finally:
        await dw.stop()
        await live.stop()
        rt.transport.close()
        await rt.store.r.aclose()


def test_offload_prefetch_and_failed_prefetches_fall_back_to_re_prefill(redis_url, tmp_path):
    asyncio.run(_in_process(redis_url, _profile(tmp_path, 2048)))


# ------------------------------------------------------------------------------- deployments
KV_TOKENS = 2048  # the decode worker's pool: 64 blocks of 32
# six sessions whose first rounds (400 tokens each) do not fit together, each idle 1 s in a
# server-side tool call after its first two rounds: their histories (716 tokens at the end) outgrow
# the pool three times over, so rounds get KV only as idle sessions' KV moves to the host
SESSIONS = [Session(f"s{i}", 0.05 * i, (Round(input=400, output=8, tool_s=1.0), Round(input=200, output=8, tool_s=1.0),
                                        Round(input=100, output=8))) for i in range(6)]


def _replayed(opts, sessions, timeout_s: float = 120.0, infos: dict | None = None):
    """(records, replay stats, worker metrics); ``infos``, when given, gets the workers'
    registrations as the replay left them."""
    with Deployment(opts) as dep:
        records, stats, _, _ = asyncio.run(replay(dep.coordinator, sessions, verify_tokens=True, progress=False,
                                                  timeout_s=timeout_s))
        metrics = {w: m for w, (_, m) in asyncio.run(worker_metrics(opts.deployment.redis_url,
                                                                      opts.deployment.namespace)).items()}
        if infos is not None:
            infos.update(asyncio.run(_registered(opts.deployment.redis_url, opts.deployment.namespace)))
    return records, stats, metrics


async def _registered(url: str, namespace: str) -> dict:
    from ampd.state import StateStore, connect

    r = await connect(url)
    try:
        return await StateStore(r, namespace).workers()
    finally:
        await r.aclose()


def test_sessions_idle_in_tool_calls_move_to_host_and_every_session_completes(redis_url, tmp_path):
    # admission "none": every session is accepted at once and its rounds wait for KV on the decode
    # worker (the coordinator's own KV rule would hold the later sessions back instead)
    def opts(mb: int):
        return Options(prefill="none", decode="tp1*1", profile=_profile(tmp_path, KV_TOKENS), policy="local",
                       admission="none", kv_host_mb=mb, kv_host_ratio=0, redis_url=redis_url,
                       namespace=f"kvtier-mock-{mb}",
                       run_dir=str(tmp_path / f"run{mb}"))

    # the tier off: the idle histories hold the pool, the rounds that need more KV wait for each
    # other, and the ones let through over capacity fail ("KV exhausted"): not every session completes
    # (how many do depends on the box's timing: one that finishes while others wait frees its KV)
    records, _, metrics = _replayed(opts(0), SESSIONS, timeout_s=20)
    assert not all(r.completed for r in records) and metrics["decode-0"]["sessions_failed"] > 0
    records, stats, metrics = _replayed(opts(1), SESSIONS)
    m = metrics["decode-0"]
    assert all(r.completed for r in records), [r.error for r in records]
    assert stats.token_mismatches == 0 and stats.tokens == 6 * 3 * 8
    offloads = sum(v for k, v in m.items() if k.startswith("kv_tier_move_offload:"))
    prefetches = sum(v for k, v in m.items() if k.startswith("kv_tier_move_prefetch:"))
    failed = sum(v for k, v in m.items() if k.startswith("kv_tier_failed_"))
    print(f"offloads {offloads:.0f}, prefetches {prefetches:.0f}, failed {failed:.0f}, "
          f"to host {m['kv_tier_bytes_to_host']:.0f} B, from host {m['kv_tier_bytes_from_host']:.0f} B, "
          f"kv waits {m['kv_waits']:.0f}, decisions {sorted(k for k in m if k.startswith('kv_tier_decision_'))}")
    assert offloads >= 3 and prefetches >= 3 and failed == 0
    assert m["kv_tier_bytes_from_host"] > 0 and m["kv_tier_bytes_to_host"] >= m["kv_tier_bytes_from_host"]
    assert m["sessions_failed"] == 0 and m["kv_overcommits"] == 0
    # no leak: the device pool and the host pool are empty
    assert m["kv_free_tokens"] == m["kv_capacity_tokens"] == KV_TOKENS and m["active_sessions"] == 0
    assert m["kv_tier_host_used_blocks"] == 0 and m["kv_tier_host_copies"] == 0


@pytest.mark.parametrize("size, host_tokens", [({"kv_host_mb": 1}, 2**20 // 64),  # 1 MiB of 64-byte tokens
                                               ({"kv_host_ratio": 2}, 2 * KV_TOKENS)])  # twice the device pool
def test_the_default_kv_admission_promises_the_host_tier_and_every_session_completes(redis_url, tmp_path, size,
                                                                                     host_tokens):
    # admission "kv" (the default) promises the device pool plus the host pool the decode worker
    # registered: every session is admitted, and the idle ones' KV moves to host so that each round
    # still gets its KV on the device. The pool sized in MiB or by --kv-host-ratio, as registered.
    opts = Options(prefill="none", decode="tp1*1", profile=_profile(tmp_path, KV_TOKENS), policy="local",
                   redis_url=redis_url, namespace="kvtier-kv", run_dir=str(tmp_path / "run"), **size)
    infos: dict = {}
    records, stats, metrics = _replayed(opts, SESSIONS, infos=infos)
    assert infos["decode-0"].kv_host_tokens == host_tokens
    m = metrics["decode-0"]
    assert all(r.completed for r in records), [r.error for r in records]
    assert stats.token_mismatches == 0 and m["sessions_failed"] == 0 and m["kv_overcommits"] == 0
    assert sum(v for k, v in m.items() if k.startswith("kv_tier_move_offload:")) >= 3
    assert m["kv_free_tokens"] == KV_TOKENS and m["kv_tier_host_used_blocks"] == 0


async def _three_turns(address: str, ids: list[str]) -> list:
    """Each session: three turns, the first two ending in a client-side call (hinted 5 s long, so
    that the tier moves the KV), taken in turn: while one session answers, the others are idle."""
    from ampd import grpcserver
    from ampd.v1 import coordinator_pb2_grpc
    from tests.integration.test_kv_evict import _Conversation

    ch = grpcserver.channel(address)
    convs = [_Conversation(coordinator_pb2_grpc.CoordinatorStub(ch), sid) for sid in ids]
    for i, c in enumerate(convs):
        await c.open(_turn(300, 100 * i, out=6))
    for i, c in enumerate(convs):
        await c.turn(_turn(60, 100 * i + 1, out=6, answers=c.call_id))
    for i, c in enumerate(convs):
        await c.turn(_turn(30, 100 * i + 2, out=6, answers=c.call_id, call=False))
    await asyncio.gather(*(c.close() for c in convs))
    await ch.close()
    return convs


@pytest.mark.parametrize("prefill, policy", [("none", "local"), ("tp1*1", "remote")])
def test_torch_greedy_tokens_are_the_same_with_the_tier_on_and_off(redis_url, tmp_path, prefill, policy):
    """Every prefill on the decode worker, or every one on the prefill worker: with the tier on, the
    later turns' prefills then read the history from the host copy (docs/kv.md "Remote prefill from
    the host copy")."""
    pytest.importorskip("torch")
    from ampd.engine.torch_models import save_tiny_llama

    tiny = save_tiny_llama(tmp_path / "tiny", vocab_size=512, layers=3)
    tokens, m = {}, {}
    for mb in (0, 1):  # off, then on with every idle session's KV moved (pressure threshold 0)
        ns = f"kvtier-torch-{policy}-{mb}"
        opts = Options(prefill=prefill, decode="tp1*1", engine="torch", model=str(tiny),
                       profile=_profile(tmp_path, KV_TOKENS), policy=policy, kv_host_mb=mb, kv_host_ratio=0,
                       kv_offload_pressure=0.0, ttft_slo=5.0, itl_slo=1.0, redis_url=redis_url,
                       namespace=ns, run_dir=str(tmp_path / f"run{mb}"))
        with Deployment(opts) as dep:
            convs = asyncio.run(_three_turns(dep.coordinator, ["t0", "t1", "t2"]))
            workers = {w: v for w, (_, v) in asyncio.run(worker_metrics(redis_url, ns)).items()}
            m = workers["decode-0"]
        assert not any(c.error or c.duplicates for c in convs), [c.error for c in convs]
        tokens[mb] = {c.sid: c.tokens for c in convs}
        assert m["kv_free_tokens"] == m["kv_capacity_tokens"] and m["sessions_failed"] == 0
    prefetches = sum(v for k, v in m.items() if k.startswith("kv_tier_move_prefetch:"))
    assert prefetches == 6 and not any(k.startswith("kv_tier_failed_") for k in m)  # 2 a session
    assert m["kv_tier_host_used_blocks"] == 0 and m["kv_recomputed_tokens"] == 0
    if policy == "remote":  # those 6 rounds were prefilled from the host copy
        assert m["kv_tier_host_reads"] == 6 and workers["prefill-0"]["history_tokens_read_host"] > 0
    assert all(len(v) == 18 for v in tokens[0].values()) and tokens[1] == tokens[0]



# the six sessions above, their first outputs long (300 tokens, reserved a token a step): the rounds
# decoding at once outgrow the pool unless admission counts their output before it is made. Their
# first prompts are one 512-token hash block's ids (the same 400 tokens): a replayed prompt without
# hash ids begins with ids of its own session, and would share nothing
LONG_SESSIONS = [Session(s.id, s.arrival, (Round(input=400, output=300, tool_s=1.0, hash_ids=(7,)), *s.rounds[1:]))
                 for s in SESSIONS]


@pytest.mark.parametrize("sharing", [False, True], ids=["plain", "sharing"])
def test_rounds_decoding_at_once_never_outgrow_a_packed_pool(redis_url, tmp_path, sharing):
    # admission "none": the decode worker's core alone decides which rounds fit. With the tier each
    # round's whole output is charged when it is admitted, but the pool reserves it a token a step:
    # the count the core admits by must leave that room to it, or a later round takes it and a decode
    # token finds the pool full ("KV exhausted"). With --prefix-sharing the six first prompts (the
    # same 400 tokens) share 12 blocks, so more rounds run at once.
    opts = Options(prefill="none", decode="tp1*1", profile=_profile(tmp_path, KV_TOKENS), policy="local",
                   admission="none", kv_host_mb=1, prefix_sharing=sharing, redis_url=redis_url,
                   namespace=f"kvtier-packed-{sharing}", run_dir=str(tmp_path / "run"))
    records, stats, metrics = _replayed(opts, LONG_SESSIONS)
    m = metrics["decode-0"]
    print({k: m.get(k) for k in ("prefix_shared_tokens", "kv_waits", "kv_recomputed_tokens", "sessions_failed")})
    assert all(r.completed for r in records), [r.error for r in records]
    assert stats.token_mismatches == 0 and stats.tokens == 6 * (300 + 8 + 8) and m["kv_bytes_mismatched"] == 0
    assert m["kv_waits"] > 0  # the pool could not hold every first round at once: some waited
    if sharing:
        assert m["prefix_shared_tokens"] >= 384  # a later session found the first one's prompt blocks
        # a session whose device KV is only the prefix the others read is not dropped while another
        # victim frees blocks, while a round runs, or while an offload is still freeing blocks
        # (dropping it frees nothing and loses its host copy). Here the pool (2,048 tokens) has a
        # waiting round's room (700 tokens at most) once those end, so no session loses its KV:
        # the last resort, for a pool nothing else will free, never runs. Dropping while offloads
        # ran (a loaded box's slow moves) evicted sessions in 7 of 20 runs at load 7-12,
        # re-prefilling up to 3,037 tokens; none in 27 runs at load 5-14 since
        assert m["kv_evictions"] == 0 and m["kv_recomputed_tokens"] == 0, \
            {k: v for k, v in m.items() if k.startswith("kv_tier_decision_drop")}
    assert m["sessions_failed"] == 0 and m["kv_overcommits"] == 0 and m["active_sessions"] == 0
    # no leak: the device pool holds only cached prefix blocks, the host pool nothing
    assert m["kv_free_tokens"] == m["kv_capacity_tokens"] == KV_TOKENS  # (free counts cached prefix blocks)
    assert m["kv_tier_host_used_blocks"] == 0 and m["kv_tier_host_copies"] == 0


# a first session leaves its 1,100-token prompt's blocks cached (34 of the pool's 64), a second
# decodes 1,400 tokens (its output's room is the 28 free blocks and 16 of the cached ones), and a
# third, while it decodes, has the first one's prompt
REVIVE_SESSIONS = [Session("p", 0.0, (Round(input=1100, output=8, hash_ids=(7, 8)),)),
                   Session("a", 0.5, (Round(input=64, output=1400),)),
                   Session("c", 1.5, (Round(input=1100, output=8, hash_ids=(7, 8)),))]


def test_a_shared_prefix_never_takes_the_room_of_a_running_rounds_output(redis_url, tmp_path):
    # With the tier the core charges a round's whole output at admission and admits by the pool's
    # free and cached blocks less the output not made yet: cached blocks may be that output's room.
    # The third session sharing all 34 of them would leave the second's decode no block for its
    # ~960th token ("KV exhausted"); the cache gives way first (DecodeCore.revive_cut)
    opts = Options(prefill="none", decode="tp1*1", profile=_profile(tmp_path, KV_TOKENS), policy="local",
                   admission="none", kv_host_mb=1, redis_url=redis_url, namespace="kvtier-revive",
                   run_dir=str(tmp_path / "run"))
    records, stats, metrics = _replayed(opts, REVIVE_SESSIONS)
    m = metrics["decode-0"]
    print({k: m.get(k) for k in ("prefix_shared_tokens", "kv_waits", "sessions_failed", "kv_overcommits")})
    assert all(r.completed for r in records), [r.error for r in records]
    assert stats.token_mismatches == 0 and stats.tokens == 8 + 1400 + 8 and m["kv_bytes_mismatched"] == 0
    assert m["sessions_failed"] == 0 and m["kv_overcommits"] == 0 and m["active_sessions"] == 0
    assert m["kv_free_tokens"] == m["kv_capacity_tokens"] == KV_TOKENS  # no leak (free counts cached blocks)
    assert m["kv_tier_host_used_blocks"] == 0 and m["kv_tier_host_copies"] == 0
