"""Coordinator core: request validation (ampd.sessionapi); binding and routing over the cluster view
(ampd.state.cluster)."""
from __future__ import annotations

from ampd.sessionapi import InvalidArgument, validate_open, validate_turn
from ampd.state.cluster import Cluster, ClusterView, choose_decode_worker, route

__all__ = ["Cluster", "ClusterView", "InvalidArgument", "choose_decode_worker", "route", "validate_open",
           "validate_turn"]
