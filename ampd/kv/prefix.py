"""Prefix sharing on one decode worker: ``ampd.policy.prefixindex`` (pure accounting, so the
simulator and the coordinator can use it without the KV transport), under its KV-side name."""
from __future__ import annotations

from ampd.policy.prefixindex import BlockSource, CopyOp, Grant, PrefixIndex, Shared, block_hashes, prefix_hashes

__all__ = ["block_hashes", "prefix_hashes", "BlockSource", "PrefixIndex", "Shared", "Grant", "CopyOp"]
