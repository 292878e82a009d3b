"""Agent hints on a live deployment (mock engine, real gRPC, Redis and NIXL): a trace's round hints go
out on the replayed turns (ampd.bench.client; through the OpenAI front as ``ampd_hints``,
ampd.bench.openai_client) and the decode worker's host KV tier reads them
(``kvtier.decide_hinted``). An honest ``expected_tool_s`` changes the decision (``long-tool`` from the
first call, where without a hint the never observed tool is ``unknown-tool``); a hostile one (0 s on
1 s calls, with extreme priority and output hints) never keeps KV on the device that the estimate
moves (no ``keep:short-tool``), and every session completes with every token right."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from ampd.launcher import Deployment, Options
from ampd.policy.hints import Hints
from tests.integration.rpc_metrics import worker_metrics
from tests.integration.test_kv_tier_live import KV_TOKENS, SESSIONS, _profile, _replayed

pytestmark = pytest.mark.timeout(300)


def _hinted(h: Hints):
    return [dataclasses.replace(s, rounds=tuple(dataclasses.replace(r, hints=h) for r in s.rounds)) for s in SESSIONS]


def _decisions(m: dict) -> dict[str, float]:
    return {k.removeprefix("kv_tier_decision_"): v for k, v in m.items() if k.startswith("kv_tier_decision_")}


# hostile-yield: every turn also yields the most (each round queued 100 s later in the decode worker's
# local prefill queue, PrefillTask.queue_yield_s): all still complete, every token right
@pytest.mark.parametrize("hints", [Hints(expected_tool_s=1.0), Hints(100, 1, 0.0), Hints(-100, 1, 0.0)],
                         ids=["honest", "hostile", "hostile-yield"])
def test_the_tier_reads_the_tool_hint_and_a_hostile_one_keeps_nothing_the_estimate_moves(redis_url, tmp_path, hints):
    tag = "honest" if hints.expected_tool_s else "hostile"
    # every pause is judged (pressure threshold 0); admission "none" lets all six in at once
    opts = Options(prefill="none", decode="tp1*1", profile=_profile(tmp_path, KV_TOKENS), policy="local",
                   admission="none", kv_host_mb=1, kv_offload_pressure=0.0, redis_url=redis_url,
                   namespace=f"hints-{tag}{hints.priority}", run_dir=str(tmp_path / tag))
    records, stats, metrics = _replayed(opts, _hinted(hints))
    m = metrics["decode-0"]
    assert all(r.completed for r in records), [r.error for r in records]
    assert stats.token_mismatches == 0 and stats.tokens == 6 * 3 * 8 and m["sessions_failed"] == 0
    d = _decisions(m)
    print(tag, d)
    if tag == "honest":  # the hint stands for the estimate the first "replay" call has not got
        assert d.get("offload:long-tool", 0) >= 6 and "offload:unknown-tool" not in d, d
    else:  # 0 s would keep every session's KV ("short-tool"); the 1 s calls' estimate moves it
        assert not any(k.startswith("keep:") for k in d) and d.get("offload:unknown-tool", 0) >= 1, d
    assert m["kv_free_tokens"] == KV_TOKENS and m["kv_tier_host_used_blocks"] == 0 and m["kv_overcommits"] == 0


def test_the_openai_fronts_ampd_hints_reach_the_tier(redis_url, tmp_path):
    """The OpenAI replay sends each round's hints as ``ampd_hints``; the front forwards them on the
    turn, and the decode worker judges each turn's end by them: ``long-tool`` from the first, where
    the never observed wait for the client's next turn is ``unknown-tool`` without a hint."""
    from ampd.bench.openai_client import replay_openai

    for tag, hints in (("plain", None), ("hinted", Hints(expected_tool_s=1.0))):
        opts = Options(prefill="none", decode="tp1*1", profile=_profile(tmp_path, KV_TOKENS), policy="local",
                       admission="none", kv_host_mb=1, kv_offload_pressure=0.0, redis_url=redis_url,
                       namespace=f"hints-openai-{tag}", run_dir=str(tmp_path / f"openai-{tag}"))
        sessions = SESSIONS[:3] if hints is None else _hinted(hints)[:3]
        with Deployment(opts, frontend=True) as dep:
            records, stats, _, _ = asyncio.run(replay_openai(dep.frontend, sessions, progress=False, timeout_s=60))
            m = asyncio.run(worker_metrics(redis_url, f"hints-openai-{tag}"))["decode-0"][1]
        assert not stats.errors and all(r.completed for r in records), stats.errors
        assert stats.tokens == 3 * 3 * 8
        d = _decisions(m)
        print(tag, d)
        if hints is None:
            assert d.get("offload:unknown-tool", 0) >= 1, d
        else:
            assert d.get("offload:long-tool", 0) >= 6 and "offload:unknown-tool" not in d, d
