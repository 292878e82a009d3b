"""The sglang engine without SGLang's runtime: the arguments it gives SGLang, the error without
SGLang, and how it drives a runtime with SGLang's `async_generate` signature (a recording runtime
here; the real one runs in `make test-sglang`, tests/sglang/live.py)."""
from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ampd.engine import check_available
from ampd.engine.base import DecodeSeq, Sampling, round_stops
from ampd.engine.sglang_args import (SGLANG_VERSION, EngineUnavailable, SGLangOptions, require_sglang,
                                     sampling_params, seed_at, server_args)
from ampd.engine.sglang_engine import SGLangEngine

ROOT = Path(__file__).resolve().parents[2]
def _sglang_installed() -> bool:
    """SGLang's distribution, not a module spec: pytest puts tests/ on sys.path, where the directory
    tests/sglang is found as a namespace package named sglang."""
    try:
        importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_no_sglang = pytest.mark.skipif(_sglang_installed(), reason="sglang is installed here")


def test_server_args_cpu_and_linker():
    a = server_args(SGLangOptions(model_path="/m", tp=2, page_size=32, dtype="float32"))
    assert a["model_path"] == "/m" and a["tp_size"] == 2 and a["page_size"] == 32 and a["device"] == "cpu"
    assert a["disaggregation_mode"] == "null"  # either worker may prefill any round
    assert a["skip_tokenizer_init"] and a["incremental_streaming_output"]  # ids in, one new id per chunk
    assert a["attention_backend"] == "torch_native" and a["disable_cuda_graph"]
    assert "enable_unified_cache_external_linker" not in a
    g = server_args(SGLangOptions(model_path="/m", device="cuda", linker='{"linker": "X"}'))
    assert "attention_backend" not in g and g["mem_fraction_static"] == 0.85
    assert g["enable_unified_cache_external_linker"] and g["unified_cache_external_linker_config"] == {"linker": "X"}


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
    assert len({seed_at(5, k) for k in range(100)}) == 100 and seed_at(5, 7) != seed_at(6, 7)
    assert 0 <= seed_at(-1, 3) < 1 << 63
    assert "sampling_seed" not in sampling_params(Sampling(0.7))
    # a round's stops: SGLang's ignore_eos would also disable stop ids, so they go with it off
    stops = round_stops(9, [7], False, (2,))
    assert sampling_params(None, 9, 0, stops) == {"max_new_tokens": 9, "ignore_eos": False,
                                                   "stop_token_ids": [7, 2], "temperature": 0.0}
    assert sampling_params(None, 9, 0, round_stops(9, [], True, (2,)))["ignore_eos"] is True


def test_a_missing_model_is_named_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match=r"^--model: '.*nothing' is not a model folder \(no config.json there\)"):
        check_available("sglang", str(tmp_path / "nothing"))


def test_the_extra_is_pinned_to_the_mapped_release():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["sglang"] == [f"sglang=={SGLANG_VERSION}"]


