"""Coordinator core: request validation; binding and routing over the cluster view (ampd.state.cluster)."""
from __future__ import annotations

from ampd.state.cluster import Cluster, ClusterView, choose_decode_worker, route
from ampd.v1 import common_pb2

__all__ = ["Cluster", "ClusterView", "InvalidArgument", "choose_decode_worker", "route", "validate_open"]

MAX_SESSION_ID = 256


class InvalidArgument(ValueError):
    """A bad request field; the message starts with the field's path."""


def validate_open(o: common_pb2.OpenSession) -> None:
    """Checks an OpenSession; raises InvalidArgument naming the first bad field."""
    if not o.session_id:
        raise InvalidArgument("open.session_id: required")
    if len(o.session_id) > MAX_SESSION_ID:
        raise InvalidArgument(f"open.session_id: longer than {MAX_SESSION_ID} characters")
    if not o.rounds:
        raise InvalidArgument("open.rounds: at least one round is required")
    for i, r in enumerate(o.rounds):
        path = f"open.rounds[{i}]"
        if not r.HasField("input_tokens"):
            raise InvalidArgument(f"{path}.input_tokens: required")
        if r.input_tokens < 1:
            raise InvalidArgument(f"{path}.input_tokens: must be >= 1, got {r.input_tokens}")
        if not r.HasField("output_tokens"):
            raise InvalidArgument(f"{path}.output_tokens: required")
        if r.output_tokens < 1:
            raise InvalidArgument(f"{path}.output_tokens: must be >= 1, got {r.output_tokens}")
        if r.HasField("tool") and r.tool.latency_s < 0:
            raise InvalidArgument(f"{path}.tool.latency_s: must be >= 0, got {r.tool.latency_s}")
    if o.limits.max_rounds < 0:
        raise InvalidArgument(f"open.limits.max_rounds: must be >= 0, got {o.limits.max_rounds}")
    if o.limits.max_output_tokens < 0:
        raise InvalidArgument(
            f"open.limits.max_output_tokens: must be >= 0, got {o.limits.max_output_tokens}")
