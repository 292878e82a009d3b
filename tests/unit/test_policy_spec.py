"""Policy names, their deployment shapes, and the shared value types."""


import pytest

from ampd.policy import (
    POLICIES,
    SLO,
    CostModel,
    PolicySpec,
    PrefillTask,
    WorkerView,
    make_queue,
    make_router,
    policy_spec,
)


class LinearCost:
    def t_pre(self, tp, l_hist, l_incr):
        return 0.001 * l_incr / tp

    def t_kv(self, tokens, src_tp, dst_tp):
        return 0.0


def test_policy_names():
    assert POLICIES == ("ampd", "ampd-window", "ampd-noreorder", "ampd-margin", "remote", "local", "threshold",
                        "colocated", "continuum", "ampd-colocated")


def test_specs():
    s = policy_spec("ampd")
    assert (s.router, s.prefill_queue, s.decode_queue, s.uses_prefill_workers) == ("adaptive", "ttft-aware", "ttft-aware", True)
    s = policy_spec("ampd-window")  # the paper's literal Algorithm 1: windowed-mean slack
    assert (s.router, s.prefill_queue, s.decode_queue, s.slack) == ("adaptive", "ttft-aware", "ttft-aware", "window")
    assert policy_spec("ampd").slack == "queue"
    s = policy_spec("ampd-noreorder")
    assert (s.router, s.prefill_queue, s.decode_queue) == ("adaptive", "fcfs", "fcfs")
    for name in ("remote", "local", "threshold"):
        s = policy_spec(name)
        assert (s.router, s.prefill_queue, s.decode_queue, s.uses_prefill_workers) == (name, "fcfs", "fcfs", True)
    s = policy_spec("colocated")
    assert (s.router, s.prefill_queue, s.decode_queue, s.uses_prefill_workers, s.kv_pin_ttl_s) == ("local", None, "fcfs", False, None)
    s = policy_spec("continuum")
    assert (s.router, s.prefill_queue, s.decode_queue, s.uses_prefill_workers) == ("local", None, "continuum", False)
    assert s.kv_pin_ttl_s == 5.0
    s = policy_spec("ampd-colocated")  # AMPD's router and Algorithm 2's queue, no prefill workers
    assert (s.router, s.prefill_queue, s.decode_queue, s.uses_prefill_workers, s.slack) == (
        "adaptive", None, "ttft-aware", False, "queue")
    for name in POLICIES:
        s = policy_spec(name)
        assert isinstance(s, PolicySpec) and s.name == name and s.description
        if name != "continuum":
            assert s.kv_pin_ttl_s is None


def test_every_spec_builds():
    cost, slo = LinearCost(), SLO(1.0, 0.1)
    for name in POLICIES:
        s = policy_spec(name)
        assert make_router(s.router, cost, slo).name == s.router
        make_queue(s.decode_queue, cost, slo, 2)
        if s.prefill_queue is not None:
            make_queue(s.prefill_queue, cost, slo, 4)


def test_policy_router_follows_its_slack_rule():
    cost, slo = LinearCost(), SLO(1.0, 0.1)
    assert make_router("ampd-window", cost, slo).slack == "window"
    assert make_router("ampd", cost, slo).slack == "queue"
    assert make_router("ampd", cost, slo, slack="window").slack == "window"  # --slack overrides


def test_registry_rejects_an_inconsistent_policy():
    from ampd.policy import register_policy

    with pytest.raises(ValueError, match="router 'nope'"):
        register_policy(PolicySpec("x", "nope", "fcfs", "fcfs", True))
    with pytest.raises(ValueError, match="queue 'lifo'"):
        register_policy(PolicySpec("x", "local", "lifo", "fcfs", True))
    with pytest.raises(ValueError, match="prefill queue exactly when"):
        register_policy(PolicySpec("x", "local", None, "fcfs", True))
    assert "x" not in POLICIES


def test_ttl_override_and_errors():
    assert policy_spec("continuum", kv_pin_ttl_s=2.5).kv_pin_ttl_s == 2.5
    assert policy_spec("continuum").kv_pin_ttl_s == 5.0  # override does not leak
    with pytest.raises(ValueError, match="does not pin KV; kv_pin_ttl_s applies to: continuum"):
        policy_spec("ampd", kv_pin_ttl_s=1.0)
    with pytest.raises(ValueError, match=">= 0"):
        policy_spec("continuum", kv_pin_ttl_s=-1.0)
    with pytest.raises(ValueError, match=r"unknown policy 'vllm'; valid policies: ampd, ampd-window, ampd-noreorder, ampd-margin, remote, local, threshold, colocated, continuum, ampd-colocated"):
        policy_spec("vllm")


def test_types_are_slotted_values():
    # not frozen on purpose (construction cost, see ampd/policy/types.py), but slotted values
    t = PrefillTask("s", 0, 0, 10, 1.0)
    assert t == PrefillTask("s", 0, 0, 10, 1.0) and t != PrefillTask("s", 0, 0, 11, 1.0)
    with pytest.raises(AttributeError):
        t.priority = 5  # no such field: slots
    assert not hasattr(t, "__dict__")
    w = WorkerView("p0", "prefill", 4, None, (t,), 0, 0.01)
    assert w.queue == (t,) and not hasattr(w, "__dict__")
    cost = LinearCost()  # a CostModel (structurally: the protocol is not runtime-checkable, mypyc compiles it)
    assert all(callable(getattr(cost, name, None)) for name in ('t_pre', 't_kv'))
    assert {'t_pre', 't_kv'} <= set(dir(CostModel))


def test_slo_validation():
    assert SLO(2.0, 0.05) == SLO(ttft_s=2.0, itl_s=0.05)
    with pytest.raises(ValueError, match="ttft_s"):
        SLO(0.0, 0.1)
    with pytest.raises(ValueError, match="itl_s"):
        SLO(1.0, -0.1)


def test_slo_is_the_report_modules():
    from ampd.bench import report

    assert SLO is report.SLO


def test_colocated_form():
    """The policy a deployment with no prefill workers runs in place of each policy: AMPD keeps its
    reordering there (ampd-colocated), the others fall back to FCFS co-location, a co-located one
    stays itself; a form must be a co-located policy."""
    for name in ("ampd", "ampd-window", "ampd-margin"):
        assert policy_spec(name).on_colocated() == "ampd-colocated"
    for name in ("ampd-noreorder", "remote", "local", "threshold"):
        assert policy_spec(name).on_colocated() == "colocated"
    for name in ("colocated", "continuum", "ampd-colocated"):
        assert policy_spec(name).on_colocated() == name
    from ampd.policy import register_policy

    with pytest.raises(ValueError, match="colocated_form 'remote' must name a co-located policy"):
        register_policy(PolicySpec("bad-form", "remote", "fcfs", "fcfs", True, colocated_form="remote"))
