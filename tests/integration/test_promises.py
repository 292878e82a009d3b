"""KV promises shared by coordinators (ampd.state.promises) on a real Redis: a new session whose
record a lost coordinator left (its client opened it again through another coordinator before it
learnt the reattach token) replaces that record and its promise, and is told where the stale copy
is; a record whose coordinator lives, and a later turn's promise, add as before."""
from __future__ import annotations

import asyncio

from ampd.state.promises import Promised, Promises
from ampd.state.store import StateStore, connect

NS = "promises-test"


async def _fresh(redis_url: str, ns: str) -> tuple[StateStore, Promises]:
    store = StateStore(await connect(redis_url), ns)
    for k in [k async for k in store.r.scan_iter(match=f"{ns}:*")]:
        await store.r.delete(k)
    return store, Promises(store.r, ns, store.coordinator_key(""))


async def _lost_coordinators_copy(store: StateStore, p: Promises, sid: str, worker: str, tokens: int,
                                  coordinator: str = "lost-1") -> None:
    """What a coordinator leaves when it dies right after binding a session: its promise and record."""
    assert (await p.promise(sid, worker, tokens, 0, new=True)).made
    await store.update_session(sid, {"coordinator": coordinator, "decode_worker": worker, "secret": "old-secret"})


def test_a_session_opened_again_replaces_its_lost_coordinators_record_and_promise(redis_url):
    async def scenario():
        store, p = await _fresh(redis_url, NS)
        await _lost_coordinators_copy(store, p, "s", "decode-0", 1000)
        await p.promise("other", "decode-0", 300)  # another live session's promise stays
        # opened again through another coordinator, bound to the other worker
        out = await p.promise("s", "decode-1", 400, 0, new=True)
        assert out == Promised(True, "decode-0", "old-secret")
        assert await p.totals() == {"decode-0": 300, "decode-1": 400}
        assert await store.session_record("s") == {"promised_on": "decode-1", "promised": "400"}
        assert await p.release("s", delete_record=True) == 400
        assert await p.release("other", delete_record=True) == 300
        assert await p.totals() == {}  # (before: 1,000 stayed promised on decode-0 for good)
        await store.r.aclose()
    asyncio.run(scenario())


def test_on_the_same_worker_the_stale_promise_is_not_counted_against_the_new_one(redis_url):
    async def scenario():
        store, p = await _fresh(redis_url, NS)
        await _lost_coordinators_copy(store, p, "s", "decode-0", 900)
        # capacity 1,000: 900 stale + 600 would not fit, 600 alone does; the copy there is replaced by
        # the new binding itself (DecodeWorker.open), so none is named
        assert await p.promise("s", "decode-0", 600, 1000, new=True) == Promised(True)
        assert await p.totals() == {"decode-0": 600}
        # a refused promise leaves the stale one as it was (a later try finds it again)
        await _lost_coordinators_copy(store, p, "t", "decode-1", 900)
        await p.promise("v", "decode-1", 500)
        assert await p.promise("t", "decode-1", 600, 1000, new=True) == Promised(False)  # 1400 - 900 + 600
        assert await p.totals() == {"decode-0": 600, "decode-1": 1400}
        assert (await store.session_record("t"))["decode_worker"] == "decode-1"
        assert await p.promise("t", "decode-1", 400, 1000, new=True) == Promised(True)
        assert await p.totals() == {"decode-0": 600, "decode-1": 900}
        await store.r.aclose()
    asyncio.run(scenario())


def test_a_live_coordinators_record_and_a_later_turn_add_to_the_promise(redis_url):
    async def scenario():
        store, p = await _fresh(redis_url, NS)
        await store.coordinator_alive("alive-1", 30.0)
        await _lost_coordinators_copy(store, p, "s", "decode-0", 500, coordinator="alive-1")
        # (the same id opened through another coordinator while its own lives: not stale, as before)
        assert await p.promise("s", "decode-0", 100, 0, new=True) == Promised(True)
        await p.add("s", "decode-0", 50)  # a later turn
        assert await p.totals() == {"decode-0": 650}
        rec = await store.session_record("s")
        assert rec["coordinator"] == "alive-1" and rec["promised"] == "650"
        assert await p.release("s", delete_record=True) == 650
        await store.coordinator_gone("alive-1")
        # without the liveness prefix (a Promises of its own), a new promise adds too
        await _lost_coordinators_copy(store, p, "t", "decode-0", 500)
        assert await Promises(store.r, NS).promise("t", "decode-1", 100, 0, new=True) == Promised(True)
        assert await p.totals() == {"decode-0": 500, "decode-1": 100}
        await store.r.aclose()
    asyncio.run(scenario())
