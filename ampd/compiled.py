"""The simulator's cores compiled with mypyc: the worker state machines, the policies, the performance
model and the event loop (pyproject.toml [tool.mypy] ``files``, which type-check clean), built into
``build/mypyc/`` by ``python -m ampd.compile_cores`` (``make compile``, run by ``make test``, ``make
bench`` and ``make paper``). Same sources, same results (tests/unit/test_compiled.py compares the
simulator's fingerprints both ways); the simulator runs faster (docs/simulator.md, "Speed").

The processes that simulate use them: ``ampd simulate`` and ``ampd plan`` call ``install`` before
they import a core, and so do the simulator's benchmarks. The live services, the launcher and the
tests run the Python sources (a service's time goes to gRPC and the event loop, and a test may
patch a core). ``install`` puts the build in front of the sources only when it was built from the
sources as they are now: every compiled file's SHA-256 is in the build's manifest, and one file
edited since makes the whole set run from its sources (compiled modules call each other directly,
so a mix is never used), with one line on stderr saying so. ``AMPD_COMPILED=0`` runs the sources.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path

__all__ = ["BUILD", "STATE", "active", "install"]

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "mypyc"
MANIFEST = "manifest.json"
GROUP = "ampd_cores"  # the name of the one shared library every compiled module lives in
ENV = "AMPD_COMPILED"

STATE = "python (not installed)"  # what ``install`` decided (`ampd simulate` reports it)


def active() -> bool:
    """True when the compiled cores are in use in this process."""
    return STATE == "compiled"


# Type-checked, not compiled: settings, command lines and the trace generator, run once per run (a
# compiled dataclass offers no class-level defaults, which the simulator's settings are read from; a
# compiled module has no docstring, which a command line's help is; a compiled function refuses an
# argument of the wrong type before the generator's own checks can name it; numpy does its work).
NOT_COMPILED = ("ampd/sim/config.py", "ampd/sim/cli.py", "ampd/perf/derive.py", "ampd/workload/cli.py",
                "ampd/workload/presets.py")


def sources() -> list[Path]:
    """The compiled files: [tool.mypy] ``files`` (directories walked), less ``NOT_COMPILED`` and the
    package ``__init__`` files (they only re-export; a compiled one would need its own loader)."""
    import tomllib

    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    out: list[Path] = []
    for f in files:
        p = ROOT / f
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return [p for p in out if p.name != "__init__.py" and str(p.relative_to(ROOT)) not in NOT_COMPILED]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _Finder:
    """Finds the compiled modules (and their shared library) in the build, before the sources."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths = paths

    def find_spec(self, fullname, path=None, target=None):
        so = self.paths.get(fullname)
        if so is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, so, loader=importlib.machinery.ExtensionFileLoader(fullname, so))


def read_manifest() -> dict | None:
    """The build's manifest; None when there is none, or not one ``compile_cores`` wrote."""
    try:
        manifest = json.loads((BUILD / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("modules"), dict) else None


def stale(manifest: dict) -> str:
    """Why the build in ``manifest`` cannot stand for the sources now ("" when it can)."""
    if manifest.get("suffix") != importlib.machinery.EXTENSION_SUFFIXES[0]:
        return f"it was built for {manifest.get('suffix')}, not this Python"
    try:
        for entry in manifest["modules"].values():
            src = ROOT / entry["source"]
            if not src.is_file() or sha256(src) != entry["sha256"]:
                return f"{entry['source']} changed since it was built"
    except (KeyError, TypeError):
        return "its manifest is not one `make compile` wrote"
    return ""


def outdated(manifest: dict) -> str:
    """``stale``, or the compiled set changed since the build ("" when the build is current)."""
    why = stale(manifest)
    if not why and set(manifest["modules"]) != {module_name(p) for p in sources()}:
        why = "the set of compiled modules changed"
    return why


def install() -> None:
    """Puts the compiled cores in front of the sources when they match them (see the module doc)."""
    global STATE
    if STATE == "compiled":  # (installed already)
        return
    if os.environ.get(ENV, "1") == "0":
        STATE = f"python ({ENV}=0)"
        return
    manifest = read_manifest()
    if manifest is None:
        STATE = "python (not built: make compile)"
        return
    why = stale(manifest)
    if why:
        STATE = f"python (the compiled cores are stale: {why}; make compile)"
        sys.stderr.write(f"ampd: running the Python sources of the simulator's cores: {why} (make compile)\n")
        return
    if any(m in sys.modules for m in manifest["modules"]):  # imported already: too late for this process
        STATE = "python (imported before install)"
        return
    paths = {m: str(BUILD / e["so"]) for m, e in manifest["modules"].items()}
    paths[manifest["library"]] = str(BUILD / manifest["library_so"])
    sys.meta_path.insert(0, _Finder(paths))
    STATE = "compiled"
