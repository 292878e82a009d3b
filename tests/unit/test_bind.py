"""Session binding: most free KV tokens, ties to the first in the worker order."""

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


def test_promised_kv_counts_so_concurrent_opens_spread():
    ws = [dw("d0", 1000), dw("d1", 1000)]
    promised: dict[str, int] = {}
    chosen = []
    for _ in range(4):  # four opens before any worker reports: each sees the ones before it
        d = bind(ws, promised, 400)
        chosen.append(d)
        promised[d] = promised.get(d, 0) + 400
    assert chosen == ["d0", "d1", "d0", "d1"]
    assert bind(ws, promised, 400) is None  # 200 left on each: admission waits or refuses
    assert bind(ws, promised, 200) == "d0"


def test_need_filters_workers_without_room():
    assert bind([dw("d0", 100), dw("d1", 50)], {"d0": 80}, 40) == "d1"
    assert bind([dw("d0", 100)], None, 101) is None
