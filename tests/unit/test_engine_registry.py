"""The engine registry (ampd.engine): engines are picked by name, each declares its capabilities
once, and nothing outside ampd.engine compares engine names or probes an engine with getattr."""
from __future__ import annotations

import ast
from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import pytest

from ampd.config import DEFAULT_PROFILE, DeploymentConfig
from ampd.engine import (ENGINES, EngineCapabilities, EngineSpec, capabilities_of, check_available, engine_spec,
                         make_engine, register)
from ampd.engine import capabilities as caps
from ampd.engine.base import Engine
from ampd.engine.mock import MockEngine
from ampd.perf import load_profile

ROOT = Path(__file__).resolve().parents[2]


def test_every_engine_the_config_offers_is_registered_and_no_other():
    choices = next(f.metadata["choices"] for f in fields(DeploymentConfig) if f.name == "engine")
    assert ENGINES == ("mock", "torch", "sglang") and set(choices) == set(ENGINES)


def test_an_unknown_engine_is_refused_with_the_known_names():
    for call in (lambda: engine_spec("vllm"), lambda: capabilities_of("vllm"), lambda: check_available("vllm"),
                 lambda: make_engine("vllm", None, 1)):
        with pytest.raises(ValueError, match=r"engine 'vllm' is not available \(available: mock, torch, sglang\)"):
            call()


def test_make_engine_builds_the_registered_engine_with_its_declared_capabilities():
    engine = make_engine("mock", load_profile(DEFAULT_PROFILE), 1)
    assert isinstance(engine, MockEngine)
    assert engine.capabilities is capabilities_of("mock") is caps.MOCK
    for name in ("name", "capabilities", "tp", "eos_token_ids", "vocab_size", "max_context"):
        assert name in Engine.__annotations__
        getattr(engine, name)


def test_the_engine_classes_declare_what_the_registry_says():
    from ampd.engine.sglang_engine import SGLangEngine
    from ampd.engine.torch_engine import TorchEngine

    assert MockEngine.capabilities is capabilities_of("mock")
    assert TorchEngine.capabilities is capabilities_of("torch")
    assert SGLangEngine.capabilities is capabilities_of("sglang")
    # each capability that implies calls: the engines that declare it have them
    for cls in (MockEngine, TorchEngine, SGLangEngine):
        c = cls.capabilities
        assert hasattr(cls, "forget") == (c.needs_token_ids or c.keeps_round_kv), cls
        assert hasattr(cls, "open_round") == hasattr(cls, "end_round") == c.streams_rounds, cls
        assert hasattr(cls, "make_pool") == c.cuts_pool, cls
        assert (hasattr(cls, "kv_bytes_per_token") or "kv_bytes_per_token" in cls.__init__.__code__.co_varnames) \
            == c.model_kv_bytes, cls


def test_capabilities_are_frozen_and_default_to_none():
    none = EngineCapabilities()
    assert not any(getattr(none, f.name) for f in fields(EngineCapabilities))
    with pytest.raises(FrozenInstanceError):
        caps.MOCK.patterned_kv = False  # type: ignore[misc]
    # the mock is the only engine whose KV bytes are checkable, and the only one timed by a profile
    assert [n for n in ENGINES if capabilities_of(n).patterned_kv] == ["mock"]
    assert [n for n in ENGINES if capabilities_of(n).timed_by_profile] == ["mock"]
    assert [n for n in ENGINES if not capabilities_of(n).text_output] == ["mock"]


def test_a_registered_engine_is_picked_by_name():
    built = []

    def build(profile, tp, model, kv_store):
        built.append((profile, tp, model, kv_store))
        return "an engine"

    def check(model):
        if model == "missing":
            raise ValueError("--model: missing")

    register(EngineSpec("test-engine", EngineCapabilities(cpu_only=True), build, check=check, ready_timeout_s=5.0))
    try:
        assert make_engine("test-engine", None, 2, "m", {"redis_url": "x"}) == "an engine"
        assert built == [(None, 2, "m", {"redis_url": "x"})]
        assert capabilities_of("test-engine").cpu_only and engine_spec("test-engine").ready_timeout_s == 5.0
        check_available("test-engine", "fine")
        with pytest.raises(ValueError, match="missing"):
            check_available("test-engine", "missing")
    finally:
        import ampd.engine

        del ampd.engine._REGISTRY["test-engine"]
    assert engine_spec("mock").ready_timeout_s == 90.0 and engine_spec("sglang").ready_timeout_s == 600.0


def _engine_sniffs(path: Path) -> list[str]:
    """getattr/hasattr on something named engine, and comparisons of an engine (or its name) with an
    engine's name, in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    names = set(ENGINES)

    def mentions_engine(node: ast.AST) -> bool:
        return any((isinstance(n, ast.Name) and "engine" in n.id) or (isinstance(n, ast.Attribute) and
                   "engine" in n.attr) for n in ast.walk(node))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args and mentions_engine(node.args[0]):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.func.id}")
        if isinstance(node, ast.Compare) and mentions_engine(node) and any(
                isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators]):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: compares an engine name")
    return out


def test_no_caller_sniffs_an_engine():
    found = []
    for top in ("ampd", "services"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("ampd/engine/") or rel.endswith("_pb2.py") or rel.endswith("_pb2_grpc.py"):
                continue
            found += _engine_sniffs(path)
    # ampd.chat.tokenizer picks a tokenizer per (engine, model) name pair: a lookup, not a capability
    assert [f for f in found if not f.startswith("ampd/chat/tokenizer.py")] == []
