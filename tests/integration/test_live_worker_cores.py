"""The live workers drive the pure worker cores (ampd/worker): the two behaviours the cores brought
to the live path, each on a real deployment (Redis, NIXL, gRPC, mock engines) with a profile made
for the effect to show.

- KV admission: a decode worker whose KV pool holds one session but not two. With ``wait`` (the
  default) the second session waits for KV and completes after the first frees it; with ``fail`` it
  fails ("KV exhausted"), which shows the pool really is too small for both.
- KV overlap: two remote prefills with history queued on one prefill worker. With the overlap the
  second's history read starts while the first computes (the worker's ``kv_reads_ahead`` and
  ``kv_read_hidden_s`` counters) and its round's TTFT is shorter by about the hidden read; with
  ``--no-kv-overlap`` nothing is read ahead.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ampd.launcher import Options
from ampd import perf
from ampd.workload import Round, Session
from tests.integration.live_replay import replayed

pytestmark = pytest.mark.timeout(240)

PRE_S = 0.6  # every prefill
READ_S_PER_TOKEN = 4e-4  # KV transfer: 2,000 tokens take 0.8 s
KV_TOKENS = 2048  # the decode worker's KV pool


def _profile(tmp_path: Path, kv_tokens: int = 65_536) -> str:
    """zero@none with a constant prefill time, slow KV transfers, 10 ms decode steps and a KV pool
    of ``kv_tokens`` at TP 1."""
    d = json.loads((Path(perf.__file__).parent / "profiles" / "zero@none.json").read_text())
    d["name"] = "slowkv@test"
    kv = d["t_kv"]["bytes_per_link"]
    kv["beta"] = [READ_S_PER_TOKEN / d["kv_bytes_per_token"]] * len(kv["beta"])
    t1 = d["tp"]["1"]
    t1["kv_capacity_tokens"] = kv_tokens
    t1["t_pre"]["l_incr"]["alpha"] = [PRE_S] * len(t1["t_pre"]["l_incr"]["alpha"])
    t1["t_dec"]["batch"]["alpha"] = [0.01] * len(t1["t_dec"]["batch"]["alpha"])
    path = tmp_path / "slowkv@test.json"
    path.write_text(json.dumps(d))
    return str(path)


def _run(opts: Options, sessions: list[Session]):
    records, stats, metrics = replayed(opts, sessions, timeout_s=120)
    return records, stats, metrics


@pytest.mark.parametrize("rule", ["wait", "fail"])
def test_kv_admission_second_session_waits_for_kv(rule, redis_url, tmp_path):
    # each session needs 1,200 tokens of input KV (38 blocks of 32) in a 2,048-token pool (64 blocks):
    # the coordinator admits the second only once the first has ended, so the decode worker's own
    # rule (wait or fail) never has to act and no accepted session is aborted for lack of KV
    sessions = [Session("first", 0.0, (Round(input=1200, output=40),)),
                Session("second", 0.1, (Round(input=1200, output=5),))]
    opts = Options(prefill="none", decode="tp1*1", profile=_profile(tmp_path, KV_TOKENS), policy="local",
                   redis_url=redis_url, namespace=f"kvwait-{rule}", kv_admission=rule, run_dir=str(tmp_path))
    records, stats, metrics = _run(opts, sessions)
    first, second = records
    m = metrics["decode-0"]
    assert first.completed, first.error
    assert m["kv_free_tokens"] == m["kv_capacity_tokens"] == KV_TOKENS and m["active_sessions"] == 0
    assert second.completed, second.error
    assert stats.token_mismatches == 0 and stats.tokens == 45
    assert m["kv_waits"] == 0 and m["sessions_failed"] == 0 and m["kv_overcommits"] == 0
    # the second round started only once the first session had ended and freed its KV
    assert second.rounds[0].first_token > first.rounds[0].token_times[-1]


def test_kv_admission_without_waiting_refuses_before_accepting(redis_url, tmp_path):
    sessions = [Session("first", 0.0, (Round(input=1200, output=40),)),
                Session("second", 0.1, (Round(input=1200, output=5),))]
    opts = Options(prefill="none", decode="tp1*1", profile=_profile(tmp_path, KV_TOKENS), policy="local",
                   redis_url=redis_url, namespace="kvwait-refuse", kv_admission="fail", admission_wait=0.0,
                   run_dir=str(tmp_path))
    records, stats, metrics = _run(opts, sessions)
    first, second = records
    m = metrics["decode-0"]
    assert first.completed, first.error
    assert not second.completed and "RESOURCE_EXHAUSTED" in second.error, second.error
    assert not second.rounds or second.rounds[0].first_token is None  # refused, never started
    assert m["sessions_failed"] == 0 and m["kv_free_tokens"] == m["kv_capacity_tokens"]


@pytest.mark.parametrize("overlap", [True, False])
def test_kv_overlap_reads_the_next_history_while_the_current_task_computes(overlap, redis_url, tmp_path):
    # Two sessions whose second rounds (2,001 tokens of history each) reach the one prefill worker
    # together: the second waits behind the first.
    # s0's first round is prefilled first (0.6 s compute + 0.8 s write back), then s1's: their
    # tool times make both second rounds ready together.
    sessions = [Session(f"s{i}", 0.05 * i, (Round(input=2000, output=1, tool_s=tool_s), Round(input=50, output=2)))
                for i, tool_s in enumerate((1.9, 0.5))]
    opts = Options(prefill="tp1*1", decode="tp1*1", profile=_profile(tmp_path), policy="remote",
                   redis_url=redis_url, namespace=f"overlap-{overlap}", kv_overlap=overlap,
                   run_dir=str(tmp_path))
    records, stats, metrics = _run(opts, sessions)
    assert all(r.completed for r in records), [r.error for r in records]
    assert stats.token_mismatches == 0
    m = metrics["prefill-0"]
    assert m["kv_bytes_mismatched"] == 0 and m["tasks_failed"] == 0
    assert m["kv_free_tokens"] == m["kv_capacity_tokens"]
    read_s = 2001 * READ_S_PER_TOKEN
    second = max((r.rounds[1] for r in records), key=lambda x: x.first_token)
    ttft = second.first_token - second.input_ready
    print(f"overlap={overlap}: second round-1 TTFT {ttft:.3f} s, reads ahead {m['kv_reads_ahead']:.0f}, "
          f"hidden {m['kv_read_hidden_s']:.3f} s")
    if overlap:
        # the second history read began while the first task computed: the part of it that ran
        # before the first task left service exceeds that task's write-back (50 tokens, 20 ms)
        assert m["kv_reads_ahead"] >= 1
        assert m["kv_read_hidden_s"] >= 0.5 * PRE_S
        # the first task's read, compute and write, then the rest of the second's read (its
        # first PRE_S + 20 ms ran hidden), its compute and write: ~2.22 s; 2.84 s without
        assert ttft < 2 * read_s + 2 * PRE_S - 0.5 * PRE_S
    else:
        assert m["kv_reads_ahead"] == 0 and m["kv_read_hidden_s"] == 0
        assert ttft >= 2 * read_s + 2 * PRE_S - 0.05  # one task at a time: read, compute, write
