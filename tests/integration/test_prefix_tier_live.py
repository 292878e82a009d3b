"""Prefix sharing composed with the host KV tier and with KV eviction on a live mock deployment (real
Redis on a free port, the services on loopback; services/decode/prefix.py, services/decode/tier.py).

- Sharing and the host tier on together: sessions whose first prompts start with the same system
  prompt (two 512-token hash blocks) go through long server-side tool calls; at each one the tier
  moves the session's own KV to the host (pressure threshold 0) while the system prompt's blocks,
  which the prefix index holds, stay on the device; the KV comes back when the result arrives. Every
  session completes with every token right (the mock's tokens are a function of session and
  position: those of the run with both off), every KV byte checks out, far fewer bytes go to the
  host than the histories hold, and both pools hold nothing but cached prefix blocks at the end.
- Sharing and --kv-evict under a pool too small for the sessions' own KV: idle sessions are evicted
  (their own blocks and their references, never a block another session reads) and every session
  completes, tokens right.
- The torch engine (a tiny Llama, greedy) with sharing and the tier on: the second session takes the
  first's prompt blocks, its own KV goes to host and back, and both decode the tokens one model
  makes alone.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ampd.launcher import Deployment, Options
from ampd.workload import Round, Session
from tests.integration.live_replay import fast_profile, replayed
from tests.integration.rpc_metrics import worker_metrics

pytestmark = pytest.mark.timeout(120)

SYSTEM = (0, 1)  # the shared system prompt: two 512-token hash blocks (1024 tokens)
BPT = 64  # the mock engine's KV bytes a token


def _profile(tmp_path: Path, kv_tokens: int) -> str:
    return fast_profile(tmp_path, "prefixtier@test", kv_tokens)


def _run(opts: Options, sessions: list[Session]):
    records, stats, metrics = replayed(opts, sessions)
    assert all(r.completed for r in records), [r.error for r in records]
    assert stats.token_mismatches == 0 and not stats.errors
    return records, stats, metrics


def _moves(m: dict, kind: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(f"kv_tier_{kind}"))


# --------------------------------------------------------------------- sharing + the host tier
# each session: the system prompt and 40 + 7i tokens of its own, then two rounds after 0.4 s tool calls
TIER_SESSIONS = [Session(f"t{i}", 0.3 * i, (Round(input=1024 + 40 + 7 * i, output=6, tool_s=0.4,
                                                  hash_ids=(*SYSTEM, 100 + i)),
                                            Round(input=30, output=6, tool_s=0.4), Round(input=20, output=6)))
                 for i in range(4)]


def test_shared_prefixes_stay_on_the_device_while_the_rest_moves_to_host_and_back(redis_url, tmp_path):
    def opts(on: bool) -> Options:
        return Options(prefill="tp1*1", decode="tp1*1", profile=_profile(tmp_path, 8192), policy="ampd",
                       prefix_sharing=on, kv_host_mb=1 if on else 0, kv_offload_pressure=0.0, redis_url=redis_url,
                       namespace=f"prefix-tier-{on}", run_dir=str(tmp_path / f"run-{on}"))

    off, off_stats, _ = _run(opts(False), TIER_SESSIONS)
    on, on_stats, metrics = _run(opts(True), TIER_SESSIONS)
    assert on_stats.tokens == off_stats.tokens == 4 * 3 * 6
    m = metrics["decode-0"]
    offloads, prefetches, failed = _moves(m, "move_offload:"), _moves(m, "move_prefetch:"), _moves(m, "failed_")
    print(f"offloads {offloads:.0f}, prefetches {prefetches:.0f}, to host {m['kv_tier_bytes_to_host']:.0f} B, "
          f"from host {m['kv_tier_bytes_from_host']:.0f} B, shared {m['prefix_shared_tokens']:.0f} tokens")
    # two tool calls a session, each moved both ways; the pause after its last turn moves it to host only
    assert prefetches == 2 * 4 and offloads == 3 * 4 and failed == 0
    assert m["prefix_shared_tokens"] >= 3 * 1024  # every session after the first found the system prompt
    # what moved is each session's own KV: the system prompt's 32 blocks, which the later sessions
    # found indexed, stayed on the device, so their offloads are the history less 1024 tokens (under
    # 150 here); the first session prefilled the prompt itself and shares nothing: its whole history
    # moves (about 1,100 tokens, three times)
    assert 0 < m["kv_tier_bytes_to_host"] <= (3 * 1200 + 9 * 150) * BPT
    assert 0 < m["kv_tier_bytes_from_host"] < m["kv_tier_bytes_to_host"]
    assert m["kv_bytes_mismatched"] == 0 and m["kv_recomputed_tokens"] == 0
    # the later rounds' history is all of it (pinned prefix + prefetched part), as with both off
    hist = {r.session_id: [x.l_hist for x in r.rounds[1:]] for r in on}
    assert hist == {r.session_id: [x.l_hist for x in r.rounds[1:]] for r in off}
    # no leak: the device pool holds only cached prefix blocks, the host pool nothing
    assert m["active_sessions"] == 0 and m["sessions_failed"] == 0 and m["kv_overcommits"] == 0
    assert m["kv_free_tokens"] == m["kv_capacity_tokens"]
    assert m["kv_tier_host_used_blocks"] == 0 and m["kv_tier_host_copies"] == 0


# ----------------------------------------------------------------------- sharing + --kv-evict
KV_TOKENS = 2048  # 64 blocks of 32: the system prompt (32 blocks) and two sessions' own KV at most
# each session (one every 0.4 s, after the one before published its prompt): the system prompt and 560
# tokens of its own; idle 0.5 s in a tool call, then a round
EVICT_SESSIONS = [Session(f"e{i}", 0.4 * i, (Round(input=1024 + 560, output=6, tool_s=0.5,
                                                    hash_ids=(*SYSTEM, 200 + i, 300 + i)),
                                              Round(input=30, output=6)))
                  for i in range(5)]


def test_evicting_a_sharing_session_drops_its_own_blocks_never_a_shared_one(redis_url, tmp_path):
    opts = Options(prefill="none", decode="tp1*1", profile=_profile(tmp_path, KV_TOKENS), policy="local",
                   admission="none", prefix_sharing=True, kv_evict=True, redis_url=redis_url,
                   namespace="prefix-evict", run_dir=str(tmp_path / "run"))
    records, stats, metrics = _run(opts, EVICT_SESSIONS)
    m = metrics["decode-0"]
    print({k: m[k] for k in ("kv_evictions", "kv_recomputed_tokens", "prefix_shared_tokens", "kv_waits")})
    assert stats.tokens == 5 * 2 * 6
    assert m["kv_evictions"] >= 1 and m["kv_recomputed_tokens"] > 0  # the pool could not hold every session
    assert m["prefix_shared_tokens"] >= 2 * 1024 and m["kv_bytes_mismatched"] == 0
    assert m["sessions_failed"] == 0 and m["kv_overcommits"] == 0 and m["active_sessions"] == 0
    assert m["kv_free_tokens"] == m["kv_capacity_tokens"] == KV_TOKENS


# ------------------------------------------------------------------------------ torch, greedy
from tests.integration.test_torch_sessions import _options, _session, expected, tiny_llama  # noqa: E402,F401


def test_torch_greedy_tokens_with_sharing_and_the_tier_equal_one_model(expected, tiny_llama, redis_url,  # noqa: F811
                                                                      tmp_path):
    """Every prefill remote; the second session shares the first one's two prompt blocks, and every
    pause (a client's next turn, a tool call) moves its own KV to host and back."""
    opts = _options("remote", tiny_llama, redis_url, tmp_path).with_(
        prefix_sharing=True, kv_host_mb=1, kv_offload_pressure=0.0, namespace="prefix-tier-torch")
    with Deployment(opts) as dep:
        tok_a, rounds_a = asyncio.run(_session(dep.coordinator, "torch-a"))
        tok_b, rounds_b = asyncio.run(_session(dep.coordinator, "torch-b"))
        m = asyncio.run(worker_metrics(redis_url, "prefix-tier-torch"))["decode-0"][1]
    assert tok_a == expected and tok_b == expected
    assert rounds_b[0].prefix_shared_tokens == rounds_b[0].l_hist == 64  # two 32-token blocks of the 70
    assert _moves(m, "move_prefetch:") >= 2 and not _moves(m, "failed_") and m["kv_recomputed_tokens"] == 0
    assert m["kv_free_tokens"] == m["kv_capacity_tokens"]
    assert m["kv_tier_host_used_blocks"] == 0 and m["sessions_failed"] == 0

