"""Binding to the decode worker that holds the longest prefix, live (--prefix-sharing): the rule the
simulator shares (ampd.policy.prefixbind.rebind_prefix), what a decode worker publishes
(ampd.state.prefixes, services/decode/prefixpub.py) and the coordinator's choice
(services/coordinator/prefixes.py) through admission (services/coordinator/admission.py)."""
from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest
import redis

from ampd.policy import WorkerView
from ampd.policy.prefixbind import MOVE_MIN_BLOCKS, leading, prefix_seed, rebind_prefix
from ampd.state import WorkerInfo
from ampd.state.prefixes import PrefixSets, prefix_delta, prefix_key
from ampd.state.store import StateStore, registry_key
from ampd.policy.prefixindex import PrefixIndex, prefix_hashes
from services.coordinator.admission import Admission
from services.coordinator.prefixes import THREAD_TOKENS, PrefixChoice, prefix_choice, prompt_hashes
from services.decode.prefixpub import PrefixPublisher

BT = 16


def view(wid: str, free: int = 10_000, itl: float | None = None) -> WorkerView:
    return WorkerView(wid, "decode", 1, itl, (), free)


def info(wid: str, sharing: bool = True, bt: int = BT, seed: int = 0, kind: str = "decode") -> WorkerInfo:
    return WorkerInfo(wid, kind, "x:1", 1, "", {"block_tokens": bt}, 10_000, prefix_sharing=sharing, prefix_seed=seed)


# ------------------------------------------------------------------------------------- the rule
def test_leading_counts_the_held_blocks_before_the_first_missing_one():
    assert leading([1, 1, 0, 1]) == 2 and leading([]) == 0 and leading([0, 1]) == 0 and leading([True] * 3) == 3


def test_rebind_keeps_admissions_worker_unless_another_holds_move_min_blocks_more():
    ws = [view("d0"), view("d1")]
    assert rebind_prefix("d0", ws, {"d0": 0, "d1": MOVE_MIN_BLOCKS - 1}, BT, {"d0": 100}, 100) == ("d0", 0)
    assert rebind_prefix("d0", ws, {"d0": 2, "d1": 2 + MOVE_MIN_BLOCKS}, BT, {"d0": 100}, 100) == ("d1", 6)
    assert rebind_prefix("d0", ws, {}, BT, {"d0": 100}, 100) == ("d0", 0)
    # a system prompt every worker holds does not pull sessions onto one
    assert rebind_prefix("d1", ws, {"d0": 40, "d1": 40}, BT, {"d1": 100}, 100) == ("d1", 40)


def test_rebind_does_not_move_a_session_where_it_does_not_fit_or_the_itl_slo_is_missed():
    m = {"d0": 0, "d1": 10}
    # d1 has 500 free net of its promises; the session needs 1000 less its 160 shared tokens
    assert rebind_prefix("d0", [view("d0"), view("d1", 500)], m, BT, {"d0": 1000}, 1000)[0] == "d0"
    assert rebind_prefix("d0", [view("d0"), view("d1", 900)], m, BT, {"d0": 1000}, 1000)[0] == "d1"
    slow = [view("d0"), view("d1", itl=0.2)]
    assert rebind_prefix("d0", slow, m, BT, {"d0": 1000}, 1000, itl_slo_s=0.1)[0] == "d0"
    assert rebind_prefix("d0", slow, m, BT, {"d0": 1000}, 1000, itl_slo_s=0.3)[0] == "d1"


def test_prefix_seed_is_zero_for_the_mock_and_differs_between_models():
    assert prefix_seed("") == 0
    assert prefix_seed("qwen3") != prefix_seed("llama") and prefix_seed("qwen3") == prefix_seed("qwen3")


# ------------------------------------------------------------------------------ what is published
def test_prefix_delta_is_what_turns_the_published_set_into_the_index():
    assert prefix_delta({1, 2, 3}, [2, 3, 4, 5]) == ([4, 5], [1])
    assert prefix_delta(set(), []) == ([], [])
    assert prefix_delta({7}, []) == ([], [7])


