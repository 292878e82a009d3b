"""Engines: the Engine protocol (ampd.engine.base) and its backends."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ampd.engine.base import Engine
    from ampd.perf import Profile

ENGINES = ("mock", "torch", "sglang")


def check_available(name: str) -> None:
    """Raises ValueError (a message for a person) when engine ``name``'s software is missing, before a
    deployment or a worker starts: the sglang engine needs the ``sglang`` extra."""
    if name == "sglang":
        from ampd.engine.sglang_args import EngineUnavailable, require_sglang

        try:
            require_sglang()
        except EngineUnavailable as exc:
            raise ValueError(f"--engine: {exc}") from None


def make_engine(name: str, profile: "Profile", tp: int, model: str = "") -> "Engine":
    """The engine a worker runs. torch and sglang load lazily: a mock deployment imports neither."""
    if name == "mock":
        from ampd.engine.mock import MockEngine

        return MockEngine(profile, tp)
    if name == "torch":
        from ampd.engine.torch_engine import TorchEngine
        from ampd.engine.torch_models import DEFAULT_MODEL

        return TorchEngine.from_pretrained(model or DEFAULT_MODEL, tp=tp)
    if name == "sglang":
        from ampd.engine.sglang_args import SGLangOptions
        from ampd.engine.sglang_engine import SGLangEngine
        from ampd.engine.torch_models import DEFAULT_MODEL, resolve_model

        # the default model is the converted SmolLM2 folder; any other name goes to SGLang as is
        path = str(resolve_model(DEFAULT_MODEL)) if model in ("", DEFAULT_MODEL) else model
        return SGLangEngine.launch(SGLangOptions(model_path=path, tp=tp))
    raise ValueError(f"engine {name!r} is not available (available: {', '.join(ENGINES)})")
