"""Prefix scopes (OpenSession.prefix_scope, docs/kv.md "Prefix sharing"): sessions share KV blocks only
within one scope, since a shared block shows in another session's cached tokens and TTFT. The seed
mixing (ampd.policy.prefixbind.scoped_seed), the live decode worker's index under it
(services/decode/prefix.py), the coordinator's binding hashes (services/coordinator/prefixes.py), the
field's check (ampd.validate), the front's tenants (ampd.front.tenants) and a move's open
(ampd.sessionlog). Through the services: tests/integration/test_prefix_scope_live.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from ampd.front.api import ApiError, parse_chat
from ampd.front.tenants import OPEN, Tenant
from ampd.kv import KVPool, kv_pattern, verify_pattern
from ampd.policy.prefixbind import prefix_hashes, prefix_seed, scoped_seed
from ampd.sessionlog import SessionLog
from ampd.state import WorkerInfo
from ampd.v1 import common_pb2, decode_pb2
from ampd.validate import MAX_ID, InvalidArgument, validate_open
from ampd.worker import DecodeSession
from services.coordinator.prefixes import prompt_hashes
from services.decode.prefix import LivePrefix
from services.decode.session import Session

BT, BPT = 4, 8
PROMPT = list(range(1000, 1012)) + [7]  # three full shareable blocks


def test_the_empty_scope_keeps_the_models_seed_and_any_other_mixes_it():
    model = prefix_seed("some/model")
    for seed in (0, model):
        assert scoped_seed(seed, "") == seed  # the shared scope: today's hashes, published or not
        assert scoped_seed(seed, "a") == scoped_seed(seed, "a")  # pure: worker and coordinator agree
        seeds = {seed, scoped_seed(seed, "a"), scoped_seed(seed, "b"), scoped_seed(seed, "ab")}
        assert len(seeds) == 4
        assert all(0 <= s < 1 << 64 for s in seeds)
    # the model stays in it: one scope's blocks of two models differ too
    assert scoped_seed(0, "a") != scoped_seed(model, "a")
    # no block of one scope has the hash of a block of another
    a = set(prefix_hashes(PROMPT, BT, scoped_seed(model, "a")))
    b = set(prefix_hashes(PROMPT, BT, scoped_seed(model, "b")))
    assert len(a) == 3 and not a & b and not a & set(prefix_hashes(PROMPT, BT, model))


def _worker():
    w = SimpleNamespace(rt=SimpleNamespace(pool=KVPool(32, BT, BPT)), core=SimpleNamespace(sessions={}), tier=None,
                        metrics={"prefix_shared_tokens": 0})
    w.core.shared_history = lambda c, tokens: None
    w.prefix = LivePrefix(w, True, prefix_seed("some/model"))
    return w


def _first_round(w, sid: str, scope: str) -> tuple[Session, int]:
    """A session's first round on the worker (as tests/unit/test_decode_prefix_live.py): share,
    prefill the rest, publish. Returns it and its shared tokens."""
    pool = w.rt.pool
    s = Session(session_id=sid, max_rounds=0, max_output=0, kv=w.prefix.new_kv(sid), core=DecodeSession(sid),
                prefix_scope=scope, scoped_seed=w.prefix.seed_of(scope))
    s.tokens = list(PROMPT)
    shared = w.prefix.share(s)
    n = len(s.tokens) - s.kv.tokens
    pool.write(s.kv.reserve(pool, n), kv_pattern(sid, s.kv.tokens, n, BPT, s.prefix_tokens))
    s.kv.commit(n)
    w.prefix.published(s)
    return s, shared


def test_a_decode_worker_shares_blocks_within_a_scope_and_never_across():
    w = _worker()
    a1, _ = _first_round(w, "a1", "tenant-a")
    b1, got = _first_round(w, "b1", "tenant-b")
    assert got == 0 and not set(a1.kv.blocks) & set(b1.kv.blocks)
    shared0, got = _first_round(w, "x", "")  # the shared scope is a scope of its own too
    assert got == 0
    a2, got = _first_round(w, "a2", "tenant-a")
    assert got == 3 * BT and a2.kv.blocks[:3] == a1.kv.blocks[:3]
    assert verify_pattern("a2", 0, w.rt.pool.read(a2.kv.segments(0, a2.kv.tokens)), BPT, a2.prefix_tokens) == 0
    # what the worker publishes for binding is each scope's hashes: the coordinator's, for that scope
    info = WorkerInfo("d0", "decode", "x:1", 1, "", {"block_tokens": BT}, 10_000, prefix_sharing=True,
                      prefix_seed=w.prefix.index.seed)
    for scope in ("tenant-a", "tenant-b", ""):
        assert set(prompt_hashes({"d0": info}, PROMPT, scope)["d0"]) <= set(w.prefix.index.hashes())
    assert not set(prompt_hashes({"d0": info}, PROMPT, "tenant-c")["d0"]) & set(w.prefix.index.hashes())
    pool = w.rt.pool
    for s in (a1, b1, shared0, a2):
        s.kv.release(pool)
    pool.free(w.prefix.index.reclaim(pool.num_blocks))
    assert w.prefix.index.empty and pool.free_blocks == pool.num_blocks


def test_a_scope_too_long_or_unprintable_is_invalid_and_names_the_field():
    turn = common_pb2.Turn(token_ids=[1], sampling=common_pb2.SamplingParams(max_tokens=1))
    validate_open(common_pb2.OpenSession(session_id="s", turn=turn))
    validate_open(common_pb2.OpenSession(session_id="s", turn=turn, prefix_scope="x" * MAX_ID))
    for bad in ("x" * (MAX_ID + 1), "a\nb"):
        with pytest.raises(InvalidArgument, match=r"^open\.prefix_scope: "):
            validate_open(common_pb2.OpenSession(session_id="s", turn=turn, prefix_scope=bad))


def test_the_fronts_tenants_have_scopes_of_their_own_and_the_open_one_the_shared_scope():
    a, b = Tenant.of("acme"), Tenant.of("globex")
    assert OPEN.prefix_scope == ""
    assert a.prefix_scope and a.prefix_scope != b.prefix_scope and a.prefix_scope == Tenant.of("acme").prefix_scope
    assert "acme" not in a.prefix_scope  # a hash: the name stays out of the workers' books and logs


def test_a_moved_or_reattached_session_keeps_its_scope():
    log = SessionLog("s", common_pb2.SessionLimits(), prefix_scope="tenant-a")
    log.history = [1, 2, 3]
    log.on_turn(common_pb2.Turn(token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=2)))
    assert log.resume().open.prefix_scope == "tenant-a"
    st = decode_pb2.SessionState(history=[1, 2, 3], prefix_scope="tenant-a", round=-1)
    assert SessionLog.from_state("s", st).prefix_scope == "tenant-a"


def test_the_front_refuses_a_cache_salt_rather_than_ignoring_it():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    parse_chat({**body, "cache_salt": ""})  # asks for nothing
    with pytest.raises(ApiError) as info:
        parse_chat({**body, "cache_salt": "per-user"})
    assert info.value.status == 400 and info.value.param == "cache_salt"
