"""Coordinator core: request validation (ampd.validate); binding and routing over the cluster view
(ampd.state.cluster); what a turn may add to a session's KV (admission)."""
from __future__ import annotations

from ampd.policy.outlen import rounds_kv_tokens
from ampd.state.cluster import Cluster, ClusterView, choose_decode_worker, route
from ampd.v1 import common_pb2
from ampd.validate import InvalidArgument, validate_open, validate_turn

__all__ = ["Cluster", "ClusterView", "InvalidArgument", "choose_decode_worker", "route", "validate_open",
           "validate_turn", "turn_kv_tokens"]


def turn_kv_tokens(t: common_pb2.Turn, max_output: int = 0, out_mean: float | None = None) -> int:
    """The most KV tokens a turn can add to its session: its input, every round's output at its
    max_tokens (capped by the session's ``max_output``, 0 = no cap) and every scripted server-side
    call's result. A session holds its KV for its whole life, so the sum over its turns bounds it;
    a turn whose calls are parsed from the output (not scripted) counts its first round only.

    With ``out_mean`` (the windowed mean output): the KV it is expected to add, each round's output at
    ``expected_output`` of its bound (both: ``ampd.policy.outlen.rounds_kv_tokens``), the turn's
    ``expected_output_tokens`` hint raising every round's (a turn's hints cover each of its rounds,
    the scripted ones too, as the decode worker reads them)."""
    def bound(p: common_pb2.SamplingParams) -> int:
        return min(p.max_tokens, max_output) if max_output else p.max_tokens

    rounds = [(len(t.token_ids), bound(t.sampling))]  # (input, output bound): a call's result is the next's input
    rounds += [(c.result_tokens, bound(c.sampling)) for c in t.script if not c.tool.client_side]
    hint = t.hints.expected_output_tokens if t.hints.HasField("expected_output_tokens") else None
    return rounds_kv_tokens(rounds, hint, out_mean)
