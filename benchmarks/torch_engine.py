"""The torch engine against plain transformers `generate`, and its KV through NIXL against memcpy.

    python -m benchmarks.torch_engine [--model smollm2-135m-instruct|tiny|FOLDER]
                                      [--prompt 128] [--new 64] [--batches 1,4,8]

Decode throughput, same model object, same prompts, one run: for each batch size B, B sessions
with distinct random prompts of `--prompt` tokens, `--new` greedy tokens each.
- engine: each session is prefilled (one at a time, as a worker does), then all decode together in
  one continuous batch through the async Engine protocol; tokens/s = B * new / wall time of it all.
- generate: `model.generate` on each prompt one after the other (what one transformers process
  serves without batching); tokens/s = B * new / the sum of the first B prompts' wall times (each
  prompt is generated once, the batches share them).
Both produce the same tokens (checked). Batching: a decode step of the largest batch as one padded
forward against one forward per sequence. KV transfer: one session's history in the engine's block
layout (16-token blocks, scattered), READ from one pool into another over NIXL (UCX, two agents in
this process), against numpy copying the same number of bytes in one piece. Writes
benchmarks/results/torch_engine.json with the command. Timings on a shared 2-core box are noisy:
compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ampd.engine.base import DecodeSeq  # noqa: E402
from ampd.engine.torch_engine import TorchEngine  # noqa: E402
from ampd.engine.torch_models import (  # noqa: E402
    DEFAULT_MODEL,
    load_model,
    resolve_model,
    save_tiny_llama,
)
from ampd.kv import KVPool, SessionKV  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "torch_engine.json"


def _load(name: str) -> tuple[object, dict]:
    t = time.perf_counter()
    if name == "tiny":
        path = save_tiny_llama(Path(tempfile.mkdtemp(prefix="ampd-tiny-")), vocab_size=32000,
                               hidden_size=256, layers=4, heads=4, kv_heads=2, init_std=0.02)
    else:
        path = resolve_model(name)
    prep_s = time.perf_counter() - t
    t = time.perf_counter()
    model = load_model(path)
    if name == "tiny":  # weights are in memory now; the folder was only for the real loading path
        shutil.rmtree(path, ignore_errors=True)
    info = {"model": name, "path": str(path), "prepare_s": round(prep_s, 2),
            "load_s": round(time.perf_counter() - t, 2),
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
    return model, info


def _generate(model, prompts: list[list[int]], new: int) -> tuple[list[float], list[list[int]]]:
    """`generate` on each prompt in turn: the wall time of each and its tokens."""
    times, outs = [], []
    for p in prompts:
        t = time.perf_counter()
        with torch.inference_mode():
            o = model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)
        times.append(time.perf_counter() - t)
        outs.append(o[0, len(p):].tolist())
    return times, outs


async def _engine(engine: TorchEngine, pool: KVPool, prompts: list[list[int]], new: int
                  ) -> tuple[float, list[list[int]], float]:
    """Prefill each session, then decode all in one batch; (wall s, tokens, decode-only s)."""
    kvs = [SessionKV() for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        dest = kvs[i].reserve(pool, len(p))
        outs[i].append(await engine.prefill(f"s{i}", 0, len(p), pool, dest, token_ids=p))
        kvs[i].commit(len(p))
    t_dec = time.perf_counter()
    for _ in range(new - 1):
        seqs = []
        for i, kv in enumerate(kvs):
            pos = kv.tokens
            seg = kv.reserve(pool, 1)
            seqs.append(DecodeSeq(f"s{i}", pos, outs[i][-1], seg, pos + 1, kv.segments(0, pos)))
        for i, tok in enumerate(await engine.decode_step(pool, seqs)):
            kvs[i].commit(1)
            outs[i].append(tok)
    end = time.perf_counter()
    for kv in kvs:
        kv.release(pool)
    return end - t, outs, end - t_dec


def _per_sequence_vs_batched(engine: TorchEngine, prompts: list[list[int]], steps: int) -> dict:
    """Decode step time of B sequences as one padded batch vs one forward per sequence."""
    pool = engine.make_pool(len(prompts) * (max(map(len, prompts)) + 2 * steps + 16), 16)
    kvs = [SessionKV() for _ in prompts]
    last = []
    for kv, p in zip(kvs, prompts):
        last.append(engine.prefill_sync(pool, p, [], kv.reserve(pool, len(p))))
        kv.commit(len(p))

    def step(group: list[int]) -> None:
        seqs = []
        for i in group:
            pos = kvs[i].tokens
            seg = kvs[i].reserve(pool, 1)
            seqs.append(DecodeSeq(f"s{i}", pos, last[i], seg, pos + 1, kvs[i].segments(0, pos)))
        for i, tok in zip(group, engine.decode_sync(pool, seqs)):
            kvs[i].commit(1)
            last[i] = tok

    every = list(range(len(prompts)))
    step(every)  # warm-up, untimed: first calls with new shapes are slower
    step(every[:1])
    t = time.perf_counter()
    for _ in range(steps):
        step(every)
    batched = (time.perf_counter() - t) / steps
    t = time.perf_counter()
    for _ in range(steps):
        for i in every:
            step([i])
    alone = (time.perf_counter() - t) / steps
    return {"batch": len(prompts), "steps": steps, "padded_batch_step_ms": round(batched * 1e3, 2),
            "per_sequence_step_ms": round(alone * 1e3, 2), "padded_speedup": round(alone / batched, 2)}


def bench_decode(model, args) -> tuple[list[dict], dict]:
    engine = TorchEngine(model)
    rng = np.random.default_rng(0)
    vocab = engine.vocab_size
    most = max(args.batches)
    prompts = [rng.integers(10, vocab, args.prompt).tolist() for _ in range(most)]
    pool = engine.make_pool(most * (args.prompt + args.new + 16), 16)
    # warm-up of both paths (first calls in a process are slower)
    asyncio.run(_engine(engine, pool, prompts[:1], 4))
    _generate(model, prompts[:1], 4)
    # sequential generate of the first B prompts takes the sum of their times: run each once
    gen_times, gen_outs = _generate(model, prompts, args.new)
    rows = []
    for b in args.batches:
        gen_s, gen_out = sum(gen_times[:b]), gen_outs[:b]
        eng_s, eng_out, dec_s = asyncio.run(_engine(engine, pool, prompts[:b], args.new))
        tokens = b * args.new
        row = {
            "batch": b,
            "tokens": tokens,
            "engine_s": round(eng_s, 3),
            "engine_decode_s": round(dec_s, 3),
            "engine_step_ms": round(dec_s / (args.new - 1) * 1e3, 2),
            "generate_sequential_s": round(gen_s, 3),
            "engine_tok_s": round(tokens / eng_s, 2),
            "generate_sequential_tok_s": round(tokens / gen_s, 2),
            "ratio": round(gen_s / eng_s, 3),
            "same_tokens": eng_out == gen_out,
        }
        print(json.dumps(row), file=sys.stderr)
        rows.append(row)
    return rows, _per_sequence_vs_batched(engine, prompts, 8)


async def _kv_transfer(engine: TorchEngine, tokens: int, reps: int) -> dict:
    from ampd.kv.transport import NixlTransport

    src = engine.make_pool(tokens + 64, 16)
    dst = engine.make_pool(tokens + 64, 16)
    for pool, seed in ((src, 1), (dst, 2)):  # scattered blocks, as a running worker has them
        blocks = pool.alloc(pool.free_blocks)
        random.Random(seed).shuffle(blocks)
        pool.free(blocks)
    hist, land = SessionKV(), SessionKV()
    seg_src = hist.reserve(src, tokens)
    src.buffer[:] = np.random.default_rng(0).integers(0, 256, src.nbytes, dtype=np.uint8)
    hist.commit(tokens)
    seg_dst = land.reserve(dst, tokens)
    a, b = NixlTransport("bench-torch-a", src), NixlTransport("bench-torch-b", dst)
    try:
        a.add_peer("bench-torch-b", b.metadata(), b.layout)
        b.add_peer("bench-torch-a", a.metadata(), a.layout)
        nbytes = tokens * engine.kv_bytes_per_token
        times = []
        for i in range(reps + 2):
            t = time.perf_counter()
            n = await b.read("bench-torch-a", seg_src, seg_dst)
            if i >= 2:
                times.append(time.perf_counter() - t)
        assert n == nbytes and np.array_equal(src.read(seg_src), dst.read(seg_dst))
        x = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
        y = np.empty_like(x)
        mem = []
        for i in range(reps + 2):
            t = time.perf_counter()
            np.copyto(y, x)
            if i >= 2:
                mem.append(time.perf_counter() - t)
        nixl_s, mem_s = statistics.median(times), statistics.median(mem)
        return {
            "history_tokens": tokens,
            "bytes": nbytes,
            "bytes_per_token": engine.kv_bytes_per_token,
            "blocks": len(hist.blocks),
            "nixl_read_ms": round(nixl_s * 1e3, 3),
            "nixl_read_gb_s": round(nbytes / nixl_s / 1e9, 2),
            "memcpy_ms": round(mem_s * 1e3, 3),
            "memcpy_gb_s": round(nbytes / mem_s / 1e9, 2),
            "nixl_vs_memcpy": round(mem_s / nixl_s, 3),
        }
    finally:
        a.close()
        b.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="smollm2-135m-instruct, tiny, or a folder")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per session")
    ap.add_argument("--new", type=int, default=32, help="generated tokens per session")
    ap.add_argument("--batches", default="1,4,8", help="comma-separated batch sizes")
    ap.add_argument("--kv-tokens", type=int, default=1024, help="history tokens moved over NIXL")
    ap.add_argument("--reps", type=int, default=20, help="repetitions of the KV transfer")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    if args.new < 2 or args.prompt < 1 or min(args.batches) < 1:
        ap.error("--new must be >= 2, --prompt and every batch >= 1")
    load_before = os.getloadavg()[0]  # the box is shared: say how busy it was
    model, info = _load(args.model)
    print(json.dumps(info), file=sys.stderr)
    decode, padding = bench_decode(model, args)
    print(json.dumps(padding), file=sys.stderr)
    kv = asyncio.run(_kv_transfer(TorchEngine(model), args.kv_tokens, args.reps))
    print(json.dumps(kv), file=sys.stderr)
    result = {
        "command": " ".join(["python -m benchmarks.torch_engine", *(sys.argv[1:] if argv is None else argv)]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        **info,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "decode": decode,
        "batching": padding,
        "kv_transfer": kv,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
