"""The sglang engine without SGLang (it needs a GPU): the arguments it gives SGLang, the error
without the extra, and how it drives a runtime with SGLang's `async_generate` signature (a
recording stand-in here; SGLang itself never ran on this project's machines)."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ampd.engine import check_available
from ampd.engine.base import DecodeSeq, Sampling
from ampd.engine.sglang_args import (SGLANG_VERSION, EngineUnavailable, SGLangOptions, require_sglang,
                                     sampling_params, seed_at, server_args, storage_env)
from ampd.engine.sglang_engine import SGLangEngine

ROOT = Path(__file__).resolve().parents[2]
needs_no_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is not None,
                                     reason="sglang is installed here")


def test_server_args_map_the_choice_hicache_storage_on_nixl():
    a = server_args(SGLangOptions(model_path="/m", tp=2, page_size=32, nixl_plugin="POSIX"))
    assert a["model_path"] == "/m" and a["tp_size"] == 2 and a["page_size"] == 32
    assert a["disaggregation_mode"] == "null"  # either worker may prefill any round
    assert a["enable_hierarchical_cache"] and a["hicache_storage_backend"] == "nixl"
    assert a["hicache_write_policy"] == "write_through"
    assert a["hicache_storage_prefetch_policy"] == "wait_complete"
    assert a["skip_tokenizer_init"]  # ids in, ids out
    assert json.loads(a["hicache_storage_backend_extra_config"]) == {"plugin": "POSIX"}
    assert "hicache_storage_backend_extra_config" not in server_args(SGLangOptions(model_path="/m"))
    assert storage_env(SGLangOptions(model_path="/m", storage_dir="/shared/kv")) == \
        {"SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR": "/shared/kv"}
    assert storage_env(SGLangOptions(model_path="/m")) == {}


@pytest.mark.parametrize("field,kw", [("model", {"model_path": ""}), ("tp", {"tp": 0}),
                                      ("page_size", {"page_size": 0}),
                                      ("mem_fraction_static", {"mem_fraction_static": 1.0})])
def test_bad_options_name_the_field(field, kw):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SGLangOptions(**{"model_path": "/m", **kw})


def test_sampling_params():
    assert sampling_params(None) == {"max_new_tokens": 1, "ignore_eos": True, "temperature": 0.0}
    p = sampling_params(Sampling(0.7, 0.9, 5), 3, position=40)
    assert p == {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0.7, "top_p": 0.9,
                 "sampling_seed": seed_at(5, 40)}
    # one request per token: each position gets its own seed, a function of (seed, position) only
    assert len({seed_at(5, k) for k in range(100)}) == 100 and seed_at(5, 7) != seed_at(6, 7)
    assert 0 <= seed_at(-1, 3) < 1 << 63
    assert "sampling_seed" not in sampling_params(Sampling(0.7))


def test_the_extra_is_pinned_to_the_mapped_release():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["sglang"] == [f"sglang=={SGLANG_VERSION}"]


@needs_no_sglang
def test_without_sglang_the_error_names_the_extra():
    with pytest.raises(EngineUnavailable, match=r"pip install '\.\[sglang\]'"):
        require_sglang()
    with pytest.raises(ValueError, match=r"^--engine: engine sglang needs SGLang"):
        check_available("sglang")
    check_available("torch")  # nothing to check
    r = subprocess.run([sys.executable, "-m", "ampd", "up", "--engine", "sglang"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "pip install '.[sglang]'" in r.stderr and "Traceback" not in r.stderr


class FakeRuntime:
    """SGLang's `async_generate` signature; the next token is a function of the whole context, so a
    wrong context gives a wrong token."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], dict]] = []

    async def async_generate(self, *, input_ids, sampling_params, rid):
        self.calls.append((list(input_ids), sampling_params))
        return {"output_ids": [sum(i * (k + 1) for k, i in enumerate(input_ids)) % 97]}


def _engine() -> tuple[SGLangEngine, FakeRuntime]:
    rt = FakeRuntime()
    return SGLangEngine(rt, tp=1, vocab_size=100, max_context=64, eos_token_ids=(2,), kv_bytes_per_token=8), rt


def _want(ids):
    return sum(i * (k + 1) for k, i in enumerate(ids)) % 97


def test_rounds_resend_the_whole_context_and_batch_one_request_per_sequence():
    eng, rt = _engine()

    async def run():
        t0 = await eng.prefill("a", 0, 3, None, [], token_ids=[5, 6, 7])
        t1 = await eng.prefill("b", 0, 2, None, [], token_ids=[8, 9])
        a, b = [5, 6, 7, t0], [8, 9, t1]
        # the worker passes its token lists; the engine reads them up to each position
        step = await eng.decode_step(None, [DecodeSeq("a", 3, t0, [], 4, token_ids=a),
                                            DecodeSeq("b", 2, t1, [], 3, token_ids=b)])
        assert step == [_want(a), _want(b)]
        a.append(step[0])
        # a local prefill on the decode worker: history from the worker's list (history_ids)
        t2 = await eng.prefill("a", 5, 2, None, [], token_ids=[11, 12], history_ids=a)
        assert t2 == _want(a + [11, 12])
        # a prefill worker that gets no ids for a session it never saw cannot guess them
        with pytest.raises(ValueError, match="knows 0 of its 4 history tokens"):
            await eng.prefill("c", 4, 1, None, [], token_ids=[1])
        with pytest.raises(ValueError, match=r"token_ids\[1\] = 100 is outside the vocabulary"):
            await eng.prefill("d", 0, 2, None, [], token_ids=[1, 100])
        return t0, t1

    t0, t1 = asyncio.run(run())
    assert (t0, t1) == (_want([5, 6, 7]), _want([8, 9]))
    assert [c[0] for c in rt.calls[:2]] == [[5, 6, 7], [8, 9]]
    assert all(c[1]["max_new_tokens"] == 1 for c in rt.calls)
    eng.forget("a")
    assert "a" not in eng._ids
