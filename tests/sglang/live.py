"""`make test-sglang`'s check (runs in .venv-sglang, built by tests/sglang/setup.sh): AMPD on real
SGLang on this machine's CPU.

1. `ampd up --engine torch` and then `ampd up --engine sglang`, each with 1 prefill and 1 decode
   worker on SmolLM2-135M-Instruct under the threshold policy, serve the same 3-round
   conversations (the gRPC session API, token ids in, greedy). Conversation A's rounds are
   remote, local, remote; B's local, remote, local (by their new-token counts against
   --threshold-tokens). Checked: every token equal between the two engines, and each round ran
   where the policy put it.
2. Remote rounds do not recompute the history: the prefill worker's SGLang request for the round
   reports `cached_tokens` covering the history (the pages its linker loaded from the decode
   worker, ampd.engine.sglang_linker), and so does the decode worker's request that continues it.
3. Round decode speed through AMPD against SGLang's own `Engine.generate` (streaming, same model,
   same contexts, same output lengths), one run, alternating round by round while the deployment
   stays up: AMPD must reach 0.8x. Written to benchmarks/results/sglang_cpu.json.
4. `ampd profile --engine sglang --grid tiny` (after the deployment is down): SGLang timed through the
   Engine protocol (prefill over history and new lengths, decode steps in rounds a streaming prefill
   opened, KV over NIXL), fitted and judged on held-out points. On this shared box the timings may
   fail the held-out check; either outcome is accepted if it is well-formed: a written profile holds
   every quantity's held-out error, and a refusal names, for each problem, the quantity (and piece)
   and its measured points, and leaves no file. Which one happened goes to the results file.

Prints one line per check and exits 1 on the first failure. Keep the prompts and outputs short:
two SGLang instances start on 2 shared cores.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # this process's own SGLang engine (the baseline) too

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "sglang_cpu.json"
THRESHOLD = 24  # the threshold policy: fewer new tokens than this prefill locally
MIN_SPEED = 0.8

QUESTIONS = {  # (question, new tokens in range); long ones go remote, short ones stay local
    "A": ["You are a helpful assistant. Tell me, in two short sentences, what the capital of France is and "
          "one famous building there.",
          "Why?",
          "Now name two other large cities in that country and say in one sentence what each is known for."],
    "B": ["Hi!",
          "Please list three colours of the rainbow and, for each one, one fruit that usually has that colour.",
          "Thanks."],
}
OUT_TOKENS = 8  # each round's output (ignore_eos: every round has this many)


def fail(msg: str) -> None:
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def ok(msg: str) -> None:
    print(f"ok: {msg}", flush=True)


# ---------------------------------------------------------------------------------- conversations
def turn_ids(tok, question: str, first: bool) -> list[int]:
    """A user turn in SmolLM2's ChatML: the system-free first prompt, or the continuation after the
    assistant's (cut) answer."""
    text = ("" if first else "<|im_end|>\n") + f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return tok.encode(text, add_special_tokens=False)


async def converse(address: str, sid: str, turns: list[list[int]]) -> tuple[list[list[int]], list]:
    """One session through the coordinator: each turn's output tokens and the rounds' timings."""
    from ampd import grpcserver
    from ampd.coordinators import session_events
    from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

    ch = grpcserver.channel(address)
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    outbox: asyncio.Queue = asyncio.Queue()

    def turn(i: int) -> common_pb2.Turn:
        return common_pb2.Turn(token_ids=turns[i], sampling=common_pb2.SamplingParams(max_tokens=OUT_TOKENS,
                                                                                      ignore_eos=True))

    await outbox.put(coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(session_id=sid, turn=turn(0))))

    async def requests():
        while (m := await outbox.get()) is not None:
            yield m

    outs: list[list[int]] = [[]]
    rounds: list = []
    nxt = 1
    async for ev in session_events(stub.Session(requests(), timeout=600)):
        kind = ev.WhichOneof("event")
        if kind == "tokens":
            outs[-1].extend(ev.tokens.token_ids)
        elif kind == "turn_end":
            if nxt < len(turns):
                outs.append([])
                await outbox.put(coordinator_pb2.ClientMessage(turn=turn(nxt)))
            else:
                await outbox.put(None)
            nxt += 1
        elif kind == "done":
            rounds = list(ev.done.rounds)
    await ch.close()
    return outs, rounds


