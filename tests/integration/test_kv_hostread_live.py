"""Remote prefill from the host copy on a live deployment (docs/kv.md "Remote prefill from the host
copy"): real coordinator, prefill worker, decode worker with its host KV tier (--kv-host-mb, every idle
session's KV moved: pressure threshold 0), sidecar and Redis on loopback, the mock engine, every
prefill routed to the prefill worker (policy remote).

Each session's rounds end in server-side tool calls long enough for the tier to move their KV to host,
so each next round starts with its KV on host. Its prefill task goes out at once, naming the host
copy (``PrefillTask.history_on_host``): the prefill worker reads the history from the decode worker's
host tier over NIXL, byte-checked, while the decode worker fetches it back to its device; the new KV is
written into the device pool. Checked: every such round was routed ``+kv-host`` and read from host
(its task sent before its fetch ended), the prefill worker read exactly those histories' tokens from
host and found no wrong byte, neither worker found a wrong byte, no prefill is overdue, every session
completes with every token right, and the device pools and the host pool are empty at the end."""
from __future__ import annotations

import pytest

from ampd.workload import Round, Session
from tests.integration.test_kv_route_live import KV_TOKENS, replay_on_host_tier

pytestmark = pytest.mark.timeout(120)

OUT = 6
SESSIONS = [Session(f"s{i}", 0.05 * i, (Round(input=300, output=OUT, tool_s=0.4),
                                        Round(input=100, output=OUT, tool_s=0.4), Round(input=50, output=OUT)))
            for i in range(4)]
# the history KV of the rounds after the tool calls: the rounds before, their inputs and outputs, but the
# last output token (its KV is computed by the next round's prefill)
HOST_HISTORY = len(SESSIONS) * ((300 + OUT - 1) + (300 + OUT + 100 + OUT - 1))


def test_rounds_on_host_are_prefilled_remotely_from_the_host_copy(redis_url, tmp_path):
    records, stats, coord, workers = replay_on_host_tier(redis_url, tmp_path, "remote", "kvhostread", SESSIONS)
    assert all(r.completed for r in records), [r.error for r in records]
    assert stats.token_mismatches == 0 and stats.tokens == len(SESSIONS) * 3 * OUT
    d, p = workers["decode-0"], workers["prefill-0"]
    routes = {k[len("route_"):]: v for k, v in coord.items() if k.startswith("route_") and v
              and not k.startswith("route_redis")}
    on_host = sum(v for k, v in routes.items() if k.endswith("+kv-host"))
    fetches = sum(v for k, v in d.items() if k.startswith("kv_tier_move_prefetch:"))
    failed = sum(v for k, v in d.items() if k.startswith("kv_tier_failed_"))
    print(f"routes {routes}; fetches {fetches:.0f}, failed {failed:.0f}, host reads {d['kv_tier_host_reads']:.0f} "
          f"(ahead of their fetch {d['kv_tier_host_read_ahead']:.0f}), host tokens read "
          f"{p['history_tokens_read_host']:.0f}, bytes verified decode {d['kv_bytes_verified']:.0f} "
          f"prefill {p['kv_bytes_verified']:.0f}")
    # the rounds after the tool calls (2 a session) had their KV on host, were routed saying so, and
    # were prefilled from the host copy: their tasks went out before their fetches back had ended
    assert fetches == 2 * len(SESSIONS) and failed == 0
    assert on_host == fetches and d["kv_tier_host_reads"] == fetches, routes
    assert d["kv_tier_host_read_ahead"] == fetches
    assert p["history_tokens_read_host"] == HOST_HISTORY
    assert d["prefills_remote"] == 3 * len(SESSIONS) and p["tasks_done"] == 3 * len(SESSIONS)
    # every byte checked: the history the prefill worker read from host, the new KV it wrote
    assert p["kv_bytes_verified"] > 0 and p["kv_bytes_mismatched"] == 0
    assert d["kv_bytes_verified"] > 0 and d["kv_bytes_mismatched"] == 0
    assert d["prefills_overdue"] == 0 and d["prefills_rerouted"] == 0 and d["sessions_failed"] == 0
    # no leak: the device pools and the host pool are empty, no session left
    assert d["kv_free_tokens"] == d["kv_capacity_tokens"] == KV_TOKENS and d["active_sessions"] == 0
    assert d["kv_tier_host_used_blocks"] == 0 and d["kv_tier_host_copies"] == 0
    assert p["kv_free_tokens"] == p["kv_capacity_tokens"]
