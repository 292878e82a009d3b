"""Imports run downward: services -> library shells -> pure cores (docs/architecture.md "Layers").

The rules are read off the source with `ast` (no module is imported), over every import statement,
including the ones inside functions: a lazy import still runs when its function does. Imports under
`if TYPE_CHECKING:` are skipped. A failure names the file and line of the offending import and, for
a rule on what a module pulls in, the chain of imports that reaches it.
"""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The pure cores: decisions, models and accounting. No I/O, time passed in (docs/architecture.md "Layers").
PURE = ("ampd.policy", "ampd.perf", "ampd.workload", "ampd.worker", "ampd.planner", "ampd.sim", "ampd.bench.report",
        "ampd.window", "ampd.slo", "ampd.deployment")
# What a pure core may not reach: transports, shared state, services, the launcher, the trace-replay
# clients (ampd.bench except its report module), and the live plumbing built on them.
PURE_MAY_NOT = ("grpc", "grpc_health", "grpc_reflection", "redis", "tenacity", "nixl", "uvloop", "services",
                "ampd.launcher", "ampd.bench", "ampd.state", "ampd.runtime", "ampd.grpcserver", "ampd.v1",
                "ampd.kv.transport", "ampd.engine", "ampd.sim")
PURE_MAY = ("ampd.bench.report",)  # the one part of ampd.bench a core may use
# Cores that sit above another core: the planner estimates with the simulator (itself pure: a
# virtual clock over the worker cores), so it may use it; nothing below the planner may.
CORE_MAY = {"ampd.planner": ("ampd.sim",)}

# What the sidecar and the coordinator may not pull in (transitively): worker plumbing they do not use.
LIGHT = {
    "services.sidecar.server": ("ampd.runtime", "ampd.kv", "ampd.engine", "ampd.state", "redis", "tenacity",
                                "numpy", "nixl"),
    "services.coordinator.server": ("ampd.runtime", "ampd.kv", "ampd.engine", "nixl", "services.decode",
                                    "services.prefill"),
}


