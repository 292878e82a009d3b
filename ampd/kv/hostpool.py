"""The host-memory KV tier's accounting with the KV transport's segments: ``HostPool`` is
``ampd.policy.hostpool.HostBlocks`` (the pure accounting, which the decode core's tier and the
simulator use; its docstring gives the state machine) whose ``segments`` are ``Segment``s."""
from __future__ import annotations

from ampd.policy.hostpool import (MIB, OFFLOADING, PREFETCHING, HostBlocks, HostKVExhausted, HostPoolTooSmall,
                                  KVState, check_host_pool, host_pool_blocks)

from .pool import Segment

__all__ = ["KVState", "HostPool", "HostBlocks", "HostPoolTooSmall", "HostKVExhausted", "MIB", "host_pool_blocks",
           "check_host_pool", "OFFLOADING", "PREFETCHING"]


class HostPool(HostBlocks):
    """``HostBlocks`` whose ``segments`` are the KV transport's ``Segment``s."""

    def segment(self, block: int, offset: int, tokens: int) -> Segment:
        return Segment(block, offset, tokens)
