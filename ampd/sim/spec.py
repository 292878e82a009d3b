"""Moved to ampd.deployment (SPECs are the library's deployment layer, not the simulator's); kept
as an alias so that code written against ampd.sim.spec keeps importing."""
from ampd.deployment import SpecError, expand_spec, format_spec, parse_spec

__all__ = ["SpecError", "parse_spec", "format_spec", "expand_spec"]
