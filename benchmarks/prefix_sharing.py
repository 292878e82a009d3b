"""Prefix sharing (``--prefix-sharing``) on the Mooncake conversation trace, in the simulator.

The trace (FAST25-release/traces/conversation_trace.jsonl of kvcache-ai/Mooncake, not shipped: pass
``--mooncake``, or set AMPD_MOONCAKE_CONVERSATION) is imported with ``ampd trace import-mooncake``'s
importer (rows without a session id: one single-round session each, with the row's ``hash_ids``).
A window of WINDOW_S seconds is replayed at two rates (arrivals compressed or stretched), sharing
off against on, on one deployment. In the simulator (ampd/sim/prefixing.py) a decode worker shares
the blocks its live sessions hold and, once released, keeps them indexed in its free KV until the
space is needed (least recently released first), so a conversation's next turn finds its previous
turn's blocks on the worker that served it, and binding goes there when that saves >= 4 blocks.

Each pair runs at today's host KV tier (``kv_host_ratio``, default 1) and with the tier off (0), as
the other settings stay at their defaults. The trace's rows carry no session key, so every session
is one round with no tool call: the tier never moves KV here (0 bytes to and from host, reported per
run). With it on the decode core charges each round's whole output at admission
(``ampd.worker.DecodeCore._round_need``); released blocks stay cached in the room of output not made
yet, as the live pool keeps them until a token is written there (``Prefixing.prefix_trim``), so the
tier on and off share the same blocks here.

Writes benchmarks/results/prefix_sharing.json: per rate, host tier and variant, SLO attainment,
goodput, TTFT P50/P90, prefill tokens saved, blocks shared and the bytes moved to and from host.
`make bench` runs it (benchmarks/run.py) and skips it without the trace.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys

from ampd.perf import load_profile
from ampd.policy import SLO
from ampd.sim import SimConfig, sim_report, simulate
from ampd.workload.mooncake import import_mooncake
from benchmarks import write_json

PROFILE = "qwen3-32b@h20"
PREFILL, DECODE = "tp2*4", "tp2*4"
TTFT_SLO, ITL_SLO = 10.0, 0.1
WINDOW_S = 3600.0  # the whole trace (12,031 requests over ~59 min; ~3 s of simulation for all four runs)
RATES = (0.5, 1.0)  # requests/s after compressing the window's arrivals
HOST_RATIOS = (SimConfig.kv_host_ratio, 0.0)  # the default host KV tier, then off
TRACE_URL = "https://github.com/kvcache-ai/Mooncake/blob/main/FAST25-release/traces/conversation_trace.jsonl"


def window(path: str, window_s: float, rate: float) -> list:
    sessions = [s for s in import_mooncake(path) if s.arrival < window_s]
    k = len(sessions) / window_s / rate  # time scale giving `rate` requests/s
    return [dataclasses.replace(s, arrival=s.arrival * k) for s in sessions]


def one(sessions, prof, on: bool, host_ratio: float) -> dict:
    res = simulate(sessions, prof, policy="ampd", prefill=PREFILL, decode=DECODE, ttft_slo_s=TTFT_SLO,
                   itl_slo_s=ITL_SLO, seed=3, prefix_sharing=on, kv_host_ratio=host_ratio)
    rep = sim_report(res, SLO(TTFT_SLO, ITL_SLO))
    st = res.stats
    prefill_tokens = sum(int(s.rounds[0].input) for s in sessions)
    saved = st.get("prefix_shared_tokens", 0)
    tier = st.get("kv_tier", {})  # (absent with the tier off: nothing moves)
    return {"sessions": rep["sessions"], "completed": rep["completed"], "slo_attainment": rep["slo_attainment"],
            "goodput_rps": rep["goodput_rps"], "ttft_p50_s": rep["ttft_s"]["p50"], "ttft_p90_s": rep["ttft_s"]["p90"],
            "prefill_tokens": prefill_tokens - saved, "prefill_tokens_saved": saved,
            "saved_fraction": saved / prefill_tokens if prefill_tokens else 0.0,
            "blocks_shared": st.get("prefix_shared_blocks", 0),
            "sessions_sharing": st.get("prefix_sharing_sessions", 0),
            "local_prefills": st["local_prefills"], "remote_prefills": st["remote_prefills"],
            "bytes_to_host": tier.get("bytes_to_host", 0), "bytes_from_host": tier.get("bytes_from_host", 0),
            "kv_used_end": st["kv_used_end"], "wall_s": round(st["wall_s"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mooncake", default=os.environ.get("AMPD_MOONCAKE_CONVERSATION", ""),
                    help="Mooncake conversation_trace.jsonl")
    ap.add_argument("--window", type=float, default=WINDOW_S)
    ap.add_argument("--out", default="benchmarks/results/prefix_sharing.json")
    args = ap.parse_args()
    if not args.mooncake or not os.path.exists(args.mooncake):
        print("prefix_sharing: no trace (--mooncake or AMPD_MOONCAKE_CONVERSATION); skipped", file=sys.stderr)
        return
    prof = load_profile(PROFILE)
    runs = []
    for rate in RATES:
        sessions = window(args.mooncake, args.window, rate)
        for host in HOST_RATIOS:
            for on in (False, True):
                r = {"rate_rps": rate, "kv_host_ratio": host, "prefix_sharing": on, **one(sessions, prof, on, host)}
                runs.append(r)
                print(f"rate {rate:g}/s host {host:g} sharing {'on ' if on else 'off'}: attainment "
                      f"{r['slo_attainment']:.3f} goodput {r['goodput_rps']:.3f}/s TTFT p50 {r['ttft_p50_s']:.2f} "
                      f"p90 {r['ttft_p90_s']:.2f} s saved {r['prefill_tokens_saved']} tokens "
                      f"({r['saved_fraction']:.1%}), {r['bytes_to_host']} B to host", file=sys.stderr)
    write_json(args.out, {
        "command": shlex.join(["python", "-m", "benchmarks.prefix_sharing", *sys.argv[1:]]),
        "trace": "Mooncake FAST25-release/traces/conversation_trace.jsonl (ampd.workload.mooncake.import_mooncake)",
        "trace_url": TRACE_URL,
        "window_s": args.window, "profile": PROFILE, "policy": "ampd", "prefill": PREFILL, "decode": DECODE,
        "slo": {"ttft_s": TTFT_SLO, "itl_s": ITL_SLO}, "block_tokens": 512,
        "note": "simulator (ampd/sim/prefixing.py): blocks held by live sessions, or released and still cached "
                "in the worker's free KV, are shared; TTFT percentiles over first rounds. Other settings at their "
                "defaults; kv_host_ratio 1 is today's default host KV tier, 0 turns it off. Every session is one "
                "round with no tool call, so the tier moves no KV (bytes_to_host/bytes_from_host 0); with it the "
                "decode core charges each round's whole output at admission, and released blocks stay cached in "
                "the room of output not made yet until it is made (as the live pool reclaims them)",
        "runs": runs})


if __name__ == "__main__":
    main()
