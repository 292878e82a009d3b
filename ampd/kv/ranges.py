"""Pair two segment lists (possibly different block sizes) into matching byte ranges.

Both lists cover the same number of tokens in the same order. Walk them in parallel, cut at every
segment boundary of either side, turn each piece into absolute (address, length) on both sides, and
merge consecutive pieces that are contiguous on both sides. Vectorized with numpy.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .pool import PoolLayout, Segment, segments_to_arrays

__all__ = ["pair_ranges"]


# Segment counts (both sides) up to which pair_ranges walks them in Python. Its numpy path costs
# ~25 calls whatever the count: in a worker's loop (cold caches) ~120-140 us for a round's 16 or
# 64 segments, where this walk costs ~1 us a segment (measured on the remote prefill's path).
PY_BELOW = 512


def _runs(layout: PoolLayout, segments: Sequence[Segment], what: str) -> list[tuple[int, int]]:
    """(absolute start address, tokens) of each non-empty segment; raises as _starts does."""
    bt, bpt, nb, base = layout.block_tokens, layout.bytes_per_token, layout.num_blocks, layout.base_addr
    out = []
    for s in segments:
        b, o, t = s.block, s.offset, s.tokens
        if b < 0 or b >= nb or o < 0 or t < 0 or o + t > bt:
            layout.check_segments(segments, what)  # raises, naming the first bad one
        if t:
            out.append((base + (b * bt + o) * bpt, t))
    return out


def _pair_py(
    local_layout: PoolLayout, local: Sequence[Segment], remote_layout: PoolLayout, remote: Sequence[Segment]
) -> tuple[np.ndarray, np.ndarray]:
    """pair_ranges for few segments: one walk over both sides, coalescing as it goes."""
    lr = _runs(local_layout, local, "local segment")
    rr = _runs(remote_layout, remote, "remote segment")
    lt, rt = sum(t for _, t in lr), sum(t for _, t in rr)
    if lt != rt:
        raise ValueError(f"local segments cover {lt} tokens, remote {rt}")
    bpt = local_layout.bytes_per_token
    laddrs: list[int] = []
    raddrs: list[int] = []
    sizes: list[int] = []
    if lt:
        i = j = 0
        (la, ln), (ra, rn) = lr[0], rr[0]
        while True:
            n = ln if ln < rn else rn
            nbytes = n * bpt
            if sizes and laddrs[-1] + sizes[-1] == la and raddrs[-1] + sizes[-1] == ra:
                sizes[-1] += nbytes  # contiguous on both sides: the same descriptor
            else:
                laddrs.append(la)
                raddrs.append(ra)
                sizes.append(nbytes)
            la, ra, ln, rn = la + nbytes, ra + nbytes, ln - n, rn - n
            if not ln:
                i += 1
                if i == len(lr):
                    break
                la, ln = lr[i]
            if not rn:
                j += 1
                ra, rn = rr[j]
    lout = np.zeros((len(sizes), 3), dtype=np.uint64)
    rout = np.zeros((len(sizes), 3), dtype=np.uint64)
    lout[:, 0], lout[:, 1] = laddrs, sizes
    rout[:, 0], rout[:, 1] = raddrs, sizes
    return lout, rout


def _starts(
    layout: PoolLayout, segments: Sequence[Segment], what: str
) -> tuple[np.ndarray, np.ndarray]:
    """(absolute start address of each non-empty segment, cumulative token end of each)."""
    b, o, t = segments_to_arrays(segments)
    layout.check_arrays(b, o, t, what=what)
    keep = t > 0
    b, o, t = b[keep], o[keep], t[keep]
    addr = layout.base_addr + (b * layout.block_tokens + o) * layout.bytes_per_token
    return addr.astype(np.uint64), np.cumsum(t)


def pair_ranges(
    local_layout: PoolLayout,
    local: Sequence[Segment],
    remote_layout: PoolLayout,
    remote: Sequence[Segment],
) -> tuple[np.ndarray, np.ndarray]:
    """Two (N, 3) uint64 arrays of (addr, nbytes, dev=0) rows, row i of one matching row i of the other.

    Raises ValueError when the segments leave their layouts, the two sides cover different token
    counts, or the layouts have different bytes_per_token.
    """
    if local_layout.bytes_per_token != remote_layout.bytes_per_token:
        raise ValueError(
            f"bytes_per_token differ: local {local_layout.bytes_per_token}, "
            f"remote {remote_layout.bytes_per_token}"
        )
    if len(local) + len(remote) <= PY_BELOW:
        return _pair_py(local_layout, local, remote_layout, remote)
    la, lend = _starts(local_layout, local, "local segment")
    ra, rend = _starts(remote_layout, remote, "remote segment")
    lt = int(lend[-1]) if len(lend) else 0
    rt = int(rend[-1]) if len(rend) else 0
    if lt != rt:
        raise ValueError(f"local segments cover {lt} tokens, remote {rt}")
    if lt == 0:
        empty = np.empty((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    bpt = local_layout.bytes_per_token
    if len(lend) == len(rend) and np.array_equal(lend, rend):
        # Both sides cut at the same tokens (equal block sizes and alignment: the usual case), so
        # the pieces are the segments: no merge of the cuts (a dozen numpy calls, ~20 us).
        laddr, raddr = la, ra
        nbytes = (np.diff(lend, prepend=0) * bpt).astype(np.uint64)
        return _coalesced(laddr, raddr, nbytes)
    # piece boundaries (token index in the stream) = union of both sides' segment ends
    # (np.union1d would do, but its first call in a process costs ~25 ms of lazy imports)
    cuts = np.sort(np.concatenate((lend, rend)), kind="stable")
    if len(cuts) > 1:
        cuts = cuts[np.concatenate(([True], cuts[1:] != cuts[:-1]))]  # sorted, unique, last == total
    pstart = np.concatenate(([0], cuts[:-1]))
    plen = cuts - pstart
    li = np.searchsorted(lend, pstart, side="right")
    ri = np.searchsorted(rend, pstart, side="right")
    lseg_start = np.concatenate(([0], lend))[li]  # token index where local segment li begins
    rseg_start = np.concatenate(([0], rend))[ri]
    laddr = la[li] + ((pstart - lseg_start) * bpt).astype(np.uint64)
    raddr = ra[ri] + ((pstart - rseg_start) * bpt).astype(np.uint64)
    nbytes = (plen * bpt).astype(np.uint64)
    return _coalesced(laddr, raddr, nbytes)


def _coalesced(laddr: np.ndarray, raddr: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # coalesce: a piece continues the previous run when contiguous on both sides
    if len(nbytes) > 1:
        cont = np.empty(len(nbytes), dtype=bool)
        cont[0] = False
        cont[1:] = (laddr[1:] == laddr[:-1] + nbytes[:-1]) & (raddr[1:] == raddr[:-1] + nbytes[:-1])
        heads = np.flatnonzero(~cont)
        laddr, raddr = laddr[heads], raddr[heads]
        nbytes = np.add.reduceat(nbytes, heads)
    n = len(nbytes)
    lout = np.zeros((n, 3), dtype=np.uint64)
    rout = np.zeros((n, 3), dtype=np.uint64)
    lout[:, 0], lout[:, 1] = laddr, nbytes
    rout[:, 0], rout[:, 1] = raddr, nbytes
    return lout, rout
