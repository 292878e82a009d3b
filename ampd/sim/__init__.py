"""Discrete-event simulator of a whole AMPD deployment: the worker cores (``ampd.worker``) and the
policy cores (``ampd.policy``) driven on a virtual clock, timed by the performance model.
See docs/simulator.md.

Modules: ``config`` (what to simulate), ``loop`` (the event loop and its handlers), ``steplog``
(token times as runs of decode steps, ITL samples), ``result`` (what a run produced), ``records``
(the report), ``spec`` (deployment SPEC strings), ``cli`` (``ampd simulate``).
"""
from .config import PathLatency, SimConfig
from .gcpause import gc_paused
from .loop import Simulator, simulate
from .records import sim_report, to_session_records
from .result import SimResult, SimRound, SimSession
from ampd.deployment import SpecError, expand_spec, format_spec, parse_spec

__all__ = ["PathLatency", "SimConfig", "SimResult", "SimRound", "SimSession", "Simulator", "simulate", "sim_report",
           "to_session_records", "gc_paused", "SpecError", "parse_spec", "format_spec", "expand_spec"]
