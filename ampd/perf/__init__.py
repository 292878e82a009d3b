"""Performance model: piecewise alpha-beta cost functions per model, hardware and TP degree.

See docs/perf-model.md. Pure: no I/O apart from reading profile files.
"""

from .piecewise import Piecewise, interpolate_piecewise
from .profile import (SCHEMA_VERSION, KVTransfer, Profile, TPModel, list_profiles, load_profile,
                      profile_from_dict)

__all__ = ["Profile", "TPModel", "KVTransfer", "Piecewise", "SCHEMA_VERSION", "load_profile",
           "list_profiles", "profile_from_dict", "interpolate_piecewise"]
