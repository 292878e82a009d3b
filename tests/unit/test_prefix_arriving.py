"""Binding follows prefix blocks still being prefilled (ampd.policy.arriving): a session bound to a
worker counts its prompt's blocks as arriving there until they land, so a second session with the same
prefix that arrives meanwhile binds there (live: services/coordinator/prefixes.py; the simulator:
ampd/sim/prefixing.py), and never changes a token (it prefills what is not indexed yet)."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import redis

from ampd.policy import WorkerView
from ampd.policy.arriving import Arriving, with_arriving
from ampd.policy.prefixbind import MOVE_MIN_BLOCKS, prefix_hashes, rebind_prefix
from ampd.sim import simulate
from ampd.state import WorkerInfo
from ampd.state.prefixes import PrefixSets, prefix_key
from ampd.workload import Round, Session
from ampd.workload.mooncake import HASH_BLOCK_TOKENS
from services.coordinator.admission import Admission
from services.coordinator.prefixes import prefix_choice

from test_sim import _profile

BT = 16
H = [11, 12, 13, 14, 15, 16]


def view(wid: str, free: int = 10_000) -> WorkerView:
    return WorkerView(wid, "decode", 1, None, (), free)


# ------------------------------------------------------------------------------------- pure
def test_blocks_arrive_from_the_binding_until_they_land_the_session_goes_or_the_ttl_passes():
    a = Arriving(ttl_s=10.0, grace_s=1.0)
    a.bound("s", "d0", H[:4], now=0.0)
    assert a.matches({"d0": H, "d1": H}, 1.0) == {"d0": 4}
    assert a.matches({"d0": [99, *H]}, 1.0) == {}  # leading blocks only
    a.landed("s", now=2.0)  # its first token: counted only until the worker has published
    assert a.matches({"d0": H}, 2.9) == {"d0": 4}
    assert a.matches({"d0": H}, 3.0) == {} and len(a) == 0
    a.bound("s", "d0", H[:4], now=5.0)
    assert a.matches({"d0": H}, 14.9) == {"d0": 4}
    assert a.matches({"d0": H}, 15.0) == {}  # the TTL: a lost first token stops pulling sessions
    a.bound("s", "d0", H[:4], now=20.0)
    a.gone("s")  # failed, ended or moved
    assert a.matches({"d0": H}, 20.0) == {} and len(a) == 0


def test_sessions_writing_one_prefix_count_until_the_last_goes_and_a_rebinding_replaces_the_first():
    a = Arriving()
    a.bound("s", "d0", H[:2], 0.0)
    a.bound("t", "d0", H[:5], 0.0)
    assert a.matches({"d0": H}, 0.0) == {"d0": 5}
    a.gone("t")
    assert a.matches({"d0": H}, 0.0) == {"d0": 2}
    a.bound("s", "d1", H[:3], 0.0)  # bound again elsewhere: nothing arrives on d0 for it any more
    assert a.matches({"d0": H, "d1": H}, 0.0) == {"d1": 3}
    a.bound("s", "d1", [], 0.0)  # nothing shareable: nothing arriving
    assert len(a) == 0
    with pytest.raises(ValueError):
        Arriving(ttl_s=0.0)


def test_a_second_session_during_the_first_ones_prefill_follows_its_arriving_prefix():
    decode = [view("d0"), view("d1")]
    a = Arriving()
    a.bound("first", "d0", H, now=0.0)
    held = {"d0": 0, "d1": 0}  # nothing published yet: its prefill is running
    # admission put the second on d1 (d0 has the first's promise): without the arriving blocks it stays
    assert rebind_prefix("d1", decode, held, BT, {"d0": 100, "d1": 100}, 100) == ("d1", 0)
    matched = with_arriving(held, a.matches({"d0": H, "d1": H}, 0.5))
    assert matched == {"d0": len(H), "d1": 0} and len(H) >= MOVE_MIN_BLOCKS
    assert rebind_prefix("d1", decode, matched, BT, {"d0": 100, "d1": 100}, 100) == ("d0", len(H))
    # the same rule as for published blocks, but the session must fit there without the arriving
    # blocks (its round may begin before they land, and prefill them): 50 free, 100 needed
    full = [view("d0", 150), view("d1")]
    assert rebind_prefix("d1", full, matched, BT, {"d0": 100, "d1": 100}, 100, held=held)[0] == "d1"
    assert rebind_prefix("d1", full, matched, BT, {"d0": 100, "d1": 100}, 100, held=matched)[0] == "d0"
    assert with_arriving({"d0": 7}, {"d0": 3, "d1": 2}) == {"d0": 7, "d1": 2}


# ------------------------------------------------------------------ live: the coordinator's choice
def test_the_coordinator_binds_a_session_to_a_prefix_it_bound_there_before_it_is_published(redis_url):
    infos = {w: WorkerInfo(w, "decode", "x:1", 1, "", {"block_tokens": BT}, 10_000, prefix_sharing=True)
             for w in ("d0", "d1")}
    prompt = list(range(6 * BT + 3))

    async def rooms():
        return [view("d0", 1000), view("d1", 1000)], []

    async def go():
        r = redis.asyncio.Redis.from_url(redis_url)
        sets, arriving, counters = PrefixSets(r, "arr"), Arriving(), Counter()
        await r.delete(prefix_key("arr", "d0"), prefix_key("arr", "d1"))
        adm = Admission(0.0, 8)
        first = await prefix_choice(sets, infos, "s1", prompt, None, counters, arriving=arriving)
        assert first is not None and first.matched == {"d0": 0, "d1": 0}
        assert await adm.admit(300, rooms, len(prompt), sid="s1", prefer=first) == "d0"
        # its blocks are not published (its prefill runs): the second still follows them to d0
        second = await prefix_choice(sets, infos, "s2", prompt, None, counters, arriving=arriving)
        assert second is not None and second.matched == {"d0": 6, "d1": 0}
        assert await adm.admit(300, rooms, len(prompt), sid="s2", prefer=second) == "d0"
        assert counters["bind_prefix"] == 1 and adm.sessions == {"d0": 2}
        assert counters["bind_prefix_tokens"] == 0  # none held there yet
        # both gone before publishing (failed): a third is bound by admission alone
        arriving.gone("s1")
        arriving.gone("s2")
        third = await prefix_choice(sets, infos, "s3", prompt, None, counters, arriving=arriving)
        assert third is not None and third.matched == {"d0": 0, "d1": 0}
        assert await adm.admit(300, rooms, len(prompt), sid="s3", prefer=third) == "d1"
        # its own blocks arrive on d1 now
        assert arriving.matches({"d0": prefix_hashes(prompt, BT), "d1": prefix_hashes(prompt, BT)}, 0.0) == {"d1": 6}
        await r.aclose()

    asyncio.run(go())


# ------------------------------------------------------------------------------ the simulator
def _trace(n: int, gap_s: float) -> list[Session]:
    bt = HASH_BLOCK_TOKENS
    return [Session(f"s{i}", i * gap_s, (Round(8 * bt + 100, 40, 2.0, None, (*range(1, 7), 1000 * (i + 1), 1000 * (i + 1) + 1)),
                                        Round(200, 30))) for i in range(n)]


def test_the_simulator_binds_sessions_arriving_during_the_first_prefill_to_its_worker():
    r = simulate(_trace(6, 0.05), _profile(cap=200_000), policy="colocated", decode="tp1*2", ttft_slo_s=5.0,
                 itl_slo_s=1.0, prefix_sharing=True)
    assert all(s.completed for s in r.sessions)
    assert {s.decode_worker for s in r.sessions} == {r.sessions[0].decode_worker}
    # none found the prefix indexed (it was arriving); those for which waiting for it paid waited
    # (ampd.policy.prefixwait) and shared it, the others prefilled it
    assert r.stats["prefix_waits"] >= 1
    assert r.stats["prefix_sharing_sessions"] == r.stats["prefix_waits"]
    assert r.stats["prefix_blocks_held_end"] == 0 and r.stats["kv_used_end"] == [0, 0]
