"""Measure NixlTransport between two processes on this machine: `python -m ampd.kv.bench`.

Process A owns a pool filled with kv_pattern; process B READs from and WRITEs into it. Every case is
verified byte for byte (outside the timed region). Prints one line per case: median ms and GB/s of
the whole `await transport.read/write` (descriptor building, NIXL prep, transfer, polling).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import statistics
import time

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402

BPT = 1024  # bytes per token
BT = 16  # tokens per block (16 KiB blocks)
NUM_BLOCKS = 2048  # 32 MiB pools
SESSION = "bench"


def _serve(conn, name: str) -> None:
    from .pattern import kv_pattern, verify_pattern
    from .pool import KVPool, Segment
    from .transport import NixlTransport

    pool = KVPool(NUM_BLOCKS, BT, BPT)
    pool.buffer[:] = kv_pattern(SESSION, 0, pool.capacity_tokens, BPT)
    tr = NixlTransport(name, pool)
    conn.send((tr.metadata(), tr.layout.to_dict()))
    peer, md, layout = conn.recv()
    tr.add_peer(peer, md, layout)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg[0] == "verify":  # (segments as lists, start position of the pattern)
            segs = [Segment.from_list(x) for x in msg[1]]
            conn.send(verify_pattern(SESSION, msg[2], pool.read(segs), BPT))
        elif msg[0] == "notifs":
            deadline = time.monotonic() + 10
            got = []
            while not got and time.monotonic() < deadline:
                got = tr.poll_notifs()
                time.sleep(0.0005)
            conn.send(got)
    tr.close()
    conn.close()


def _cases(rng: random.Random) -> list[tuple[str, list, list]]:
    """(label, remote segments on A, local segments on B) of each timed case."""
    from .pool import Segment

    contig_r = [Segment(100 + i, 0, BT) for i in range(64)]  # 1 MiB, coalesces to 1 descriptor
    contig_l = [Segment(500 + i, 0, BT) for i in range(64)]
    blocks = rng.sample(range(NUM_BLOCKS), 1000)
    scat_tok_r = [Segment(b, rng.randrange(BT), 1) for b in blocks]  # 1000 x 1 KiB
    scat_tok_l = [Segment(i // BT, i % BT, 1) for i in range(1000)]
    scat_blk_r = [Segment(b, 0, BT) for b in blocks]  # 1000 x 16 KiB, shuffled
    local_blocks = list(range(NUM_BLOCKS))
    rng.shuffle(local_blocks)
    scat_blk_l = [Segment(b, 0, BT) for b in local_blocks[:1000]]
    return [
        ("1 MiB contiguous (64 blocks)", contig_r, contig_l),
        ("1000 scattered 1-token segments (1000 x 1 KiB)", scat_tok_r, scat_tok_l),
        ("1000 scattered blocks (1000 x 16 KiB)", scat_blk_r, scat_blk_l),
    ]


async def _median(reps: int, once, before=None) -> float:
    """Median seconds of ``reps`` awaits of ``once(i)``, after 3 untimed ones (i counts them all);
    ``before()``, untimed, runs before each."""
    times = []
    for i in range(reps + 3):
        if before is not None:
            before()
        t0 = time.perf_counter()
        await once(i)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _read_case(tr, pool, label: str, remote, local, reps: int) -> str:
    from .pattern import kv_pattern

    nbytes = sum(s.tokens for s in remote) * BPT
    exp = np.concatenate([kv_pattern(SESSION, s.block * BT + s.offset, s.tokens, BPT) for s in remote])
    zeros = np.zeros(nbytes, dtype=np.uint8)
    # zeros first, so that the check below sees this read's bytes
    med = await _median(reps, lambda i: tr.read("bench-a", remote, local), lambda: pool.write(local, zeros))
    bad = int(np.count_nonzero(pool.read(local) != exp))
    return f"READ  {label}: {med * 1e3:.3f} ms, {nbytes / med / 1e9:.2f} GB/s, mismatching bytes {bad}"


async def _write_case(tr, parent, label: str, remote, local, reps: int) -> str:
    """WRITEs the same bytes back to the same remote places (the pattern stays valid), the last one
    with a notification; A checks what landed, segment by segment, against the pattern."""
    nbytes = sum(s.tokens for s in remote) * BPT
    med = await _median(reps, lambda i: tr.write("bench-a", local, remote, b"w" if i == reps + 2 else b""))
    parent.send(("notifs",))
    got = parent.recv()
    bad = 0
    for s in remote[:50]:
        parent.send(("verify", [s.to_list()], s.block * BT + s.offset))
        bad += parent.recv()
    return (f"WRITE {label}: {med * 1e3:.3f} ms, {nbytes / med / 1e9:.2f} GB/s, "
            f"notif {got!r}, mismatching bytes (first 50 segs) {bad}")


async def _measure(reps: int) -> list[str]:
    from .pool import KVPool, PoolLayout
    from .ranges import pair_ranges
    from .transport import NixlTransport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, "bench-a"), daemon=True)
    proc.start()
    lines = []
    tr = None
    try:
        md_a, lay_a = parent.recv()
        pool = KVPool(NUM_BLOCKS, BT, BPT)
        tr = NixlTransport("bench-b", pool)
        t0 = time.perf_counter()
        tr.add_peer("bench-a", md_a, PoolLayout.from_dict(lay_a))
        t_add = time.perf_counter() - t0
        parent.send(("bench-b", tr.metadata(), tr.layout.to_dict()))
        assert parent.recv() == "ready"
        cases = _cases(random.Random(0))

        # first transfer after add_peer (connection warmed by make_connection in add_peer)
        t0 = time.perf_counter()
        await tr.read("bench-a", cases[0][1], cases[0][2])
        t_first = time.perf_counter() - t0
        lines.append(f"add_peer (make_connection + warm-up read): {t_add * 1e3:.2f} ms; "
                     f"first 1 MiB READ after it: {t_first * 1e3:.2f} ms")

        t0 = time.perf_counter()
        for _ in range(20):
            pair_ranges(pool.layout, cases[1][2], PoolLayout.from_dict(lay_a), cases[1][1])
        lines.append(f"pair_ranges for 1000 segments: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms")

        for label, remote, local in cases:
            lines.append(await _read_case(tr, pool, label, remote, local, reps))
            lines.append(await _write_case(tr, parent, label, remote, local, reps))
    finally:
        if tr is not None:
            tr.close()
        parent.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    for line in asyncio.run(_measure(args.reps)):
        print(line)


if __name__ == "__main__":
    main()
