"""`Profile`: the performance model of one model on one kind of hardware, per TP degree.

Pure apart from :func:`load_profile` reading a JSON file. The schema is documented in
docs/perf-model.md; in short (schema_version 1)::

    {"schema_version": 1, "name": "M@H", "model": "M", "hardware": "H",
     "kv_bytes_per_token": int,
     "t_kv": {"bytes_per_link": PIECEWISE, "links": "min_tp", "link": str},
     "tp": {"<tp>": {"kv_capacity_tokens": int, "prefill_chunk_tokens": int,
                     "t_pre": {"l_incr": PIECEWISE, "hist_s_per_token": float,
                               "attn_s_per_token2": float},
                     "t_dec": {"batch": PIECEWISE, "ctx_s_per_token": float}}, ...}}
    PIECEWISE = {"breakpoints": [...], "alpha": [...], "beta": [...]}

Cost functions (all in seconds):

* ``t_pre(tp, l_hist, l_incr) = P(l_incr) + hist * l_hist + attn * l_incr * (l_hist + l_incr / 2)``
* ``t_dec(tp, batch, context_tokens) = D(batch) + ctx * context_tokens``
* ``t_kv(tokens, src_tp, dst_tp) = K(tokens * kv_bytes_per_token / links(src_tp, dst_tp))``

and 0 when ``l_incr``, ``batch`` or ``tokens`` is 0.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Final, Mapping

from .piecewise import Piecewise

__all__ = ["SCHEMA_VERSION", "LINK_RULES", "Profile", "TPModel", "KVTransfer", "load_profile",
           "list_profiles", "profile_from_dict", "PROFILES_DIR"]

SCHEMA_VERSION: Final = 1
# (the package's directory, not this file's: compiled, this module lives in build/mypyc, ampd/compiled.py)
PROFILES_DIR = Path(importlib.import_module("ampd.perf").__path__[0]).resolve() / "profiles"

# How many links carry a KV transfer between a worker of degree src_tp and one of degree dst_tp.
LINK_RULES = {
    "min_tp": lambda s, d: min(s, d),   # one NIC per GPU; the smaller side's NICs are the limit
    "one": lambda s, d: 1,              # a single shared link whatever the degrees
}


@dataclass(frozen=True)
class TPModel:
    """The cost terms of one TP degree."""

    kv_capacity_tokens: int
    prefill_chunk_tokens: int
    pre: Piecewise               # P(l_incr)
    pre_hist_s_per_token: float  # per history token (reading the history KV)
    pre_attn_s_per_token2: float  # attention: per l_incr * (l_hist + l_incr / 2)
    dec: Piecewise               # D(batch)
    dec_ctx_s_per_token: float   # per context token in the batch (KV read + attention)

    def to_json(self) -> dict:
        return {
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "t_pre": {"l_incr": self.pre.to_json(), "hist_s_per_token": self.pre_hist_s_per_token,
                      "attn_s_per_token2": self.pre_attn_s_per_token2},
            "t_dec": {"batch": self.dec.to_json(), "ctx_s_per_token": self.dec_ctx_s_per_token},
        }


@dataclass(frozen=True)
class KVTransfer:
    """``t = K(bytes per link)``; ``links`` names a rule of :data:`LINK_RULES`."""

    bytes_per_link: Piecewise
    links: str = "min_tp"
    link: str = ""

    def to_json(self) -> dict:
        return {"bytes_per_link": self.bytes_per_link.to_json(), "links": self.links, "link": self.link}


class _Degree:
    """One TP degree's cost terms (``TPModel``), for ``Profile.t_pre`` and ``t_dec``."""

    __slots__ = ("pre", "hist", "attn", "dec", "ctx")

    def __init__(self, m: TPModel) -> None:
        self.pre = m.pre
        self.hist: float = float(m.pre_hist_s_per_token)
        self.attn: float = float(m.pre_attn_s_per_token2)
        self.dec = m.dec
        self.ctx: float = float(m.dec_ctx_s_per_token)


