"""The front's pure session parts: API keys and tenants, the index's tenant scope, and which idle
sessions go under KV pressure or a tenant's caps (ampd.front.tenants, .index, .evict)."""
from __future__ import annotations

import pytest

from ampd.front.evict import Held, grace_ends, kv_victims, tenant_victims
from ampd.front.index import LocalIndex, history_entry, prefix_digests, tenant_scope
from ampd.front.tenants import OPEN, KeyRing, Tenant, parse_api_keys

KEY_A, KEY_A2, KEY_B = "a" * 16 + "-one", "a" * 16 + "-two", "b" * 20


def test_the_keys_file_names_tenants_and_its_errors_name_the_line():
    text = f"# tenants\n\nacme {KEY_A}\nacme {KEY_A2}\n  globex   {KEY_B}  \n"
    assert parse_api_keys(text) == {KEY_A: "acme", KEY_A2: "acme", KEY_B: "globex"}
    for bad, why in [(f"acme {KEY_A} extra", "f:1: expected 'TENANT KEY'"), ("acme short", "f:1: key shorter"),
                     (f"ac/me {KEY_A}", "f:1: tenant must be"),
                     (f"acme {KEY_A}\nglobex {KEY_A}", "f:2: key already given"), ("# none\n", "f: no keys")]:
        with pytest.raises(ValueError, match=why):
            parse_api_keys(bad, "f")


def test_a_key_names_its_tenant_and_a_wrong_one_none():
    ring = KeyRing(parse_api_keys(f"acme {KEY_A}\nacme {KEY_A2}\nglobex {KEY_B}"))
    assert ring.tenant(f"Bearer {KEY_A}") == ring.tenant(f"bearer {KEY_A2}") == Tenant.of("acme")
    assert ring.tenant(f"Bearer {KEY_B}") == Tenant.of("globex")
    for wrong in ("", "Bearer", f"Bearer {KEY_A}x", f"Basic {KEY_A}", KEY_A):
        assert ring.tenant(wrong) is None
    assert Tenant.of("acme").scope != Tenant.of("globex").scope != OPEN.scope


def test_the_shared_token_is_one_tenant_and_no_key_an_open_front():
    shared = KeyRing(None, "s3cret")
    assert shared.tenant("Bearer s3cret") == OPEN and shared.tenant("Bearer nope") is None
    assert KeyRing().tenant("") == OPEN and KeyRing().tenant("Bearer anything") == OPEN
    # with a keys file the shared token is the deployment's internal one, not a client key
    assert KeyRing({KEY_A: "acme"}, "s3cret").tenant("Bearer s3cret") is None


def test_a_history_digest_is_salted_with_its_tenant():
    ids = list(range(3, 50))
    a, b = tenant_scope("acme"), tenant_scope("globex")
    assert history_entry(ids[:20], a).digest == prefix_digests(ids, [20], a)[0]
    assert history_entry(ids[:20], a).digest != history_entry(ids[:20], b).digest
    local = LocalIndex()
    local.add("s1", history_entry(ids[:20], a))
    assert local.find(a, ids).session_id == "s1" and local.find(a, ids).length == 20
    assert local.find(b, ids) is None  # another tenant's history never matches
    local.remove(a, history_entry(ids[:20], a).key)
    assert local.find(a, ids) is None and local.lengths == {}


def test_an_answer_lives_while_a_session_holds_it():
    local = LocalIndex()
    local.hold_answer("t", "d", [1, 2])
    local.hold_answer("t", "d", [1, 2])  # a second session's history has it too
    local.release_answer("t", "d")
    assert local.answers[("t", "d")] == [1, 2]
    local.release_answer("t", "d")
    assert local.answers == {}


def _h(sid, last, worker="d0", promised=100, busy=False, tokens=0):
    return Held(sid, last, busy, worker, promised, tokens)


def test_kv_pressure_evicts_idle_sessions_past_the_grace_lru_first_until_one_worker_has_room():
    held = [_h("new-idle", 9.5), _h("old", 1.0, "d1"), _h("older", 0.5, "d0"), _h("busy", 0.0, busy=True),
            _h("mid", 2.0, "d0")]
    # at t=10, grace 2: new-idle is within its grace, busy is busy; LRU: older(d0), old(d1), mid(d0)
    assert kv_victims(held, 10.0, 2.0, 100) == (["older"], True)
    assert kv_victims(held, 10.0, 2.0, 150) == (["older", "old", "mid"], True)  # d0 reaches 200 with mid
    assert kv_victims(held, 10.0, 2.0, 10_000) == (["older", "old", "mid"], False)  # none suffices: all
    assert kv_victims(held, 10.0, 20.0, 100) == ([], False)
    assert grace_ends(held, 10.0, 2.0) == 11.5
    assert grace_ends([_h("busy", 9.9, busy=True)], 10.0, 2.0) is None


def test_a_tenant_beyond_its_caps_loses_its_own_lru_idle_sessions_or_is_refused():
    idle = [_h("b", 2.0, tokens=300), _h("a", 1.0, tokens=100), _h("c", 3.0, tokens=50)]
    assert tenant_victims(idle, 3, 450, 0, 0) == []  # no caps
    assert tenant_victims(idle, 4, 450, 3, 0) == ["a"]
    assert tenant_victims(idle, 4, 450, 2, 0) == ["a", "b"]
    assert tenant_victims(idle, 2, 450, 0, 100) == ["a", "b"]  # 450 - 100 - 300 = 50 <= 100
    assert tenant_victims(idle, 5, 450, 1, 0) is None  # busy ones hold the rest
    assert tenant_victims([], 2, 10, 1, 0) is None
