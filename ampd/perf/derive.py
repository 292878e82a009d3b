"""Derive the shipped profiles from hardware and model specifications.

    python -m ampd.perf.derive --out ampd/perf/profiles    # rewrite the shipped JSON files
    python -m ampd.perf.derive --table                     # print the key numbers (docs table)

Every constant lives in the tables below, with its source; docs/perf-model.md explains the model.
An analytic roofline model (``prefill_linear_s``, ``decode_batch_s``, ...) is evaluated at fixed
breakpoints and stored as the continuous piecewise-linear interpolant through those points; the
terms that are exactly linear in a second variable (history length, context tokens) are stored as
their coefficients. Pure Python: the output is bit-for-bit reproducible.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .piecewise import Piecewise, interpolate_piecewise
from .profile import KVTransfer, Profile, TPModel, profile_from_dict

# ---------------------------------------------------------------------------------------------
# Spec tables
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes: float             # memory per GPU
    hbm_bytes_per_s: float       # memory bandwidth per GPU
    bf16_flops: float            # dense BF16 tensor throughput per GPU
    nvlink_bytes_per_s: float    # NVLink per GPU, ONE direction (900 GB/s bidirectional / 2)
    nic_bytes_per_s: float       # one InfiniBand NIC per GPU, one direction
    source: str


HARDWARE = {
    "h20": Hardware(
        name="h20", hbm_bytes=96e9, hbm_bytes_per_s=4.0e12, bf16_flops=148e12,
        nvlink_bytes_per_s=450e9, nic_bytes_per_s=25e9,
        source="NVIDIA H20 datasheet figures (96 GB HBM3, 4.0 TB/s, 148 TFLOP/s dense BF16, NVLink 900 GB/s "
               "bidirectional); 200 Gb/s InfiniBand NIC per GPU as in the AMPD paper's 4x8 H20 cluster"),
}


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int                     # FFN width (per expert for MoE)
    vocab: int
    experts: int = 1             # MoE experts per layer (1 = dense)
    top_k: int = 1               # experts each token uses
    dtype_bytes: int = 2         # BF16 weights and KV
    published_params: float = 0.0
    source: str = ""

    @property
    def q_dim(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def attn_params(self) -> int:    # per layer: Q, K, V, O projections
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def expert_params(self) -> int:  # per layer per expert: gate, up, down (SwiGLU)
        return 3 * self.hidden * self.ffn

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts if self.experts > 1 else 0

    @property
    def head_params(self) -> int:    # untied LM head (all three models untie it)
        return self.hidden * self.vocab

    @property
    def total_params(self) -> int:
        per_layer = self.attn_params + self.experts * self.expert_params + self.router_params + 2 * self.hidden
        return self.layers * per_layer + self.hidden + 2 * self.vocab * self.hidden  # + embedding + head

    @property
    def active_matmul_params(self) -> int:  # per token, transformer layers only
        return self.layers * (self.attn_params + self.router_params + self.top_k * self.expert_params)

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def experts_touched(self, tokens: float) -> float:
        """Expected distinct experts per layer used by ``tokens`` tokens (uniform, independent routing)."""
        if self.experts == 1:
            return 1.0
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** tokens)

    def layer_weight_bytes_read(self, tokens: float) -> float:
        """Bytes of weights a forward pass over ``tokens`` tokens reads (layers + LM head)."""
        per_layer = self.attn_params + self.router_params + self.experts_touched(tokens) * self.expert_params
        return (self.layers * per_layer + self.head_params) * self.dtype_bytes


MODELS = {
    "llama3.1-70b": Model("llama3.1-70b", layers=80, hidden=8192, q_heads=64, kv_heads=8, head_dim=128,
                          ffn=28672, vocab=128256, published_params=70.6e9,
                          source="meta-llama/Llama-3.1-70B config.json"),
    "qwen3-32b": Model("qwen3-32b", layers=64, hidden=5120, q_heads=64, kv_heads=8, head_dim=128,
                       ffn=25600, vocab=151936, published_params=32.8e9,
                       source="Qwen/Qwen3-32B config.json"),
    "mixtral-8x7b": Model("mixtral-8x7b", layers=32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128,
                          ffn=14336, vocab=32000, experts=8, top_k=2, published_params=46.7e9,
                          source="mistralai/Mixtral-8x7B-v0.1 config.json"),
}


@dataclass(frozen=True)
class Assumptions:
    """Engine-level constants. Each is a judgement, documented in docs/perf-model.md."""

    compute_fraction: float = 0.6        # achieved / peak BF16 on large GEMMs and FlashAttention
    hbm_fraction: float = 0.8            # achieved / peak HBM bandwidth on weight and KV streaming
    nvlink_fraction: float = 0.8         # achieved / peak NVLink bus bandwidth in a ring all-reduce
    allreduce_latency_s: float = 10e-6   # fixed cost of one small NCCL all-reduce
    allreduces_per_layer: int = 2        # after attention and after the MLP (Megatron-style TP)
    prefill_overhead_s: float = 0.004    # per prefill: scheduling, launches not hidden, sampling
    decode_overhead_s: float = 0.002     # per decode step: scheduler, CUDA-graph launch, sampling
    nic_fraction: float = 0.9            # achieved / line rate of one InfiniBand NIC (RDMA read/write)
    kv_transfer_alpha_s: float = 0.0005  # per KV transfer: descriptor setup, posting, notification
    gpu_memory_utilization: float = 0.90  # share of HBM the engine may use (vLLM/SGLang default-like)
    reserve_bytes_per_gpu: float = 4e9   # activations, CUDA graphs, allocator slack per GPU
    min_kv_tokens: int = 32768           # a TP degree must hold at least this many KV tokens
    chunk_target_s: float = 0.2          # a local prefill chunk pauses the decode batch about this long
    chunk_quantum: int = 256
    chunk_min: int = 256
    chunk_max: int = 8192


ASSUME = Assumptions()

# Breakpoints (why: docs/perf-model.md, "Breakpoints").
# Each TP degree adds its roofline knee (see `roofline_knee`) so the stored pieces follow the kink.
L_INCR_BREAKPOINTS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 16384, 131072)
BATCH_BREAKPOINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
KV_BYTES_PER_LINK_BREAKPOINTS = (0, 1 << 20, 1 << 24, 1 << 28, 1 << 32)

# The shipped profiles: (model, hardware, TP degrees).
SHIPPED = (
    ("llama3.1-70b", "h20", (2, 4, 8)),
    ("qwen3-32b", "h20", (1, 2, 4, 8)),
    ("mixtral-8x7b", "h20", (2, 4, 8)),
)
ZERO_NAME = "zero@none"
ZERO_TPS = (1, 2, 4, 8)
ZERO_KV_BYTES_PER_TOKEN = 128         # small, so live KV buffers stay small; bytes still move
ZERO_KV_CAPACITY_TOKENS = 1 << 20
ZERO_PREFILL_CHUNK_TOKENS = 8192

SIG_DIGITS = 9                        # JSON values are rounded to this many significant digits

# ---------------------------------------------------------------------------------------------
# The analytic model
# ---------------------------------------------------------------------------------------------


def allreduce_s(m: Model, hw: Hardware, tp: int, tokens: float, a: Assumptions = ASSUME) -> float:
    """Per-forward-pass TP all-reduce time over NVLink (ring: 2 (n-1)/n of the message per GPU)."""
    if tp == 1:
        return 0.0
    msg = tokens * m.hidden * m.dtype_bytes
    one = a.allreduce_latency_s + 2 * (tp - 1) / tp * msg / (hw.nvlink_bytes_per_s * a.nvlink_fraction)
    return a.allreduces_per_layer * m.layers * one


def _roofline_s(m: Model, hw: Hardware, tp: int, flops: float, weight_bytes: float,
                a: Assumptions) -> float:
    compute = flops / (tp * hw.bf16_flops * a.compute_fraction)
    memory = weight_bytes / (tp * hw.hbm_bytes_per_s * a.hbm_fraction)
    return max(compute, memory)


def prefill_linear_s(m: Model, hw: Hardware, tp: int, l_incr: float, a: Assumptions = ASSUME) -> float:
    """The part of a prefill that does not depend on the history: GEMMs, all-reduces, overhead.

    GEMM FLOPs are 2 x active matmul params per token plus the LM head for the last token only;
    weights read are the layers' (experts the tokens touch) plus the LM head; the slower of compute
    and weight streaming wins (roofline).
    """
    flops = 2.0 * m.active_matmul_params * l_incr + 2.0 * m.head_params
    return (a.prefill_overhead_s + _roofline_s(m, hw, tp, flops, m.layer_weight_bytes_read(l_incr), a)
            + allreduce_s(m, hw, tp, l_incr, a))


def prefill_attn_s_per_token2(m: Model, hw: Hardware, tp: int, a: Assumptions = ASSUME) -> float:
    """Attention FLOPs are 4 x layers x q_dim per (new token x attended token); causal average:
    each of l_incr new tokens attends l_hist + l_incr / 2 tokens. Compute-bound at the GEMM fraction."""
    return 4.0 * m.layers * m.q_dim / (tp * hw.bf16_flops * a.compute_fraction)


def kv_read_s_per_token(m: Model, hw: Hardware, tp: int, a: Assumptions = ASSUME) -> float:
    """Streaming one token's KV from HBM (KV heads are split across the tp ranks)."""
    return m.kv_bytes_per_token / (tp * hw.hbm_bytes_per_s * a.hbm_fraction)