@needs_no_sglang
def test_without_sglang_the_error_names_the_extra():
    with pytest.raises(EngineUnavailable, match=r"make test-sglang-env"):
        require_sglang()
    with pytest.raises(ValueError, match=r"^--engine: engine sglang needs SGLang"):
        check_available("sglang")
    check_available("torch")  # nothing to check
    r = subprocess.run([sys.executable, "-m", "ampd", "up", "--engine", "sglang"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "make test-sglang-env" in r.stderr and "Traceback" not in r.stderr


class RecordingRuntime:
    """SGLang's `async_generate` signature, streaming or not; each next token is a function of the
    whole context, so a wrong context gives a wrong token. A stream ends at max_new_tokens or a stop id."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], dict, bool]] = []
        self.aborted: list[str] = []
        self.tokenizer_manager = self

    def abort_request(self, rid):
        self.aborted.append(rid)

    async def async_generate(self, *, input_ids, sampling_params, rid, stream=False):
        self.calls.append((list(input_ids), sampling_params, stream))
        ctx = list(input_ids)

        async def gen():
            for _ in range(sampling_params["max_new_tokens"]):
                await asyncio.sleep(0.01)  # SGLang's step: a round can be stopped mid-way
                tok = _want(ctx)
                ctx.append(tok)
                yield {"output_ids": [tok], "meta_info": {"prompt_tokens": len(input_ids), "cached_tokens": 0}}
                if not sampling_params["ignore_eos"] and tok in sampling_params.get("stop_token_ids", ()):
                    return
        if stream:
            return gen()
        return {"output_ids": [_want(ctx)], "meta_info": {"prompt_tokens": len(ctx), "cached_tokens": 0}}


def _engine() -> tuple[SGLangEngine, RecordingRuntime]:
    rt = RecordingRuntime()
    return SGLangEngine(rt, tp=1, vocab_size=100, max_context=64, eos_token_ids=(2,), kv_bytes_per_token=8), rt


def _want(ids):
    return sum(i * (k + 1) for k, i in enumerate(ids)) % 97


def test_a_round_is_one_streaming_request_and_prefill_alone_one_token():
    eng, rt = _engine()

    async def run():
        stops = round_stops(4, [], True, eng.eos_token_ids)
        # a local prefill with the round's stops: the round's request; its first token comes back
        t0 = await eng.prefill("a", 0, 3, None, [], token_ids=[5, 6, 7], stops=stops)
        # a prefill worker's round: one token, no stream
        t1 = await eng.prefill("b", 0, 2, None, [], token_ids=[8, 9])
        a, b = [5, 6, 7, t0], [8, 9, t1]
        # the remote round continues on the decode instance as one request on the context + first token
        eng.open_round("b", b, None, stops)
        for _ in range(3):
            step = await eng.decode_step(None, [DecodeSeq("a", len(a) - 1, a[-1], [], len(a)),
                                                DecodeSeq("b", len(b) - 1, b[-1], [], len(b))])
            assert step == [_want(a), _want(b)]
            a.append(step[0])
            b.append(step[1])
        # the round's request ended at max_tokens: asking for more is the worker's error, named
        with pytest.raises(RuntimeError, match="ended the round before AMPD's stop"):
            await eng.decode_step(None, [DecodeSeq("a", len(a) - 1, a[-1], [], len(a))])
        # the next local round: history from the worker's list, one new request
        t2 = await eng.prefill("a", len(a), 2, None, [], token_ids=[11, 12], history_ids=a,
                               stops=round_stops(5, [], True, (2,)))
        assert t2 == _want(a + [11, 12])
        eng.end_round("a")  # the worker stopped first (a stop string): the request is aborted
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="knows 0 of its 4 history tokens"):
            await eng.prefill("c", 4, 1, None, [], token_ids=[1])
        with pytest.raises(ValueError, match=r"token_ids\[1\] = 100 is outside the vocabulary"):
            await eng.prefill("d", 0, 2, None, [], token_ids=[1, 100])
        return a, b

    a, b = asyncio.run(run())
    assert [(c[0], c[1]["max_new_tokens"], c[2]) for c in rt.calls[:3]] == [
        ([5, 6, 7], 4, True), ([8, 9], 1, False), (b[:3], 3, True)]
    assert len(rt.aborted) == 1 and rt.aborted[0].startswith("a#")
    eng.forget("a")
    assert "a" not in eng._ids


def test_the_profiler_times_decode_steps_in_rounds_a_streaming_prefill_opened():
    """`ampd profile --engine sglang`'s path without SGLang: the engine's decode_step only continues a
    round a streaming prefill opened, so the profiler opens `batch` rounds on each context, takes one
    step untimed and times the next ones; prefills send the history the engine prefilled first."""
    from ampd.profiler import STREAMED_STEPS, EngineSetup, _decode_series, _prefill_series
    from ampd.profiler.measure import time_points

    eng, rt = _engine()
    setup = EngineSetup(engine="sglang", model="m", hardware="cpu2", tps=(1,), make=lambda tp: eng,
                        kv_bytes_per_token=8, kv_capacity_tokens={1: 64}, pool_bytes_per_token=8)

    async def run():
        dec, end = await _decode_series(setup, eng, [(1, 8), (2, 12)], 2, 16)
        await time_points(dec, range(2), 2)
        end()
        # a run that found its tokens already made (the scheduler ran on while this process waited for
        # a core) reads too short: the median of the runs, not the fastest, is the point's time
        runs = dec.runs[0]
        dec.runs[0] = [0.0019, 0.08, 0.09]
        assert dec.time_of(0) == 0.08
        dec.runs[0] = runs
        pre = await _prefill_series(setup, eng, [(0, 4), (16, 4)], 2, 16)
        await time_points(pre, range(2), 2)
        return dec.samples()[0], pre.samples()[0]

    dec, pre = asyncio.run(run())
    # the timed steps read c + 2 ... c + 1 + STREAMED_STEPS tokens per sequence
    assert [(b, n) for b, n, _ in dec] == [(1, 8 + 3), (2, 2 * 13 + 5)]
    assert all(t >= 0.008 for *_, t in dec), dec  # the recording runtime's step is a 10 ms sleep
    streamed = [c for c in rt.calls if c[2]]
    # a warm-up pass, then 2 passes of each point: 1 + 2 * (1 + 2) rounds, each one streaming request
    assert len(streamed) == 7 and {c[1]["max_new_tokens"] for c in streamed} == {STREAMED_STEPS + 2}
    assert not eng._rounds  # every round ended
    assert [(lh, li) for lh, li, _ in pre] == [(0, 4), (16, 4)] and all(t > 0 for *_, t in pre)
    hist = next(c[0] for c in rt.calls if not c[2] and len(c[0]) == 16)  # the history, prefilled untimed
    timed = [c[0] for c in rt.calls if len(c[0]) == 20]  # 2 passes, on top of it, new ids each pass
    assert len(timed) == 2 and all(x[:16] == hist for x in timed) and timed[0][16:] != timed[1][16:]
