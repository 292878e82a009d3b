"""Session binding: most free KV tokens, ties to the lowest worker id."""

import pytest

from ampd.policy import WorkerView, bind


def dw(wid, free):
    return WorkerView(wid, "decode", 2, None, (), free, 0.0)


def test_most_free_kv_wins():
    assert bind([dw("d0", 100), dw("d1", 300), dw("d2", 200)]) == "d1"


def test_ties_go_to_lowest_id_whatever_the_order():
    ws = [dw("d2", 300), dw("d10", 300), dw("d1", 300), dw("d0", 100)]
    assert bind(ws) == "d1"
    assert bind(ws[::-1]) == "d1"
    assert bind([dw("d3", 0)]) == "d3"


def test_empty_raises():
    with pytest.raises(ValueError, match="no decode workers"):
        bind([])
