"""The coordinator follows the workers' statistics on the Redis channel (push mode): a view reads
the latest of each worker, parsed only then, and every publication's delivery lag is recorded."""
from __future__ import annotations

import asyncio
import json
import time

from ampd.state import StateStore, WorkerStats, connect
from ampd.state.cluster import Cluster
from ampd.state.store import WorkerInfo


def _stats(wid: str, ts: float, queue_s: float) -> WorkerStats:
    return WorkerStats(wid, ts, None, (), queue_s, 1000)


async def _follow(redis_url: str) -> None:
    store = StateStore(await connect(redis_url), f"follow{time.time_ns()}")
    now = time.time()
    for wid, kind in (("prefill-0", "prefill"), ("decode-0", "decode")):
        await store.register_worker(WorkerInfo(wid, kind, "127.0.0.1:1", 1, f"{wid}-1", {}, 64), b"",
                                    _stats(wid, now, 0.0), 30.0)
    cluster = Cluster(store, "push")
    await cluster.start()
    try:
        for i in range(1, 6):  # one worker publishing faster than decisions are taken
            await store.publish_stats(_stats("prefill-0", now + i * 1e-3, float(i)))
        await store.publish_stats(_stats("decode-0", now + 0.01, 7.0))
        for _ in range(200):  # until all six came
            if len(cluster.lag_s) >= 6:
                break
            await asyncio.sleep(0.01)
        assert len(cluster.lag_s) == 6  # every publication's lag, parsed or not
        assert set(cluster._unparsed) == {"prefill-0", "decode-0"}  # only the latest of each waits
        view = await cluster.view()
        assert not cluster._unparsed
        assert [p.queue_predicted_s for p in view.prefill] == [5.0]
        assert view.decode["decode-0"].queue_predicted_s == 7.0
        # one published out of order (older than the one in the view) does not replace it
        await store.publish_stats(_stats("prefill-0", now + 2e-3, 2.0))
        await store.publish_stats(_stats("decode-0", now + 0.02, 8.0))  # (the channel's order: after it)
        for _ in range(200):
            if len(cluster.lag_s) >= 8:
                break
            await asyncio.sleep(0.01)
        view = await cluster.view()
        assert [p.queue_predicted_s for p in view.prefill] == [5.0]
        assert view.decode["decode-0"].queue_predicted_s == 8.0
        # a worker whose call failed is back in routing once it publishes again
        cluster.mark_lost("prefill-0")
        assert not (await cluster.view()).prefill
        await store.publish_stats(_stats("prefill-0", time.time() + 1.0, 3.0))
        for _ in range(200):
            if "prefill-0" not in cluster.lost:
                break
            await asyncio.sleep(0.01)
        assert [p.queue_predicted_s for p in (await cluster.view()).prefill] == [3.0]
        # a publication whose fields come in another order (another version's) is parsed as it comes
        d = vars(_stats("decode-0", time.time() + 1.0, 9.0))
        await store.r.publish(store.k_stats, json.dumps(dict(reversed(d.items()))))
        for _ in range(200):
            if len(cluster.lag_s) >= 10:
                break
            await asyncio.sleep(0.01)
        assert "decode-0" not in cluster._unparsed
        assert (await cluster.view()).decode["decode-0"].queue_predicted_s == 9.0
    finally:
        await cluster.stop()
        await store.r.aclose()


def test_a_view_reads_the_latest_publication_of_each_worker(redis_url):
    asyncio.run(_follow(redis_url))


async def _concurrent(redis_url: str) -> None:
    store = StateStore(await connect(redis_url), f"follow{time.time_ns()}")
    now = time.time()
    info = WorkerInfo("decode-0", "decode", "127.0.0.1:1", 1, "decode-0-1", {}, 64)
    await store.register_worker(info, b"", _stats("decode-0", now, 0.0), 30.0)
    cluster = Cluster(store, "push")
    await cluster.refresh_infos()  # (no channel followed: publications are handed in below)
    try:
        cluster._arrived(_stats("decode-0", now, 0.0).to_json().encode())
        assert (await cluster.view()).decode["decode-0"].queue_predicted_s == 0.0
        # a worker the cluster does not know yet, then a known one's newer statistics
        late = WorkerInfo("prefill-1", "prefill", "127.0.0.1:2", 1, "prefill-1-1", {}, 64)
        await store.register_worker(late, b"", _stats("prefill-1", now, 0.0), 30.0)
        cluster._arrived(_stats("prefill-1", now + 1e-3, 4.0).to_json().encode())
        cluster._arrived(_stats("decode-0", now + 1e-3, 7.0).to_json().encode())
        # a second decision while the first reads the registry for prefill-1
        first, second = await asyncio.gather(cluster.view(), cluster.view())
        assert first.decode["decode-0"].queue_predicted_s == 7.0
        assert second.decode["decode-0"].queue_predicted_s == 7.0
        assert [p.queue_predicted_s for p in first.prefill] == [4.0]
    finally:
        await store.r.aclose()


def test_a_decision_during_a_registry_read_sees_the_known_workers_latest(redis_url):
    asyncio.run(_concurrent(redis_url))


def test_an_older_reordered_publication_keeps_a_newer_queued_one():
    now = time.time()
    cluster = Cluster(store=None, mode="push")
    cluster.infos["decode-0"] = WorkerInfo("decode-0", "decode", "127.0.0.1:1", 1, "decode-0-1", {}, 64)
    cluster._arrived(_stats("decode-0", now + 2.0, 8.0).to_json().encode())  # queued, not parsed
    d = vars(_stats("decode-0", now + 1.0, 5.0))  # older, its fields in another order: parsed now
    cluster._arrived(json.dumps(dict(reversed(d.items()))).encode())
    view = asyncio.run(cluster.view())
    assert view.decode["decode-0"].queue_predicted_s == 8.0
