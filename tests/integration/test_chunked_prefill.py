"""Chunked local prefill (beyond the paper): a long local prefill runs in chunks interleaved with
the decode steps of the other sessions, and every token still comes out right."""
from __future__ import annotations

import asyncio

import pytest

from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.workload import Round, Session
from tests.integration.rpc_metrics import service_metrics

pytestmark = pytest.mark.timeout(180)


def test_chunked_local_prefill_interleaves_and_keeps_tokens_exact(redis_url, tmp_path):
    opts = Options(prefill="none", decode="tp2*1", profile="qwen3-32b@h20", policy="local",
                   redis_url=redis_url, namespace="chunked", chunked_prefill=True, run_dir=str(tmp_path))
    # A long-running decoder, then a long prompt arriving while it decodes.
    sessions = [
        Session("decoder", 0.0, (Round(input=200, output=120),)),
        Session("long-prompt", 0.5, (Round(input=6000, output=8, tool_s=0.1), Round(input=3000, output=4))),
    ]
    with Deployment(opts) as dep:
        records, stats, _, _ = asyncio.run(replay(dep.coordinator, sessions, verify_tokens=True, progress=False))
        from ampd.state import StateStore, connect

        async def address():
            store = StateStore(await connect(redis_url), "chunked")
            info = (await store.workers())["decode-0"]
            await store.r.aclose()
            return info.address

        m = asyncio.run(service_metrics(asyncio.run(address()), "decode"))
    assert all(r.completed for r in records), [r.error for r in records]
    assert stats.token_mismatches == 0 and stats.tokens == 120 + 8 + 4
    assert m["prefill_chunks"] >= 3  # 6000 and 3000 tokens split by the profile's chunk size
    # The decoder kept producing tokens while the long prompt was prefilled: no single gap as long
    # as the whole unchunked prefill of 6000 tokens.
    from ampd.perf import load_profile

    whole = load_profile("qwen3-32b@h20").t_pre(2, 0, 6000)
    times = records[0].rounds[0].token_times
    assert max(b - a for a, b in zip(times, times[1:])) < 0.8 * whole
