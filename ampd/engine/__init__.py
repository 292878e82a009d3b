"""Engines: the Engine protocol (ampd.engine.base) and its backends."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ampd.engine.base import Engine
    from ampd.perf import Profile

ENGINES = ("mock", "torch")


def make_engine(name: str, profile: "Profile", tp: int, model: str = "") -> "Engine":
    """The engine a worker runs. torch loads lazily: a mock deployment never imports it."""
    if name == "mock":
        from ampd.engine.mock import MockEngine

        return MockEngine(profile, tp)
    if name == "torch":
        from ampd.engine.torch_engine import TorchEngine
        from ampd.engine.torch_models import DEFAULT_MODEL

        return TorchEngine.from_pretrained(model or DEFAULT_MODEL, tp=tp)
    raise ValueError(f"engine {name!r} is not available (available: {', '.join(ENGINES)})")
