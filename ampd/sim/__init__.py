"""Discrete-event simulator of a whole AMPD deployment (virtual clock, same policy cores and
performance model as the live services). See docs/simulator.md."""
from .engine import PathLatency, SimConfig, SimResult, SimRound, SimSession, Simulator, simulate
from .records import sim_report, to_session_records
from .spec import SpecError, expand_spec, format_spec, parse_spec

__all__ = ["PathLatency", "SimConfig", "SimResult", "SimRound", "SimSession", "Simulator", "simulate", "sim_report",
           "to_session_records", "SpecError", "parse_spec", "format_spec", "expand_spec"]
