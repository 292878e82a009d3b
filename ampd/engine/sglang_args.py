"""What the sglang engine asks of SGLang: its launch arguments and each request's fields. Pure, and
importable without SGLang, so unit tests check the mapping on a machine without a GPU.

The choice (docs/engines.md, "sglang"): KV moves between SGLang instances through HiCache's storage
tier on NIXL (`--hicache-storage-backend nixl`), not through SGLang's PD transfer. Every worker runs
its instance in SGLang's ordinary mode (`disaggregation_mode="null"`), with the radix cache, the
host-memory tier and the NIXL storage tier written through, over one storage location the whole
deployment shares. A round prefilled on a prefill worker reads the session's history pages from
storage (the decode worker wrote them) and writes its new pages back; the decode worker's next
request finds them by prefix and loads them (`wait_complete`: the request waits for the load
rather than recomputing). A local prefill is an ordinary request on the decode worker's instance,
whose radix cache already holds the history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ampd.engine.base import Sampling

__all__ = ["EXTRA", "EngineUnavailable", "SGLangOptions", "server_args", "storage_env", "sampling_params",
           "require_sglang", "seed_at", "SGLANG_VERSION"]

EXTRA = "sglang"  # pip install '.[sglang]'
SGLANG_VERSION = "0.5.23"  # the release pyproject's extra pins; its API is what this module maps to
STORAGE_DIR_ENV = "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"


class EngineUnavailable(RuntimeError):
    """The engine's software is not installed; the message says what to install."""


def require_sglang() -> Any:
    """The `sglang` module, or EngineUnavailable naming the extra to install."""
    try:
        import sglang
    except ImportError as exc:
        raise EngineUnavailable(
            f"engine sglang needs SGLang, which is not installed ({exc.msg}): pip install '.[{EXTRA}]' "
            "(a GPU machine with CUDA; docs/engines.md)") from None
    return sglang


@dataclass(frozen=True)
class SGLangOptions:
    """One worker's SGLang instance."""

    model_path: str
    tp: int = 1
    page_size: int = 16  # tokens per KV page; HiCache moves whole pages (a partial last page is recomputed)
    storage_dir: str = ""  # the HiCache NIXL storage location every worker of the deployment shares
    nixl_plugin: str = ""  # NIXL storage plugin (POSIX, GDS, OBJ, ...); empty: SGLang's choice
    mem_fraction_static: float = 0.85
    dtype: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model: the sglang engine needs a model path or hub id")
        if self.tp < 1:
            raise ValueError(f"tp: must be >= 1, got {self.tp}")
        if self.page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {self.page_size}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static: must be in (0, 1), got {self.mem_fraction_static}")


def server_args(o: SGLangOptions) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine(...)` (the names of SGLang's ServerArgs)."""
    args: dict[str, Any] = {
        "model_path": o.model_path,
        "tp_size": o.tp,
        "page_size": o.page_size,
        "dtype": o.dtype,
        "mem_fraction_static": o.mem_fraction_static,
        "random_seed": o.seed,
        # AMPD sends token ids and reads token ids: SGLang's tokenizer and detokenizer stay idle
        "skip_tokenizer_init": True,
        # ordinary mode: either worker may prefill any round of any session (see the module doc)
        "disaggregation_mode": "null",
        # prefix reuse across rounds: radix cache (on by default) + host tier + NIXL storage tier
        "enable_hierarchical_cache": True,
        "hicache_write_policy": "write_through",
        "hicache_storage_backend": "nixl",
        "hicache_storage_prefetch_policy": "wait_complete",
        "log_level": "error",
    }
    if o.nixl_plugin:
        args["hicache_storage_backend_extra_config"] = json.dumps({"plugin": o.nixl_plugin})
    return args


def storage_env(o: SGLangOptions) -> dict[str, str]:
    """Environment the instance reads: where the NIXL storage tier keeps pages."""
    return {STORAGE_DIR_ENV: o.storage_dir} if o.storage_dir else {}


def seed_at(seed: int, position: int) -> int:
    """The seed of the one-token request for `position`: every token is its own request, so one
    seed for all of them would draw the same number at every step. As the torch engine's, the draw
    is then a function of (seed, position) only (ampd/engine/sampling.py)."""
    return ((seed & ((1 << 64) - 1)) * 0x9E3779B97F4A7C15 + position) & ((1 << 63) - 1)


def sampling_params(s: Sampling | None, max_new_tokens: int = 1, position: int = 0) -> dict[str, Any]:
    """SGLang sampling parameters for one engine call that samples the token at `position`. AMPD's
    worker decides where a round ends (stop tokens, strings, max_tokens), so SGLang never stops on
    its own (`ignore_eos`)."""
    p: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    if s is None or s.greedy:
        p["temperature"] = 0.0
        return p
    p["temperature"] = s.temperature
    p["top_p"] = s.top_p
    if s.seed is not None:
        p["sampling_seed"] = seed_at(s.seed, position)
    return p