def _file(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _modules(prefix: str) -> list[str]:
    path = _file(prefix)
    if path is None:
        return []
    if path.name != "__init__.py":
        return [prefix]
    out = []
    for p in sorted(path.parent.rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out.append(".".join(parts))
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


@lru_cache(maxsize=None)
def imports(module: str) -> tuple[tuple[str, int], ...]:
    """(imported module, line) for every import in ``module``'s source, resolved to module names."""
    path = _file(module)
    if path is None:
        return ()
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skip |= {id(n) for n in ast.walk(node)}
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append((base, node.lineno))
            for a in node.names:  # `from ampd import grpcserver` imports the module ampd.grpcserver
                if _file(f"{base}.{a.name}") is not None:
                    out.append((f"{base}.{a.name}", node.lineno))
    return tuple(out)


def _within(module: str, prefixes) -> str | None:
    for p in prefixes:
        if module == p or module.startswith(p + "."):
            return p
    return None


def _parents(module: str) -> list[str]:
    """Importing a.b.c runs a/__init__.py and a/b/__init__.py first."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def reach(start: str) -> dict[str, tuple[str, int]]:
    """Every module importing ``start`` loads (ours and third-party, by name) -> (importer, line)."""
    seen: dict[str, tuple[str, int]] = {}
    todo = [start, *_parents(start)]
    while todo:
        mod = todo.pop()
        for target, line in imports(mod):
            for t in (*_parents(target), target):
                if t not in seen and t != start:
                    seen[t] = (mod, line)
                    if _file(t) is not None:
                        todo.append(t)
    return seen


def chain(seen: dict[str, tuple[str, int]], start: str, target: str) -> str:
    steps = [target]
    while steps[-1] in seen and seen[steps[-1]][0] != start and len(steps) < 50:
        steps.append(seen[steps[-1]][0])
    steps.append(start)
    importer, line = seen[target]
    return " <- ".join(steps) + f"  ({_file(importer).relative_to(ROOT)}:{line})"


def _where(module: str, line: int) -> str:
    return f"{_file(module).relative_to(ROOT)}:{line}"


# ------------------------------------------------------------------------------------------ rules
def _banned_edges(start: str, banned, allowed=()) -> dict[tuple[str, str], str]:
    """The imports through which ``start`` first reaches a banned module: (importer, target) -> chain.
    Only the first step into banned ground is reported (what that module imports in turn is noise)."""
    seen = reach(start)

    def is_banned(m: str) -> str | None:
        if _within(m, allowed) or any(a.startswith(m + ".") for a in allowed):
            # an allowed module, or the package that holds one (its __init__ is walked like any module)
            return None
        return _within(m, banned)

    out = {}
    for target in sorted(seen):
        importer = seen[target][0]
        if is_banned(target) and not is_banned(importer):
            out[(importer, target)] = f"{chain(seen, start, target)} [no {is_banned(target)}]"
    return out


def violations_of_pure_cores() -> list[str]:
    edges: dict[tuple[str, str], str] = {}
    for core in PURE:
        for mod in _modules(core):
            allowed = PURE_MAY + CORE_MAY.get(core, ())
            for edge, text in _banned_edges(mod, PURE_MAY_NOT, allowed).items():
                edges.setdefault(edge, f"pure core {mod} reaches {edge[1]}: {text}")
    return list(edges.values())


def violations_of_library() -> list[str]:
    out = []
    for mod in _modules("ampd"):
        for target, line in imports(mod):
            if _within(target, ("services",)):
                out.append(f"{_where(mod, line)}: library module {mod} imports {target} (ampd never imports services)")
    return out


def violations_of_light_services() -> list[str]:
    out = []
    for start, banned in LIGHT.items():
        for (_importer, target), text in _banned_edges(start, banned).items():
            out.append(f"{start} pulls in {target}, which it does not use: {text}")
    return out


def test_the_walker_sees_imports():
    """The rules below can fail: the walker finds the imports that are there."""
    assert ("ampd.policy.types", 5) not in imports("ampd.policy.route")  # a line number is a real one
    assert any(t == "ampd.policy.types" for t, _ in imports("ampd.policy.route"))
    assert "grpc" in reach("services.coordinator.server")
    assert "redis" in reach("ampd.state.cluster")
    assert "ampd.policy.spec" in reach("ampd.config")
    assert _modules("ampd.policy") and "ampd.policy.route" in _modules("ampd.policy")


def test_pure_cores_import_no_io_services_launcher_or_bench():
    problems = violations_of_pure_cores()
    assert not problems, "\n".join(problems)


def test_the_library_never_imports_services():
    problems = violations_of_library()
    assert not problems, "\n".join(problems)


def test_sidecar_and_coordinator_do_not_pull_in_worker_plumbing():
    problems = violations_of_light_services()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("service", ["services.coordinator", "services.decode", "services.prefill",
                                     "services.sidecar"])
def test_services_do_not_import_each_other(service):
    others = [s for s in ("services.coordinator", "services.decode", "services.prefill", "services.sidecar")
              if s != service]
    for mod in _modules(service):
        for target, line in imports(mod):
            assert not _within(target, others), f"{_where(mod, line)}: {mod} imports {target}"


# ------------------------------------------------------------------------------------------ cycles
def import_cycles(packages=("ampd", "services")) -> list[list[str]]:
    """Every strongly connected set of two or more of our modules in the import graph (Tarjan), each
    as a list of modules. Function-level (lazy) imports count: they close a cycle when their function
    runs. A package's ``__init__`` and the submodules it imports are separate nodes, and importing
    ``a.b`` is an edge to ``a.b`` only (its parents run first but are not part of the edge)."""
    mods = {m for p in packages for m in _modules(p) if not _within(m, ("ampd.v1",))}
    graph = {m: sorted({t for t, _ in imports(m) if t in mods and t != m}) for m in mods}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):  # iterative Tarjan: the graph is deep enough to hit the recursion limit
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _cycle_text(comp: list[str]) -> str:
    members = set(comp)
    lines = [f"{_where(m, line)}: {m} imports {t}" for m in comp for t, line in imports(m) if t in members and t != m]
    return "import cycle among " + ", ".join(comp) + ":\n  " + "\n  ".join(lines)


def test_the_cycle_finder_sees_a_cycle(tmp_path, monkeypatch):
    """A lazy two-module cycle (the shape route.py and spec.py once had) is found."""
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("x = 1\n\ndef f():\n    from .a import x\n    return x\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    imports.cache_clear()
    try:
        assert import_cycles(("cyc",)) == [["cyc.a", "cyc.b"]]
    finally:
        imports.cache_clear()


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "\n".join(_cycle_text(c) for c in cycles)