def decode_batch_s(m: Model, hw: Hardware, tp: int, batch: float, a: Assumptions = ASSUME) -> float:
    """One decode step without the context term: weights (experts the batch touches) vs GEMM compute
    for `batch` tokens incl. the LM head, plus all-reduces and the per-step overhead."""
    flops = 2.0 * (m.active_matmul_params + m.head_params) * batch
    return (a.decode_overhead_s + _roofline_s(m, hw, tp, flops, m.layer_weight_bytes_read(batch), a)
            + allreduce_s(m, hw, tp, batch, a))


def decode_ctx_s_per_token(m: Model, hw: Hardware, tp: int, a: Assumptions = ASSUME) -> float:
    """Decode attention per context token: the KV read or its FLOPs, whichever is slower (with GQA the
    KV read wins on H20: q_heads / kv_heads = 8 FLOP/byte is below the ~28 FLOP/byte ridge)."""
    attn = 4.0 * m.layers * m.q_dim / (tp * hw.bf16_flops * a.compute_fraction)
    return max(kv_read_s_per_token(m, hw, tp, a), attn)


def roofline_knee(m: Model, hw: Hardware, tp: int, a: Assumptions = ASSUME, *, prefill: bool = False) -> int:
    """Smallest token count (decode batch, or prefill l_incr) at which GEMM compute outlasts the weight
    read: the kink of D(batch) and P(l_incr) (a prefill runs the LM head for its last token only)."""
    for n in range(1, 1 << 16):
        if prefill:
            flops = 2.0 * m.active_matmul_params * n + 2.0 * m.head_params
        else:
            flops = 2.0 * (m.active_matmul_params + m.head_params) * n
        if flops / (tp * hw.bf16_flops * a.compute_fraction) >= (
                m.layer_weight_bytes_read(n) / (tp * hw.hbm_bytes_per_s * a.hbm_fraction)):
            return n
    raise ValueError(f"{m.name}@{hw.name} tp {tp}: no roofline knee below 65536 tokens")


