"""Workloads: the session trace format, Table 1 presets, Mooncake import and trace statistics.

Pure apart from reading and writing trace files. See docs/workload.md.
"""
from .ids import filler_ids
from .mooncake import import_mooncake
from .presets import PRESETS, Preset, generate
from .stats import format_stats, trace_stats
from .trace import Round, Session, TraceError, dump_trace, load_trace

__all__ = [
    "Round", "Session", "filler_ids", "TraceError", "load_trace", "dump_trace",
    "PRESETS", "Preset", "generate", "import_mooncake", "trace_stats", "format_stats",
]
