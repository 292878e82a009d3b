"""ampd.policy.kvwhere: a session's KV location and fetch time for routing, and its wire form."""
import math

import pytest

from ampd.policy.kvtier import KVState
from ampd.policy.kvwhere import RESIDENT, KVWhere, KVWhereError, kv_where, parse_kv_where
from ampd.policy.types import KV_GONE, KV_HOST, KV_RESIDENT


def per_token(tokens: int) -> float:
    return 0.001 * tokens  # 1 ms a token


def test_resident_is_no_fetch():
    assert kv_where(KVState.RESIDENT, 0, per_token) == RESIDENT == KVWhere("resident", 0.0)
    assert kv_where("resident", 0, per_token) == RESIDENT


def test_on_host_pays_the_whole_fetch():
    w = kv_where(KVState.HOST, 300, per_token)
    assert w.state == KV_HOST and w.fetch_s == pytest.approx(0.3)


def test_a_prefetch_in_flight_counts_what_is_left():
    # the core counts it resident already; 400 tokens started 0.1 s ago: 0.3 s left
    w = kv_where(KVState.RESIDENT, 0, per_token, moving_tokens=400, moving_since=10.0, now=10.1)
    assert w.state == KV_HOST and w.fetch_s == pytest.approx(0.3)
    late = kv_where(KVState.RESIDENT, 0, per_token, moving_tokens=400, moving_since=10.0, now=11.0)
    assert late == KVWhere(KV_HOST, 0.0)  # late, not negative
    assert kv_where("resident", 0, per_token, moving_tokens=400).fetch_s == pytest.approx(0.4)  # not started


def test_gone_is_a_reprefill_without_a_fetch():
    assert kv_where(KVState.GONE, 0, per_token) == KVWhere(KV_GONE, 0.0)
    assert kv_where(KVState.GONE, 300, per_token) == KVWhere(KV_GONE, 0.0)


def test_kv_where_refuses_nonsense():
    with pytest.raises(KVWhereError, match="kv state"):
        kv_where("attic", 0, per_token)
    with pytest.raises(ValueError, match="token counts"):
        kv_where(KVState.HOST, -1, per_token)


@pytest.mark.parametrize("wire, want", [("", RESIDENT), ("resident", RESIDENT), ("gone", KVWhere(KV_GONE, 0.0))])
def test_parse_the_wire_strings(wire, want):
    assert parse_kv_where(wire) == want


def test_parse_host_with_its_fetch():
    assert parse_kv_where("host", 0.25) == KVWhere(KV_HOST, 0.25)
    assert parse_kv_where(KV_RESIDENT, 0.1) == KVWhere(KV_RESIDENT, 0.1)  # waits for room moves free


@pytest.mark.parametrize("state, fetch, match", [
    ("Host", 0.0, "kv_state: 'Host' is not a KV location"),
    ("disk", 0.0, "one of resident, host, gone"),
    ("host", -0.5, "kv_fetch_s: must be a finite number"),
    ("host", math.nan, "kv_fetch_s"),
    ("host", math.inf, "kv_fetch_s"),
])
def test_parse_refuses_bad_values_clearly(state, fetch, match):
    with pytest.raises(KVWhereError, match=match):
        parse_kv_where(state, fetch)


def test_parse_names_the_field():
    with pytest.raises(KVWhereError, match=r"route\.kv_state"):
        parse_kv_where("nowhere", field="route.kv_state")
