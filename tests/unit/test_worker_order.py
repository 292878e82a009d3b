"""One worker order, live and simulated: natural order of worker ids (issue 26)."""
from ampd.perf import load_profile
from ampd.policy import WorkerView, bind, in_worker_order, make_router, worker_key
from ampd.policy.types import SLO, PrefillTask
from ampd.sim import Simulator, SimConfig
from ampd.state.cluster import Cluster


def pv(wid, q=0.0):
    return WorkerView(wid, "prefill", 2, None, (), 0, q)


def test_numbers_compare_as_numbers():
    ids = ["prefill-10", "prefill-2", "prefill-1", "prefill-0", "prefill-11"]
    assert [w for w in sorted(ids, key=worker_key)] == ["prefill-0", "prefill-1", "prefill-2", "prefill-10",
                                                         "prefill-11"]
    assert sorted(ids) != sorted(ids, key=worker_key)  # string order is not it
    assert worker_key("a-9") < worker_key("b-1") and worker_key("decode") < worker_key("decode-0")


def test_ties_go_to_the_first_in_worker_order():
    d = [WorkerView(w, "decode", 2, None, (), 100, 0.0) for w in ("decode-10", "decode-2")]
    assert bind(d) == "decode-2"
    router = make_router("remote", load_profile("llama3.1-70b@h20"), SLO(2.0, 0.1))
    task = PrefillTask("s", 0, 0, 100, 0.0, "decode-2", 4)
    assert router.route(task, d[1], [pv("prefill-10"), pv("prefill-2")], 0.0).target == "prefill-2"


class _Store:
    """What Cluster._assemble needs of a store: nothing (the view is assembled from entries)."""


def test_live_view_and_simulator_list_prefill_workers_alike():
    n = 12
    ids = [f"prefill-{i}" for i in range(n)]
    cluster = Cluster(_Store(), mode="push")
    entries = [(0.0, "prefill", pv(w), 0.0, ()) for w in reversed(ids)]
    live = [v.worker_id for v in cluster._assemble(entries, 0.0).prefill]
    sim = Simulator(SimConfig(profile=load_profile("llama3.1-70b@h20"), policy="ampd", prefill=f"tp4*{n}",
                              decode="tp4*1", ttft_slo_s=1.0))
    assert live == [p.worker_id for p in sim.prefills] == ids
    assert [v.worker_id for v in in_worker_order(pv(w) for w in sorted(ids))] == ids

