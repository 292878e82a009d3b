"""The SLO a deployment is judged by (docs/report.md "The rule"): one type for the policies, the
simulator and the reports. Pure; its own module so that the policy cores and the report module both
import it without importing each other."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SLO"]


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-round TTFT threshold and per-session mean-ITL threshold, in seconds."""

    ttft_s: float
    itl_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"SLO {name} must be a finite number > 0 seconds, got {v!r}")