def breakpoints_with_knee(base: tuple[int, ...], knee: int) -> tuple[int, ...]:
    """``base`` plus the two integers around the kink (``knee - 1`` is the last memory-bound count)."""
    extra = {k for k in (knee - 1, knee) if base[0] < k < base[-1]}
    return tuple(sorted(set(base) | extra))


def kv_capacity_tokens(m: Model, hw: Hardware, tp: int, a: Assumptions = ASSUME) -> int:
    usable = tp * (hw.hbm_bytes * a.gpu_memory_utilization - a.reserve_bytes_per_gpu) - m.weight_bytes
    return max(0, int(usable // m.kv_bytes_per_token))


# ---------------------------------------------------------------------------------------------
# Building the profiles
# ---------------------------------------------------------------------------------------------


def _r(x: float) -> float:
    return float(f"{x:.{SIG_DIGITS}g}")


def _rounded(p: Piecewise) -> Piecewise:
    return Piecewise(p.breakpoints, tuple(_r(v) for v in p.alpha), tuple(_r(v) for v in p.beta))


def chunk_tokens(pre: Piecewise, attn: float, a: Assumptions) -> int:
    best = a.chunk_min
    for c in range(a.chunk_min, a.chunk_max + 1, a.chunk_quantum):
        if pre(c) + attn * 0.5 * c * c <= a.chunk_target_s:
            best = c
    return best


def derive_tp(m: Model, hw: Hardware, tp: int, a: Assumptions = ASSUME) -> TPModel:
    if tp > m.kv_heads:
        raise ValueError(f"{m.name}: tp {tp} > kv_heads {m.kv_heads} (KV heads would be replicated)")
    cap = kv_capacity_tokens(m, hw, tp, a)
    if cap < a.min_kv_tokens:
        raise ValueError(f"{m.name}@{hw.name}: tp {tp} leaves room for only {cap} KV tokens "
                         f"(< {a.min_kv_tokens})")
    pre = _rounded(interpolate_piecewise(
        lambda l: prefill_linear_s(m, hw, tp, l, a),
        breakpoints_with_knee(L_INCR_BREAKPOINTS, roofline_knee(m, hw, tp, a, prefill=True))))
    dec = _rounded(interpolate_piecewise(
        lambda b: decode_batch_s(m, hw, tp, b, a),
        breakpoints_with_knee(BATCH_BREAKPOINTS, roofline_knee(m, hw, tp, a))))
    attn = _r(prefill_attn_s_per_token2(m, hw, tp, a))
    return TPModel(
        kv_capacity_tokens=cap,
        prefill_chunk_tokens=chunk_tokens(pre, attn, a),
        pre=pre,
        pre_hist_s_per_token=_r(kv_read_s_per_token(m, hw, tp, a)),
        pre_attn_s_per_token2=attn,
        dec=dec,
        dec_ctx_s_per_token=_r(decode_ctx_s_per_token(m, hw, tp, a)),
    )


def kv_transfer(hw: Hardware, a: Assumptions = ASSUME) -> KVTransfer:
    beta = 1.0 / (hw.nic_bytes_per_s * a.nic_fraction)
    k = len(KV_BYTES_PER_LINK_BREAKPOINTS) - 1
    piece = Piecewise(KV_BYTES_PER_LINK_BREAKPOINTS, (_r(a.kv_transfer_alpha_s),) * k, (_r(beta),) * k)
    link = (f"InfiniBand, one {hw.nic_bytes_per_s * 8 / 1e9:g} Gb/s NIC per GPU at {a.nic_fraction:g} of "
            f"line rate; links = min(src_tp, dst_tp)")
    return KVTransfer(piece, "min_tp", link)


def derive_profile(model: str, hardware: str, tps, a: Assumptions = ASSUME) -> dict:
    """The JSON document of one shipped profile."""
    m, hw = MODELS[model], HARDWARE[hardware]
    name = f"{model}@{hardware}"
    prof = Profile(name=name, model=model, hardware=hardware, kv_bytes_per_token=m.kv_bytes_per_token,
                   tp_models={tp: derive_tp(m, hw, tp, a) for tp in tps}, kv_transfer=kv_transfer(hw, a),
                   description=(f"Derived by `python -m ampd.perf.derive` from specifications "
                                f"({m.source}; {hw.source}); see docs/perf-model.md."))
    doc = prof.to_json()
    doc["derivation"] = {
        "model": {k: getattr(m, k) for k in ("layers", "hidden", "q_heads", "kv_heads", "head_dim", "ffn",
                                               "vocab", "experts", "top_k", "dtype_bytes")}
        | {"total_params": m.total_params, "active_matmul_params": m.active_matmul_params,
           "weight_bytes": m.weight_bytes},
        "hardware": {k: getattr(hw, k) for k in ("hbm_bytes", "hbm_bytes_per_s", "bf16_flops",
                                                 "nvlink_bytes_per_s", "nic_bytes_per_s")},
        "assumptions": asdict(a),
    }
    return doc


def derive_zero() -> dict:
    def zeros(bps) -> Piecewise:
        return Piecewise(bps, (0.0,) * (len(bps) - 1), (0.0,) * (len(bps) - 1))

    tpm = TPModel(kv_capacity_tokens=ZERO_KV_CAPACITY_TOKENS, prefill_chunk_tokens=ZERO_PREFILL_CHUNK_TOKENS,
                  pre=zeros(L_INCR_BREAKPOINTS), pre_hist_s_per_token=0.0, pre_attn_s_per_token2=0.0,
                  dec=zeros(BATCH_BREAKPOINTS), dec_ctx_s_per_token=0.0)
    prof = Profile(name=ZERO_NAME, model="zero", hardware="none", kv_bytes_per_token=ZERO_KV_BYTES_PER_TOKEN,
                   tp_models={tp: tpm for tp in ZERO_TPS},
                   kv_transfer=KVTransfer(zeros(KV_BYTES_PER_LINK_BREAKPOINTS), "min_tp", "none (free)"),
                   description="Every cost is 0: measures the live path's own latency (mock engine).")
    return prof.to_json()


def derive_all() -> dict[str, dict]:
    """name -> JSON document, for every shipped profile."""
    out = {f"{m}@{h}": derive_profile(m, h, tps) for m, h, tps in SHIPPED}
    out[ZERO_NAME] = derive_zero()
    return out


def dumps(doc: dict) -> str:
    """Indented JSON with every list of numbers on one line."""
    text = json.dumps(doc, indent=1)
    return re.sub(r"\[\s*([^\[\]{}\"]*?)\s*\]", lambda mo: "[" + re.sub(r"\s+", " ", mo.group(1)) + "]",
                  text) + "\n"


def write_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, doc in derive_all().items():
        profile_from_dict(doc, name)  # must parse
        p = out_dir / f"{name}.json"
        p.write_text(dumps(doc), encoding="utf-8")
        paths.append(p)
    return paths


# ---------------------------------------------------------------------------------------------
# Checks and the docs table
# ---------------------------------------------------------------------------------------------


def interpolation_error(model: str, hardware: str, tp: int) -> tuple[float, float]:
    """Largest relative error of the stored pieces against the analytic model, (prefill, decode),
    over every integer l_incr in [1, 16384] and batch in [1, 512]."""
    m, hw = MODELS[model], HARDWARE[hardware]
    t = derive_tp(m, hw, tp)
    e_pre = max(abs(t.pre(l) / prefill_linear_s(m, hw, tp, l) - 1) for l in range(1, 16385))
    e_dec = max(abs(t.dec(b) / decode_batch_s(m, hw, tp, b) - 1) for b in range(1, 513))
    return e_pre, e_dec


def table(profiles: dict[str, dict] | None = None) -> str:
    docs = profiles or derive_all()
    rows = ["| profile | TP | t_pre 1k (s) | t_pre 4k (s) | t_pre 1k on 8k hist (s) | t_dec b=1 ctx 1k (ms) "
            "| t_dec b=32 ctx 32x1k (ms) | t_kv 1k, same TP (ms) | KV capacity (tokens) | chunk |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, doc in docs.items():
        p = profile_from_dict(doc, name)
        for tp in p.tps:
            rows.append(
                f"| {name} | {tp} | {p.t_pre(tp, 0, 1000):.3f} | {p.t_pre(tp, 0, 4000):.3f} "
                f"| {p.t_pre(tp, 8000, 1000):.3f} | {p.t_dec(tp, 1, 1000) * 1e3:.1f} "
                f"| {p.t_dec(tp, 32, 32000) * 1e3:.1f} | {p.t_kv(1000, tp, tp) * 1e3:.2f} "
                f"| {p.kv_capacity_tokens(tp):,} | {p.prefill_chunk_tokens(tp)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ampd.perf.derive", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="directory to write the profile JSON files to")
    ap.add_argument("--table", action="store_true", help="print the key numbers as a Markdown table")
    ap.add_argument("--errors", action="store_true",
                    help="print the interpolation error of the pieces against the analytic model")
    args = ap.parse_args(argv)
    if not (args.out or args.table or args.errors):
        ap.error("give --out DIR, --table and/or --errors")
    if args.out:
        for p in write_all(args.out):
            print(p)
    if args.table:
        print(table())
    if args.errors:
        for m, h, tps in SHIPPED:
            for tp in tps:
                e_pre, e_dec = interpolation_error(m, h, tp)
                kp = roofline_knee(MODELS[m], HARDWARE[h], tp, prefill=True)
                kd = roofline_knee(MODELS[m], HARDWARE[h], tp)
                print(f"{m}@{h} tp{tp}: knee prefill {kp} decode {kd}; max error prefill {e_pre:.2%} "
                      f"decode {e_dec:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
