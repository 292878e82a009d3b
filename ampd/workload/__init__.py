"""Workloads: the session trace format, Table 1 presets, Mooncake import and trace statistics.

Pure apart from reading and writing trace files. See docs/workload.md. The presets, the Mooncake
import and the statistics load on first use (they bring numpy): reading a trace, as ``ampd plan``
does, stays a light import.
"""
from importlib import import_module

from .trace import Round, Session, TraceError, dump_trace, load_trace

__all__ = [
    "Round", "Session", "filler_ids", "TraceError", "load_trace", "dump_trace",
    "PRESETS", "Preset", "generate", "import_mooncake", "trace_stats", "format_stats",
]

_LAZY = {"filler_ids": ".ids", "import_mooncake": ".mooncake", "PRESETS": ".presets", "Preset": ".presets",
         "generate": ".presets", "trace_stats": ".stats", "format_stats": ".stats"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
