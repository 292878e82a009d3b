"""Prefix sharing on a live mock deployment (--prefix-sharing; services/decode/prefix.py): real Redis
on a free port, the services on loopback, one prefill and one decode worker, the remote and local
prefill paths both taken. Sessions whose first prompts start with the same system prompt (the trace's
hash_ids: two 512-token blocks) complete with sharing off and on; on, every session after the first
finds the system prompt's KV shared (its first round's history, not prefilled), every mock KV byte
that crossed NIXL checks out, the tokens are those of the run with sharing off, and the decode
worker's pool holds nothing but cached prefix blocks at the end."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ampd.launcher import Deployment, Options
from ampd.workload import Round, Session
from tests.integration.live_replay import fast_profile, replayed

pytestmark = pytest.mark.timeout(120)

SYSTEM = (0, 1)  # the shared system prompt: two 512-token hash blocks
SESSIONS = [Session(f"p{i}", 0.25 * i, (Round(input=1024 + 40 + 7 * i, output=6, tool_s=0.1,
                                              hash_ids=(*SYSTEM, 100 + i, )),
                                        Round(input=30, output=6)))
            for i in range(6)]


def _profile(tmp_path: Path) -> str:
    return fast_profile(tmp_path, "prefixlive@test")


def _run(redis_url: str, tmp_path: Path, on: bool):
    opts = Options(prefill="tp1*1", decode="tp1*1", profile=_profile(tmp_path), policy="ampd", prefix_sharing=on,
                   redis_url=redis_url, namespace=f"prefix-{on}", run_dir=str(tmp_path / f"run-{on}"))
    # every token is the one the mock makes at its position, as with sharing off
    records, stats, metrics = replayed(opts, SESSIONS)
    return records, stats, metrics


def test_sessions_share_the_system_prompt_and_complete_as_without(redis_url, tmp_path):
    off, off_stats, off_m = _run(redis_url, tmp_path, False)
    on, on_stats, on_m = _run(redis_url, tmp_path, True)
    for records, stats in ((off, off_stats), (on, on_stats)):
        assert all(r.completed for r in records), [r.error for r in records]
        assert stats.token_mismatches == 0 and not stats.errors
    assert on_stats.tokens == off_stats.tokens == 6 * 2 * 6
    first = {r.session_id: r.rounds[0] for r in on}
    assert all(first[s.id].l_hist == 0 for s in SESSIONS[:1])
    # every later session found the system prompt's 1024 tokens (32 blocks of 32) shared
    assert all(first[s.id].l_hist >= 1024 for s in SESSIONS[1:]), {k: v.l_hist for k, v in first.items()}
    assert all(r.rounds[0].l_hist == 0 for r in off)
    print({k: (v.l_hist, v.l_incr, v.local) for k, v in first.items()},
          {k: on_m["prefill-0"][k] for k in ("kv_bytes_verified", "history_tokens_read")})
    prefilled = {name: sum(x.l_incr for r in recs for x in r.rounds) for name, recs in (("off", off), ("on", on))}
    assert prefilled["on"] <= prefilled["off"] - 5 * 1024
    d_on, d_off = on_m["decode-0"], off_m["decode-0"]
    assert d_on["prefix_shared_tokens"] >= 5 * 1024 and d_off["prefix_shared_tokens"] == 0
    assert d_on["kv_bytes_mismatched"] == 0 and on_m["prefill-0"]["kv_bytes_mismatched"] == 0
    assert d_on["kv_bytes_verified"] > 0 and on_m["prefill-0"]["kv_bytes_verified"] > 0
    # nothing leaks: the pool holds only cached prefix blocks (free KV), the core charges nothing
    assert d_on["active_sessions"] == 0 and d_on["sessions_failed"] == 0 and d_on["kv_overcommits"] == 0
    assert d_on["prefix_cached_tokens"] > 0
    assert d_on["kv_free_tokens"] == d_on["kv_capacity_tokens"]  # cached blocks count free
    assert d_off["kv_free_tokens"] == d_off["kv_capacity_tokens"] and d_off["prefix_cached_tokens"] == 0


# ------------------------------------------------------------------------------ torch, greedy
from tests.integration.test_torch_sessions import _options, _session, expected, tiny_llama  # noqa: E402,F401


@pytest.mark.parametrize("policy", ["remote", "local"])
def test_torch_greedy_tokens_with_a_shared_prefix_equal_one_model(policy, expected, tiny_llama, redis_url,  # noqa: F811
                                                                   tmp_path):
    """The torch engine (a tiny Llama) with sharing on, every prefill remote (or every one local): the
    second session of the same conversation takes the first one's prompt blocks as its history (over
    NIXL, or in place), and both decode the tokens one model makes alone."""
    opts = _options(policy, tiny_llama, redis_url, tmp_path).with_(prefix_sharing=True,
                                                                   namespace=f"prefix-torch-{policy}")
    with Deployment(opts) as dep:
        tok_a, rounds_a = asyncio.run(_session(dep.coordinator, "torch-a"))
        tok_b, rounds_b = asyncio.run(_session(dep.coordinator, "torch-b"))
    assert tok_a == expected and tok_b == expected
    assert rounds_a[0].prefix_shared_tokens == 0 and rounds_a[0].l_hist == 0
    assert rounds_b[0].prefix_shared_tokens == rounds_b[0].l_hist == 64  # two 32-token blocks of the 70
    assert all(r.local == (policy == "local") for r in rounds_b)
