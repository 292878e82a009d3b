"""The torch engine through a live deployment against plain transformers, and its KV through NIXL.

    python -m benchmarks.torch_engine [--model smollm2-135m-instruct|FOLDER] [--prompt 300]
                                      [--new 64] [--batch 8] [--batch-new 160] [--reps 5]

One run, same model folder, same torch threads in `generate` as in each engine worker (`ampd up`'s
--worker-threads: the cores divided among its engine workers), same prompts (random token ids):
- `generate`: in this process, `model.generate(use_cache=True)` greedy on each prompt; its decode
  rate is (new - 1) / (time of `new` tokens - time of 1 token), and `forward` is one plain
  `model(ids)` over the prompt (the TTFT reference).
- AMPD: `ampd up --engine torch` (Redis, coordinator, one prefill and one decode worker, sidecar, the
  OpenAI front) started from this process; each prompt is one streamed `/v1/completions` request
  (token ids, `ignore_eos`), timed by this client: TTFT from sending to the first token, decode
  rate (new - 1) / (last token - first token). Batch 1 and generate take turns, `--reps` times each,
  so both see the same load; the medians are reported, every sample is kept.
- batching: `--batch` sessions sent at once (prompts of `--batch-prompt` tokens, `--batch-new` new
  tokens each); aggregate decode tokens/s over the window in which all of them are decoding (from
  the last session's first token to the first session's last), against batch 1.
- memory bandwidth: weight bytes read per decode step (every parameter once) divided by the
  bandwidth of `np.copyto` of a 256 MiB buffer: the step no CPU of this memory can beat; against it
  the batch-1 step (wall clock) and the decode worker's CPU time per token (from /proc, first to
  last token of each batch-1 stream: what a step costs the worker whatever else holds the cores).
- KV transfer: one session's history in the engine's block layout (16-token blocks, scattered), READ
  from one pool into another over NIXL (UCX, two agents in this process), against numpy copying the
  same number of bytes in one piece.
Greedy tokens through AMPD are checked equal to `generate`'s. Writes benchmarks/results/torch_engine.json
with the command and the load average (the 2-core box is shared: compare the ratios of one run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ampd.config import add_flags  # noqa: E402
from ampd.engine.torch_engine import TorchEngine  # noqa: E402
from ampd.engine.torch_models import (  # noqa: E402
    load_model,
    resolve_model,
)
from ampd.kv import SessionKV  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "torch_engine.json"


def _load(name: str) -> tuple[object, dict]:
    t = time.perf_counter()
    path = resolve_model(name)
    prep_s = time.perf_counter() - t
    t = time.perf_counter()
    model = load_model(path)
    info = {"model": name, "path": str(path), "prepare_s": round(prep_s, 2),
            "load_s": round(time.perf_counter() - t, 2),
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
    return model, info


def _generate(model, prompt: list[int], new: int) -> tuple[float, list[int], float]:
    t, c = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        o = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           use_cache=True)
    return time.perf_counter() - t, o[0, len(prompt):].tolist(), time.process_time() - c


def generate_sample(model, prompt: list[int], new: int) -> dict:
    """`generate` of 1 and of `new` tokens, and one plain forward over the prompt."""
    one_s, _, one_cpu = _generate(model, prompt, 1)
    all_s, tokens, all_cpu = _generate(model, prompt, new)
    t = time.perf_counter()
    with torch.inference_mode():
        model(torch.tensor([prompt]))
    fwd_s = time.perf_counter() - t
    return {"forward_s": fwd_s, "first_s": one_s, "decode_tok_s": (new - 1) / max(all_s - one_s, 1e-9),
            "cpu_ms": (all_cpu - one_cpu) / (new - 1) * 1e3, "tokens": tokens}


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream(http, model: str, prompt: list[int], new: int, cpu=None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    ids: list[int] = []
    times: list[float] = []
    cpu_at: list[float] = []  # `cpu()` at the first token and at the end: the decode's CPU
    sent = time.perf_counter()
    async with http.stream("POST", "/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                for c in chunk.get("choices", ()):
                    new_ids = c.get("token_ids") or []
                    if cpu is not None and new_ids and not ids:
                        cpu_at.append(cpu())
                    ids.extend(new_ids)
                    times.extend([time.perf_counter()] * len(new_ids))
    if cpu is not None:
        cpu_at.append(cpu())
    return {"sent": sent, "times": times, "tokens": ids, "cpu": cpu_at}


def _rate(r: dict) -> float:
    t = r["times"]
    return (len(t) - 1) / max(t[-1] - t[0], 1e-9)


async def live(url: str, model, name: str, args, rng, decode_pid: int) -> dict:
    import httpx2

    samples_gen, samples_ampd = [], []
    same = True
    async with httpx2.AsyncClient(base_url=url + "/v1", timeout=900) as http:
        warm = rng.integers(10, model.config.vocab_size, 32).tolist()
        await _stream(http, name, warm, 4)  # first use of each path in its process is slower
        _generate(model, warm, 4)
        for _ in range(args.reps):
            prompt = rng.integers(10, model.config.vocab_size, args.prompt).tolist()
            g = generate_sample(model, prompt, args.new)
            r = await _stream(http, name, prompt, args.new, cpu=lambda: cpu_s(decode_pid))
            same &= r["tokens"] == g.pop("tokens")
            samples_gen.append(g)
            samples_ampd.append({"ttft_s": r["times"][0] - r["sent"], "decode_tok_s": _rate(r),
                                 "worker_cpu_ms": (r["cpu"][1] - r["cpu"][0]) / (len(r["times"]) - 1) * 1e3})
            print(json.dumps({"generate": samples_gen[-1], "ampd": samples_ampd[-1]}), file=sys.stderr)
        prompts = [rng.integers(10, model.config.vocab_size, args.batch_prompt).tolist() for _ in range(args.batch)]
        runs = await asyncio.gather(*[_stream(http, name, p, args.batch_new) for p in prompts])
    all_in = max(r["times"][0] for r in runs)  # every session is decoding from here ...
    first_out = min(r["times"][-1] for r in runs)  # ... to here
    window = sum(sum(all_in < t <= first_out for t in r["times"]) for r in runs)
    med = statistics.median
    b1 = med(s["decode_tok_s"] for s in samples_ampd)
    gen = med(s["decode_tok_s"] for s in samples_gen)
    fwd = med(s["forward_s"] for s in samples_gen)
    ttft = med(s["ttft_s"] for s in samples_ampd)
    if first_out <= all_in:  # the prefills of the batch outlasted a session's decode: no common window
        raise RuntimeError(f"no window with all {args.batch} sessions decoding: the first ended "
                           f"{all_in - first_out:.1f} s before the last began; raise --batch-new")
    agg = window / (first_out - all_in)
    return {
        "samples": {"generate": [{k: round(v, 4) for k, v in g.items()} for g in samples_gen],
                    "ampd": [{k: round(v, 4) for k, v in a.items()} for a in samples_ampd]},
        "batch1": {"ampd_decode_tok_s": round(b1, 2), "generate_decode_tok_s": round(gen, 2),
                   "worker_cpu_ms_per_token": round(med(s["worker_cpu_ms"] for s in samples_ampd), 1),
                   "generate_cpu_ms_per_token": round(med(s["cpu_ms"] for s in samples_gen), 1),
                   "ratio": round(b1 / gen, 3), "ampd_itl_ms": round(1e3 / b1, 1),
                   "generate_itl_ms": round(1e3 / gen, 1), "same_tokens": same},
        "ttft": {"prompt_tokens": args.prompt, "ampd_ttft_s": round(ttft, 3), "forward_s": round(fwd, 3),
                 "ratio": round(ttft / fwd, 3)},
        "batching": {"sessions": args.batch, "prompt_tokens": args.batch_prompt, "new_tokens": args.batch_new,
                     "window_s": round(first_out - all_in, 3),
                     "window_tokens": window, "aggregate_tok_s": round(agg, 2),
                     "wall_tok_s": round(sum(len(r["times"]) for r in runs)
                                         / (max(r["times"][-1] for r in runs) - min(r["sent"] for r in runs)), 2),
                     "vs_batch1": round(agg / b1, 2)},
    }


def bandwidth(model, b1_tok_s: float, cpu_ms: float) -> dict:
    """The decode step against the memory-bandwidth limit."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x = np.random.default_rng(2).integers(0, 256, 256 << 20, dtype=np.uint8)
    y = np.empty_like(x)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(y, x)
        times.append(time.perf_counter() - t)
    gb_s = x.nbytes / min(times) / 1e9
    limit_ms = weight_bytes / (gb_s * 1e9) * 1e3
    return {"weight_bytes_per_token": weight_bytes, "copy_gb_s": round(gb_s, 2),
            "limit_step_ms": round(limit_ms, 1), "ampd_step_ms": round(1e3 / b1_tok_s, 1),
            "ampd_step_vs_limit": round(1e3 / b1_tok_s / limit_ms, 2),
            "worker_cpu_ms_per_token": cpu_ms, "worker_cpu_vs_limit": round(cpu_ms / limit_ms, 2)}


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
    add_flags(ap, ("model",))
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens of the batch-1 requests")
    ap.add_argument("--new", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--reps", type=int, default=5, help="batch-1 requests (and generate runs)")
    ap.add_argument("--batch", type=int, default=8, help="concurrent sessions")
    ap.add_argument("--batch-prompt", type=int, default=128, help="prompt tokens of each concurrent session")
    # The sessions' prefills run one after another: each must still be decoding when the last starts.
    ap.add_argument("--batch-new", type=int, default=160, help="generated tokens of each concurrent session")
    ap.add_argument("--kv-tokens", type=int, default=1024, help="history tokens moved over NIXL")
    ap.add_argument("--kv-reps", type=int, default=20, help="repetitions of the KV transfer")
    ap.add_argument("--out", default=str(OUT))
    argv = list(argv or [])  # `make bench` (benchmarks.run) calls main() with none
    args = ap.parse_args(argv)
    if args.new < 2 or args.batch_new < 2 or args.prompt < 1 or args.batch < 2 or args.reps < 1:
        ap.error("--new and --batch-new must be >= 2, --batch >= 2, --prompt and --reps >= 1")
    from ampd.launcher import Deployment, Options

    load_before = os.getloadavg()[0]  # the box is shared: say how busy it was
    with Deployment(Options(engine="torch", model=args.model), frontend=True, ready_timeout_s=600) as dep:
        threads = dep.worker_threads()
        torch.set_num_threads(threads)  # generate gets the threads each engine worker has
        model, info = _load(args.model)
        print(json.dumps(info), file=sys.stderr)
        rng = np.random.default_rng(0)
        res = asyncio.run(live(dep.frontend, model, args.model, args, rng, dep.child("decode-0").proc.pid))
    res["bandwidth"] = bandwidth(model, res["batch1"]["ampd_decode_tok_s"], res["batch1"]["worker_cpu_ms_per_token"])
    kv = asyncio.run(_kv_transfer(TorchEngine(model), args.kv_tokens, args.kv_reps))
    result = {
        "command": " ".join(["python -m benchmarks.torch_engine", *argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"{threads} torch threads in generate and in each engine worker (--worker-threads)",
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        **info,
        "new_tokens": args.new,
        **res,
        "kv_transfer": kv,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