def _runtime(r: redis.asyncio.Redis, ns: str) -> SimpleNamespace:
    return SimpleNamespace(store=StateStore(r, ns), registrations=1,
                           cfg=SimpleNamespace(worker_id="d0", liveness_ttl_s=3.0))


def test_the_publisher_writes_the_indexed_hashes_in_batches_and_deregistering_deletes_them(redis_url):
    tokens = list(range(5 * BT + 3))

    async def go():
        r = redis.asyncio.Redis.from_url(redis_url)
        rt = _runtime(r, "pub")
        ix = PrefixIndex(BT, seed=9)
        pub = PrefixPublisher(rt, ix)
        key = prefix_key("pub", "d0")
        await r.hset(rt.store.k_workers, "d0", info("d0").to_json())  # registered: its writes land
        assert await pub.flush() is True and await r.exists(key) == 0  # (the first write replaces: nothing)
        assert await pub.flush() is False  # nothing changed
        ix.share("a", prefix_hashes(tokens, BT, 9))
        assert ix.publish("a", tokens, list(range(6))) == 5
        assert await pub.flush() is True
        hashes = prefix_hashes(tokens, BT, 9)
        assert {int(x) for x in await r.smembers(key)} == set(hashes)
        assert 0 < await r.pttl(key) <= 3000
        sets = PrefixSets(r, "pub")
        other = tokens[:2 * BT] + [999] * (3 * BT + 1)
        assert await sets.matches({"d0": prefix_hashes(other, BT, 9), "d9": hashes}) == {"d0": 2, "d9": 0}
        assert await sets.matches({"d0": prefix_hashes(tokens, BT, 0)}) == {"d0": 0}  # another model's
        ix.release("a")  # cached: still held
        assert await pub.flush() is False
        assert len(ix.reclaim(2)) == 2  # the cache's oldest blocks taken back: gone from the set
        assert await pub.flush() is True and await r.scard(key) == 3
        # a swap that keeps the index's size and reclaims nothing (a truncate drops c's block as d
        # publishes one) is written at the next step too: the index counts every hash in and out
        c, d = [7] * BT + [0], [8] * BT + [0]
        ix.share("c", prefix_hashes(c, BT, 9))
        ix.publish("c", c, [100])
        assert await pub.flush() is True and await r.scard(key) == 4
        ix.share("d", prefix_hashes(d, BT, 9))
        assert ix.truncate("c", 0) == ([100], None) and ix.publish("d", d, [101]) == 1
        assert len(ix.hashes()) == 4 and ix.reclaimed_blocks == 2
        assert await pub.flush() is True
        assert {int(x) for x in await r.smembers(key)} == set(hashes[2:]) | set(prefix_hashes(d, BT, 9))
        ix.release("c")
        ix.release("d")
        assert len(ix.reclaim(1)) == 1 and await pub.flush() is True and await r.scard(key) == 3
        rt.registrations = 2  # registered again (a restarted Redis): the set is written whole
        await r.delete(key)
        assert await pub.flush() is True and await r.scard(key) == 3
        await rt.store.deregister_worker("d0")
        assert await r.exists(key) == 0
        # a write still on its way when the worker deregistered does not bring the set back
        ix.share("e", prefix_hashes(c, BT, 9))
        ix.publish("e", c, [102])
        assert await pub.flush() is False and await r.exists(key) == 0
        assert await sets.write("d0", prefix_hashes(c, BT, 9), [], 3.0, full=True) is False
        assert await r.exists(key) == 0
        await r.aclose()

    asyncio.run(go())


