"""Redis schema: worker registry, per-worker statistics and queues, sessions."""
from ampd.state.store import StateStore, WorkerInfo, WorkerStats, connect

__all__ = ["StateStore", "WorkerInfo", "WorkerStats", "connect"]