@dataclass(frozen=True, eq=False)
class Profile:
    name: str
    model: str
    hardware: str
    kv_bytes_per_token: int
    tp_models: Mapping[int, TPModel] = field(repr=False)
    kv_transfer: KVTransfer = field(repr=False)
    description: str = field(default="", repr=False)
    source: str = field(default="", repr=False)
    tps: tuple[int, ...] = field(init=False)
    # derived in __post_init__ (the cost functions' lookups)
    _deg: dict[int, _Degree] = field(init=False, repr=False)
    _cap: dict[int, int] = field(init=False, repr=False)
    _chunk: dict[int, int] = field(init=False, repr=False)
    _kv: dict[int, dict[int, float]] = field(init=False, repr=False)
    _kv_piece: Piecewise = field(init=False, repr=False)

    def __post_init__(self) -> None:
        tps = tuple(sorted(self.tp_models))
        if not tps:
            raise ValueError(f"profile {self.name}: no TP degree")
        setattr_ = object.__setattr__
        setattr_(self, "tp_models", dict(self.tp_models))
        setattr_(self, "tps", tps)
        if self.kv_transfer.links not in LINK_RULES:
            raise ValueError(f"profile {self.name}: t_kv.links {self.kv_transfer.links!r} is not one of "
                             f"{sorted(LINK_RULES)}")
        # Precomputed: evaluation is a dict lookup, a search and a few multiply-adds.
        deg, cap, chunk = {}, {}, {}
        for tp, m in self.tp_models.items():
            deg[tp] = _Degree(m)
            cap[tp] = m.kv_capacity_tokens
            chunk[tp] = m.prefill_chunk_tokens
        rule = LINK_RULES[self.kv_transfer.links]
        kv = {s: {d: self.kv_bytes_per_token / rule(s, d) for d in tps} for s in tps}
        k = self.kv_transfer.bytes_per_link
        setattr_(self, "_deg", deg)
        setattr_(self, "_cap", cap)
        setattr_(self, "_chunk", chunk)
        setattr_(self, "_kv", kv)
        setattr_(self, "_kv_piece", k)

    # -- errors --------------------------------------------------------------------------------
    def _unknown_tp(self, tp: Any, what: str = "tp") -> ValueError:
        return ValueError(f"{what} {tp!r} is not covered by profile {self.name} (tps {list(self.tps)})")

    # -- cost functions ------------------------------------------------------------------------
    # (token counts typed float: any number is taken, as by the Python source, where compiled)
    def t_pre(self, tp: int, l_hist: float, l_incr: float) -> float:
        """Seconds to prefill ``l_incr`` new tokens on top of ``l_hist`` history tokens at degree ``tp``."""
        try:
            d = self._deg[tp]
        except (KeyError, TypeError):
            raise self._unknown_tp(tp) from None
        if l_incr <= 0 or l_hist < 0:
            if l_incr == 0 and l_hist >= 0:
                return 0.0
            raise ValueError(f"t_pre: l_hist and l_incr must be >= 0, got l_hist={l_hist} l_incr={l_incr}")
        return d.pre.at(l_incr) + d.hist * l_hist + d.attn * l_incr * (l_hist + 0.5 * l_incr)

    def t_dec(self, tp: int, batch: float, context_tokens: float) -> float:
        """Seconds for one decode step of ``batch`` sequences whose contexts sum to ``context_tokens``."""
        try:
            d = self._deg[tp]
        except (KeyError, TypeError):
            raise self._unknown_tp(tp) from None
        if batch <= 0 or context_tokens < 0:
            if batch == 0 and context_tokens >= 0:
                return 0.0
            raise ValueError(f"t_dec: batch and context_tokens must be >= 0, got batch={batch} "
                             f"context_tokens={context_tokens}")
        return d.dec.at(batch) + d.ctx * context_tokens

    def t_kv(self, tokens: float, src_tp: int, dst_tp: int) -> float:
        """Seconds to move the KV of ``tokens`` tokens from a degree-``src_tp`` to a degree-``dst_tp`` worker."""
        try:
            row = self._kv[src_tp]
        except (KeyError, TypeError):
            raise self._unknown_tp(src_tp, "src_tp") from None
        try:
            per_token = row[dst_tp]
        except (KeyError, TypeError):
            raise self._unknown_tp(dst_tp, "dst_tp") from None
        if tokens <= 0:
            if tokens == 0:
                return 0.0
            raise ValueError(f"t_kv: tokens must be >= 0, got {tokens}")
        return self._kv_piece.at(tokens * per_token)

    def kv_capacity_tokens(self, tp: int) -> int:
        """KV tokens one replica of degree ``tp`` can hold."""
        try:
            return self._cap[tp]
        except (KeyError, TypeError):
            raise self._unknown_tp(tp) from None

    def prefill_chunk_tokens(self, tp: int) -> int:
        """Chunk size (tokens) for chunked local prefill at degree ``tp``."""
        try:
            return self._chunk[tp]
        except (KeyError, TypeError):
            raise self._unknown_tp(tp) from None

    # -- serialisation -------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "model": self.model,
            "hardware": self.hardware,
            "description": self.description,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "t_kv": self.kv_transfer.to_json(),
            "tp": {str(tp): self.tp_models[tp].to_json() for tp in self.tps},
        }


