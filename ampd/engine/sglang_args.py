"""What the sglang engine asks of SGLang: its launch arguments and each request's fields. Pure, and
importable without SGLang, so unit tests check the mapping anywhere.

Every worker runs its instance in SGLang's ordinary mode (no PD disaggregation: it needs CUDA, and
a prefill instance would recompute the history anyway; docs/engines.md "sglang"). A local
prefill is the round's request on the decode worker's instance, whose radix cache holds the
history. KV moves between instances through SGLang's unified cache external linker, AMPD's
`ampd.engine.sglang_linker` (pages over NIXL), when `linker` is set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ampd.engine.base import RoundStops, Sampling

__all__ = ["EXTRA", "EngineUnavailable", "SGLangOptions", "server_args", "sampling_params",
           "require_sglang", "seed_at", "launch_env", "SGLANG_VERSION", "INSTALL_HINT"]

EXTRA = "sglang"  # pip install '.[sglang]'
SGLANG_VERSION = "0.5.23"  # the release pyproject's extra pins; its API is what this module maps to
INSTALL_HINT = ("on a CPU-only machine: make test-sglang-env (tests/sglang/setup.sh builds .venv-sglang; run "
                "AMPD from there); on a GPU machine: pip install '.[sglang]'")


class EngineUnavailable(RuntimeError):
    """The engine's software is not installed; the message says what to install."""


def require_sglang() -> Any:
    """The `sglang` module, or EngineUnavailable naming the extra to install."""
    try:
        import sglang
    except ImportError as exc:
        missing = exc.msg
    else:
        if getattr(sglang, "__file__", None) is not None:
            return sglang
        # a directory named sglang on the path (a namespace package), not SGLang
        missing = f"'sglang' is only the directory {list(sglang.__path__)[0]}"
    raise EngineUnavailable(
        f"engine sglang needs SGLang {SGLANG_VERSION}, which is not installed here ({missing}); "
        f"install it: {INSTALL_HINT} (docs/engines.md)")


@dataclass(frozen=True)
class SGLangOptions:
    """One worker's SGLang instance."""

    model_path: str
    tp: int = 1
    device: str = "cpu"  # "cuda" on a GPU machine
    page_size: int = 16  # tokens per KV page; the linker moves whole pages (a partial last page is recomputed)
    # KV slots of the instance. Fixed rather than a fraction of memory: on the CPU SGLang would size
    # the pool by the machine's RAM, which several instances share.
    max_total_tokens: int = 16384
    mem_fraction_static: float = 0.85  # of the GPU's memory (SGLang's own meaning; unused on the CPU)
    dtype: str = "auto"  # "float32" on the CPU (what the torch engine computes in)
    seed: int = 0
    # OpenMP threads of the instance's forward on the CPU. 1: on this project's shared 2-core box a
    # decode step of SmolLM2 took 1.12 s with 2 threads and 0.16 s with 1 (one run each, load ~8):
    # OpenMP's 2 threads wait on each other when other processes hold the cores.
    cpu_threads: int = 1
    linker: str = ""  # JSON of the unified cache linker's config (ampd.engine.sglang_linker); empty: none

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model: the sglang engine needs a model path or hub id")
        if self.tp < 1:
            raise ValueError(f"tp: must be >= 1, got {self.tp}")
        if self.page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {self.page_size}")
        if self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens: must be >= page_size, got {self.max_total_tokens}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static: must be in (0, 1), got {self.mem_fraction_static}")
        if self.cpu_threads < 1:
            raise ValueError(f"cpu_threads: must be >= 1, got {self.cpu_threads}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: cpu or cuda, got {self.device!r}")


def server_args(o: SGLangOptions) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine(...)` (the names of SGLang's ServerArgs)."""
    args: dict[str, Any] = {
        "model_path": o.model_path,
        "tp_size": o.tp,
        "device": o.device,
        "page_size": o.page_size,
        "max_total_tokens": o.max_total_tokens,
        "dtype": o.dtype,
        "random_seed": o.seed,
        # AMPD sends token ids and reads token ids: SGLang's tokenizer and detokenizer stay idle
        "skip_tokenizer_init": True,
        # one request per round, one new token per streamed chunk (not the whole output so far)
        "incremental_streaming_output": True,
        # ordinary mode: either worker may prefill any round of any session (see the module doc)
        "disaggregation_mode": "null",
        "log_level": "error",
    }
    if o.device == "cpu":
        # torch_native: the default CPU backend (intel_amx, where the CPU has AMX) calls sgl_kernel's
        # CPU ops, which PyPI does not ship; CUDA graphs do not exist on the CPU
        args |= {"attention_backend": "torch_native", "disable_cuda_graph": True}
    else:
        args["mem_fraction_static"] = o.mem_fraction_static
    if o.linker:
        args |= {"enable_unified_cache_external_linker": True,
                 "unified_cache_external_linker_backend": "dynamic",
                 "unified_cache_external_linker_config": json.loads(o.linker)}
    return args


def launch_env(o: SGLangOptions) -> dict[str, str]:
    """Environment the instance's processes must inherit (set before `sglang.Engine` starts them)."""
    if o.device != "cpu":
        return {}
    # is_cpu() reads SGLANG_USE_CPU_ENGINE when SGLang is imported: without it SGLang takes CUDA-only paths
    return {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": str(o.cpu_threads)}


def seed_at(seed: int, position: int) -> int:
    """The seed of the request that samples from `position` on: a function of (seed, position)
    only, so a round's draws do not depend on which worker or request made its first token."""
    return ((seed & ((1 << 64) - 1)) * 0x9E3779B97F4A7C15 + position) & ((1 << 63) - 1)


def sampling_params(s: Sampling | None, max_new_tokens: int = 1, position: int = 0,
                    stops: RoundStops | None = None) -> dict[str, Any]:
    """SGLang sampling parameters for one request that samples from `position` on. The round's
    stops go to SGLang (`stops`); without, SGLang never stops on its own (`ignore_eos`) and the
    worker decides. SGLang's `ignore_eos` also disables `stop_token_ids`, so a round with stop ids
    sends them with `ignore_eos` off (SGLang then also stops at the model's eos, which the engine's
    `eos_token_ids` hold)."""
    p: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    if stops is not None and not stops.ignore_eos:
        p["ignore_eos"] = False
        p["stop_token_ids"] = list(stops.stop_token_ids)
    if s is None or s.greedy:
        p["temperature"] = 0.0
        return p
    p["temperature"] = s.temperature
    p["top_p"] = s.top_p
    if s.seed is not None:
        p["sampling_seed"] = seed_at(s.seed, position)
    return p
