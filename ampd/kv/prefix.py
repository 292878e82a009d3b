"""Prefix sharing on one decode worker: ``ampd.policy.prefixindex`` (pure accounting, so the
simulator and the coordinator can use it without the KV transport), under its KV-side name."""
from __future__ import annotations

from ampd.policy.prefixindex import BlockSource, CopyOp, Grant, PrefixIndex, block_hashes

__all__ = ["block_hashes", "BlockSource", "PrefixIndex", "Grant", "CopyOp"]