# ---------------------------------------------------------------------------------------------
# Parsing and validation
# ---------------------------------------------------------------------------------------------

class _Bad(ValueError):
    pass


def _get(d: Any, key: str, where: str) -> Any:
    if not isinstance(d, dict):
        raise _Bad(f"field '{where}': expected an object")
    if key not in d:
        raise _Bad(f"field '{where + '.' if where else ''}{key}': missing")
    return d[key]


def _num(v: Any, where: str, *, nonneg: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Bad(f"field '{where}': expected a finite number, got {v!r}")
    if nonneg and v < 0:
        raise _Bad(f"field '{where}': must be >= 0, got {v!r}")
    return float(v)


def _int(v: Any, where: str, *, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Bad(f"field '{where}': expected an integer, got {v!r}")
    if v < minimum:
        raise _Bad(f"field '{where}': must be >= {minimum}, got {v!r}")
    return v


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise _Bad(f"field '{where}': expected a non-empty string, got {v!r}")
    return v


def _piecewise(d: Any, where: str) -> Piecewise:
    vals = {}
    for key in ("breakpoints", "alpha", "beta"):
        arr = _get(d, key, where)
        if not isinstance(arr, list):
            raise _Bad(f"field '{where}.{key}': expected a list, got {arr!r}")
        vals[key] = tuple(_num(v, f"{where}.{key}[{i}]", nonneg=(key == "breakpoints"))
                          for i, v in enumerate(arr))
    try:
        return Piecewise(vals["breakpoints"], vals["alpha"], vals["beta"])
    except ValueError as e:  # message is "<sub-field>: <problem>"
        sub, _, msg = str(e).partition(": ")
        raise _Bad(f"field '{where}.{sub}': {msg}") from None


def _parse(data: Any) -> Profile:
    if not isinstance(data, dict):
        raise _Bad("field '': expected a JSON object at the top level")
    ver = _get(data, "schema_version", "")
    if ver != SCHEMA_VERSION:
        raise _Bad(f"field 'schema_version': expected {SCHEMA_VERSION}, got {ver!r}")
    name = _str(_get(data, "name", ""), "name")
    model = _str(_get(data, "model", ""), "model")
    hardware = _str(_get(data, "hardware", ""), "hardware")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise _Bad("field 'description': expected a string")
    kvb = _int(_get(data, "kv_bytes_per_token", ""), "kv_bytes_per_token", minimum=1)
    tkv = _get(data, "t_kv", "")
    links = _get(tkv, "links", "t_kv")
    if links not in LINK_RULES:
        raise _Bad(f"field 't_kv.links': expected one of {sorted(LINK_RULES)}, got {links!r}")
    link = tkv.get("link", "") if isinstance(tkv, dict) else ""
    if not isinstance(link, str):
        raise _Bad("field 't_kv.link': expected a string")
    kv_transfer = KVTransfer(_piecewise(_get(tkv, "bytes_per_link", "t_kv"), "t_kv.bytes_per_link"),
                             links, link)
    tp_block = _get(data, "tp", "")
    if not isinstance(tp_block, dict) or not tp_block:
        raise _Bad("field 'tp': expected a non-empty object keyed by TP degree")
    tp_models = {}
    for key, block in tp_block.items():
        w = f"tp.{key}"
        if not (isinstance(key, str) and key.isdigit() and int(key) >= 1):
            raise _Bad(f"field '{w}': TP degree must be a positive integer")
        pre = _get(block, "t_pre", w)
        dec = _get(block, "t_dec", w)
        tp_models[int(key)] = TPModel(
            kv_capacity_tokens=_int(_get(block, "kv_capacity_tokens", w), f"{w}.kv_capacity_tokens",
                                    minimum=1),
            prefill_chunk_tokens=_int(_get(block, "prefill_chunk_tokens", w),
                                      f"{w}.prefill_chunk_tokens", minimum=1),
            pre=_piecewise(_get(pre, "l_incr", f"{w}.t_pre"), f"{w}.t_pre.l_incr"),
            pre_hist_s_per_token=_num(_get(pre, "hist_s_per_token", f"{w}.t_pre"),
                                      f"{w}.t_pre.hist_s_per_token"),
            pre_attn_s_per_token2=_num(_get(pre, "attn_s_per_token2", f"{w}.t_pre"),
                                       f"{w}.t_pre.attn_s_per_token2"),
            dec=_piecewise(_get(dec, "batch", f"{w}.t_dec"), f"{w}.t_dec.batch"),
            dec_ctx_s_per_token=_num(_get(dec, "ctx_s_per_token", f"{w}.t_dec"),
                                     f"{w}.t_dec.ctx_s_per_token"),
        )
    return Profile(name=name, model=model, hardware=hardware, kv_bytes_per_token=kvb,
                   tp_models=tp_models, kv_transfer=kv_transfer, description=description)


def profile_from_dict(data: Any, source: str = "<dict>") -> Profile:
    """Build a :class:`Profile` from parsed JSON; ``ValueError("<source>: field 'x.y': ...")`` if malformed."""
    try:
        p = _parse(data)
    except _Bad as e:
        raise ValueError(f"{source}: {e}") from None
    object.__setattr__(p, "source", source)
    return p


# ---------------------------------------------------------------------------------------------
# Shipped profiles
# ---------------------------------------------------------------------------------------------

def list_profiles() -> list[str]:
    """Names (MODEL@HARDWARE) of the shipped profiles, sorted."""
    return sorted(p.name[: -len(".json")] for p in PROFILES_DIR.glob("*@*.json"))


def _load_file(path: Path) -> Profile:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read profile file: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    return profile_from_dict(data, str(path))


@lru_cache(maxsize=None)
def _load_shipped(name: str) -> Profile:
    return _load_file(PROFILES_DIR / f"{name}.json")


def load_profile(name_or_path: str | os.PathLike) -> Profile:
    """A shipped profile by name (``"qwen3-32b@h20"``) or a profile JSON file by path."""
    s = os.fspath(name_or_path)
    shipped = list_profiles()
    if s in shipped:
        return _load_shipped(s)
    looks_like_path = s.endswith(".json") or os.sep in s or (os.altsep and os.altsep in s)
    if looks_like_path or os.path.isfile(s):
        return _load_file(Path(s))
    raise ValueError(f"unknown profile {s!r}: not a shipped profile ({', '.join(shipped)}) "
                     f"and not a file")