# ----------------------------------------------------------------------------- the coordinator's
def test_prompt_hashes_only_for_sharing_decode_workers_in_their_own_block_size_and_seed():
    tokens = list(range(4 * BT + 1))
    infos = {"d0": info("d0"), "d1": info("d1", bt=8, seed=5), "d2": info("d2", sharing=False),
             "p0": info("p0", kind="prefill")}
    got = prompt_hashes(infos, tokens)
    assert set(got) == {"d0", "d1"}
    assert got["d0"] == prefix_hashes(tokens, BT) and len(got["d0"]) == 4
    assert got["d1"] == prefix_hashes(tokens, 8, 5) and len(got["d1"]) == 8
    assert prompt_hashes(infos, tokens[:BT]) == {"d0": [], "d1": prefix_hashes(tokens[:BT], 8, 5)}


def test_a_prefix_choice_moves_the_promise_through_admission_and_counts_its_reason():
    async def rooms():
        return [view("d0", 1000), view("d1", 1000)], []

    async def go():
        adm = Admission(0.0, 8)
        counters: Counter = Counter()
        assert await adm.admit(300, rooms, 10) == "d0"  # d0 and d1 even: d0 (the worker order)
        # the next goes to d1 by KV, but d0 holds 5 blocks of its prompt more
        choice = PrefixChoice("s", {"d0": 5, "d1": 0}, {"d0": BT, "d1": BT}, None, counters)
        assert await adm.admit(300, rooms, 10, prefer=choice) == "d0"
        assert adm.promised == {"d0": 600} and adm.sessions == {"d0": 2}
        assert counters == {"bind_prefix": 1, "bind_prefix_tokens": 5 * BT}
        # one block more is not worth leaving admission's worker (MOVE_MIN_BLOCKS)
        choice = PrefixChoice("t", {"d0": 1, "d1": 0}, {"d0": BT, "d1": BT}, None, counters)
        assert await adm.admit(300, rooms, 10, prefer=choice) == "d1"
        assert counters["bind_admission"] == 1
        # the holder has no room left for it (100 free, 300 needed less 9 shared blocks): admission's choice stands
        adm.add("d0", 300)
        choice = PrefixChoice("u", {"d0": 9, "d1": 0}, {"d0": BT, "d1": BT}, None, counters)
        assert await adm.admit(300, rooms, 10, prefer=choice) == "d1"
        assert adm.promised == {"d0": 900, "d1": 600} and counters["bind_admission"] == 2

    asyncio.run(go())


def test_a_redis_that_does_not_answer_binds_without_the_prefix(redis_url):
    async def go():
        dead = redis.asyncio.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
        got = await prefix_choice(PrefixSets(dead, "x"), {"d0": info("d0")}, "s", list(range(3 * BT)), None,
                                  Counter())
        assert got is None
        r = redis.asyncio.Redis.from_url(redis_url)
        assert await prefix_choice(PrefixSets(r, "x"), {"d0": info("d0", sharing=False)}, "s",
                                   list(range(3 * BT)), None, Counter()) is None
        got = await prefix_choice(PrefixSets(r, "x"), {"d0": info("d0")}, "s", list(range(3 * BT)), 0.1, Counter())
        assert got is not None and got.matched == {"d0": 0} and got.itl_slo_s == 0.1
        long = list(range(THREAD_TOKENS + 5 * BT))  # hashed in a thread: the same hashes
        await r.hset(registry_key("x"), "d0", info("d0").to_json())  # (a worker writes its set while registered)
        assert await PrefixSets(r, "x").write("d0", prefix_hashes(long, BT)[:7], [], 3.0, full=True)
        got = await prefix_choice(PrefixSets(r, "x"), {"d0": info("d0")}, "s", long, None, Counter())
        assert got is not None and got.matched == {"d0": 7}
        await r.delete(prefix_key("x", "d0"), registry_key("x"))
        await r.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("bad", [0, -1, "x", None])
def test_a_worker_registered_without_a_usable_block_size_is_not_matched(bad):
    infos = {"d0": info("d0"), "d1": WorkerInfo("d1", "decode", "x:1", 1, "", {"block_tokens": bad}, 1, prefix_sharing=True)}
    assert set(prompt_hashes(infos, list(range(3 * BT)))) == {"d0"}