class Up:
    """`ampd up` as a user runs it, in a subprocess; its coordinator address once it serves."""

    def __init__(self, engine: str, model: str, run_dir: Path) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(run_dir / f"ampd-up-{engine}.log", "w+")
        argv = [sys.executable, "-m", "ampd", "up", "--engine", engine, "--model", model, "--prefill", "tp1*1",
                "--decode", "tp1*1", "--policy", "threshold", "--threshold-tokens", str(THRESHOLD),
                "--profile", "qwen3-32b@h20", "--ttft-slo", "60", "--itl-slo", "10", "--run-dir", str(run_dir),
                "--namespace", f"sglang-test-{engine}"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.engine = engine

    def wait(self, timeout_s: float = 900) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.log.seek(0)
            text = self.log.read()
            m = re.search(r"^coordinator (\S+)$", text, re.M)
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                fail(f"ampd up --engine {self.engine} exited with {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.5)
        fail(f"ampd up --engine {self.engine} did not serve within {timeout_s:.0f} s")
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def sglang_requests(log: Path) -> list[dict]:
    """The engine's "sglang request" log lines of one worker (session, prompt and cached tokens)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "sglang request" in line:
            d = dict(re.findall(r"(\w+)=(\S+)", line))
            out.append({"session": d.get("session", ""), "prompt": int(d.get("prompt_tokens", 0)),
                        "cached": int(d.get("cached_tokens", 0))})
    return out


# ------------------------------------------------------------------------------------- speed
async def baseline_round(engine, ids: list[int], n: int) -> tuple[list[int], float, float]:
    """SGLang's own streaming generate of one round: its tokens, first-token and last-token times."""
    gen = await engine.async_generate(input_ids=ids, stream=True,
                                      sampling_params={"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
    toks, first, last = [], 0.0, 0.0
    async for chunk in gen:
        now = time.time()
        toks.extend(chunk["output_ids"])
        first = first or now
        last = now
    return toks, first, last


# ------------------------------------------------------------------------------------- profile
QUANTITIES = ("tp.1.t_pre", "tp.1.t_dec", "t_kv")


def profile_sglang(root: Path, grid: str) -> dict:
    """`ampd profile --engine sglang` as a user runs it; what it measured and whether it wrote the
    profile (fails the test when its output is not well-formed either way)."""
    out = root / "sglang-profile.json"
    t = time.time()
    argv = [sys.executable, "-m", "ampd", "profile", "--engine", "sglang", "--grid", grid, "--out", str(out)]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        fail(f"ampd profile --engine sglang --grid {grid} did not end within 900 s")
    text = r.stdout + r.stderr
    rows = {m.group(1): {"max_rel": round(float(m.group(2)) / 100, 4), "mean_rel": round(float(m.group(3)) / 100, 4),
                         "points": int(m.group(4))}
            for m in re.finditer(r"^(\S+)\s+([\d.]+)%\s+([\d.]+)%\s+(\d+)$", r.stdout, re.M)}
    if "Traceback" in text or set(rows) != set(QUANTITIES):
        fail(f"ampd profile --engine sglang (rc {r.returncode}) printed no held-out error per quantity "
             f"{QUANTITIES}:\n{text[-3000:]}")
    res = {"command": " ".join(["ampd", *argv[3:-2]]), "seconds": round(time.time() - t, 1), "held_out_error": rows}
    if r.returncode == 0:
        doc = json.loads(out.read_text())
        prof = doc["profiling"]
        if prof["engine"] != "sglang" or set(prof["held_out_error"]) != set(QUANTITIES):
            fail(f"the written profile is not SGLang's or lacks a quantity's held-out error: {prof['held_out_error']}")
        res |= {"accepted": True, "max_held_out_error": prof["max_held_out_error"]}
        return res
    refused = [ln.removeprefix("refused: ") for ln in r.stderr.splitlines() if ln.startswith("refused: ")]
    if r.returncode != 2 or not refused or out.exists() or "profile refused" not in r.stderr:
        fail(f"ampd profile --engine sglang failed (rc {r.returncode}) other than by refusing its profile:\n"
             f"{text[-3000:]}")
    for p in refused:  # each problem names its quantity and the measured points behind it
        if not p.startswith(QUANTITIES) or not re.search(r"measured [\d.]+ ms|its points: \(|their points: \(", p):
            fail(f"a refusal does not name its quantity and points: {p}")
    res |= {"accepted": False, "refused": refused}
    return res


def rate(rounds: list[tuple[int, float]]) -> float:
    """Decode tokens/s over rounds of (tokens after the first, seconds from first to last)."""
    return sum(n for n, _ in rounds) / max(1e-9, sum(s for _, s in rounds))


# -------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speed-reps", type=int, default=2, help="AMPD/SGLang alternations of the speed conversation")
    ap.add_argument("--profile-grid", default="tiny", choices=("tiny", "small", "full", "none"),
                    help="grid of the `ampd profile --engine sglang` check (none: skip it)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a CI timeout still stops the deployments
    t_start = time.time()
    from ampd.engine.torch_models import DEFAULT_MODEL, load_tokenizer, resolve_model

    model = str(resolve_model(DEFAULT_MODEL))
    tok = load_tokenizer(model)
    turns = {k: [turn_ids(tok, q, i == 0) for i, q in enumerate(qs)] for k, qs in QUESTIONS.items()}
    want_local = {k: [len(t) + (0 if i == 0 else 1) < THRESHOLD for i, t in enumerate(ts)] for k, ts in turns.items()}
    for k in turns:
        if want_local[k] != ([False, True, False] if k == "A" else [True, False, True]):
            fail(f"conversation {k}'s turns do not fall on the intended side of the threshold: "
                 f"{[len(t) for t in turns[k]]} tokens")
    root = Path(tempfile.mkdtemp(prefix="ampd-sglang-test-"))
    result: dict = {"command": "make test-sglang", "model": DEFAULT_MODEL, "host": platform.node(),
                    "cpus": os.cpu_count(), "out_tokens": OUT_TOKENS, "threshold_tokens": THRESHOLD}

    # 1. the torch engine's tokens
    t = time.time()
    up = Up("torch", DEFAULT_MODEL, root / "torch")
    try:
        address = up.wait()
        ref = {k: asyncio.run(converse(address, f"torch-{k}", turns[k])) for k in turns}
    finally:
        up.stop()
    result["torch_run_s"] = round(time.time() - t, 1)
    for k, (outs, rounds) in ref.items():
        if [r.local for r in rounds] != want_local[k]:
            fail(f"torch: conversation {k} ran local={[r.local for r in rounds]}, wanted {want_local[k]}")
    ok(f"torch engine served both conversations ({result['torch_run_s']} s)")

    # 2. the same on SGLang
    t = time.time()
    run_dir = root / "sglang"
    up = Up("sglang", DEFAULT_MODEL, run_dir)
    try:
        address = up.wait()
        result["sglang_up_s"] = round(time.time() - t, 1)
        ok(f"ampd up --engine sglang serving after {result['sglang_up_s']} s")
        # A fresh SGLang instance's first forwards are slow (20+ s here): one conversation first, so
        # that no round of the checked ones outlasts the decode worker's remote wait and runs
        # locally instead (and the speed runs measure warm instances).
        t = time.time()
        asyncio.run(converse(address, "warm-up", [turn_ids(tok, "Count from one to ten in words, please, "
                                                                   "separated by commas.", True),
                                                  turn_ids(tok, "Again.", False)]))
        result["warm_up_s"] = round(time.time() - t, 1)
        ok(f"warm-up conversation ({result['warm_up_s']} s)")
        got = {k: asyncio.run(converse(address, f"sglang-{k}", turns[k])) for k in turns}
        for k in turns:
            outs, rounds = got[k]
            where = [r.local for r in rounds]
            if where != want_local[k]:
                fail(f"sglang: conversation {k} ran local={where}, wanted {want_local[k]}")
            if outs != ref[k][0]:
                fail(f"sglang: conversation {k}'s tokens differ from the torch engine's:\n  sglang {outs}\n"
                     f"  torch  {ref[k][0]}")
            ok(f"conversation {k}: {sum(map(len, outs))} greedy tokens equal to the torch engine's, rounds "
               f"{'/'.join('local' if w else 'remote' for w in where)}")
        result["equal_tokens"] = True

        # 3. remote rounds: cached tokens on the prefill worker and on the decode worker after it
        pre = sglang_requests(run_dir / "prefill-0.log")
        dec = sglang_requests(run_dir / "decode-0.log")
        remote_checks = []
        for k in turns:
            hist = 0
            outs, rounds = got[k]
            for i, r in enumerate(rounds):
                if not r.local and r.l_hist > 0:
                    p = [q for q in pre if q["session"] == f"sglang-{k}" and q["prompt"] == r.l_hist + r.l_incr]
                    d = [q for q in dec if q["session"] == f"sglang-{k}" and q["prompt"] == r.l_hist + r.l_incr + 1]
                    if not p or not d:
                        fail(f"no SGLang request of conversation {k} round {i} in the workers' logs")
                    remote_checks.append({"conversation": k, "round": i, "history": r.l_hist, "new": r.l_incr,
                                          "prefill_cached": p[-1]["cached"], "decode_cached": d[-1]["cached"]})
                hist += r.l_incr
        result["remote_rounds"] = remote_checks
        page = 16
        for c in remote_checks:
            if c["prefill_cached"] < c["history"] - page + 1:
                fail(f"remote round {c}: the prefill instance recomputed the history "
                     f"(cached {c['prefill_cached']} of {c['history']} history tokens)")
            if c["decode_cached"] < c["history"] + c["new"] - page + 1:
                fail(f"remote round {c}: the decode instance recomputed the round's input "
                     f"(cached {c['decode_cached']} of {c['history'] + c['new']})")
        ok(f"{len(remote_checks)} remote rounds: SGLang's cached tokens cover the history on the prefill "
           f"instance and the round's input on the decode instance ({remote_checks})")

        # 4. speed: conversation A again through AMPD, alternating with SGLang's own Engine
        import sglang

        from ampd.engine.sglang_args import SGLangOptions, launch_env, server_args

        opts = SGLangOptions(model_path=model, dtype="float32")  # as the workers' instances (make_engine)
        os.environ.update(launch_env(opts))
        eng = sglang.Engine(**server_args(opts))
        ampd_rounds, base_rounds = [], []
        try:
            for rep in range(args.speed_reps):
                outs, rounds = asyncio.run(converse(address, f"speed-{rep}", turns["A"]))
                ampd_rounds += [(r.tokens - 1, r.last_token - r.first_token) for r in rounds]
                ctx: list[int] = []

                async def base(ctx=ctx):
                    rr = []
                    for i, new in enumerate(turns["A"]):
                        ctx += new
                        toks, first, last = await baseline_round(eng, list(ctx), OUT_TOKENS)
                        if toks != outs[i]:
                            fail(f"SGLang's own generate gave other tokens than AMPD on round {i}: {toks} vs {outs[i]}")
                        ctx += toks
                        rr.append((len(toks) - 1, last - first))
                    return rr

                base_rounds += eng.loop.run_until_complete(base())
        finally:
            eng.shutdown()
        a, b = rate(ampd_rounds), rate(base_rounds)
        result["speed"] = {"ampd_tokens_per_s": round(a, 2), "sglang_generate_tokens_per_s": round(b, 2),
                           "ratio": round(a / b, 3), "rounds_each": len(ampd_rounds), "min_ratio": MIN_SPEED,
                           "ampd_itl_ms": round(1000 / a, 1), "sglang_itl_ms": round(1000 / b, 1)}
        print(f"speed: AMPD {a:.2f} tokens/s, SGLang Engine.generate {b:.2f} tokens/s, ratio {a / b:.3f}", flush=True)
    finally:
        up.stop()
    if args.profile_grid != "none":
        # 5. the profiler through SGLang, with the deployment down (its instances would share the cores)
        prof = result["profile"] = profile_sglang(root, args.profile_grid)
        errs = ", ".join(f"{q} {e['max_rel']:.1%}" for q, e in prof["held_out_error"].items())
        ok(f"ampd profile --engine sglang --grid {args.profile_grid} in {prof['seconds']} s, held-out max {errs}: "
           + ("written" if prof["accepted"] else f"refused, naming pieces and points ({len(prof['refused'])} "
                                                  "problem(s))"))
    result["total_s"] = round(time.time() - t_start, 1)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}", flush=True)
    if a < MIN_SPEED * b:
        fail(f"AMPD decodes at {a / b:.3f}x of SGLang's own generate (at least {MIN_SPEED} wanted)")
    ok("decode speed through AMPD")
    return 0


if __name__ == "__main__":
    sys.exit(main())
