"""Coordinator core: request validation (ampd.validate); binding and routing over the cluster view
(ampd.state.cluster); what a turn may add to a session's KV (admission)."""
from __future__ import annotations

from ampd.state.cluster import Cluster, ClusterView, choose_decode_worker, route
from ampd.v1 import common_pb2
from ampd.validate import InvalidArgument, validate_open, validate_turn

__all__ = ["Cluster", "ClusterView", "InvalidArgument", "choose_decode_worker", "route", "validate_open",
           "validate_turn", "turn_kv_tokens"]


def turn_kv_tokens(t: common_pb2.Turn, max_output: int = 0) -> int:
    """The most KV tokens a turn can add to its session: its input, every round's output at its
    max_tokens (capped by the session's ``max_output``, 0 = no cap) and every scripted server-side
    call's result. A session holds its KV for its whole life, so the sum over its turns bounds it;
    a turn whose calls are parsed from the output (not scripted) counts its first round only."""
    def out(p: common_pb2.SamplingParams) -> int:
        return min(p.max_tokens, max_output) if max_output else p.max_tokens

    n = len(t.token_ids) + out(t.sampling)
    for c in t.script:
        if not c.tool.client_side:
            n += c.result_tokens + out(c.sampling)
    return n
