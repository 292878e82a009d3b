"""Builds the compiled cores (ampd/compiled.py) into ``build/mypyc/``: ``python -m ampd.compile_cores
[--force]`` (``make compile``). Needs mypy (mypyc), setuptools and a C compiler; a minute or two on
2 cores, and nothing to do when the build matches the sources."""
from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ampd.compiled import BUILD, GROUP, MANIFEST, ROOT, module_name, outdated, read_manifest, sha256, sources


def build(force: bool = False, jobs: int = 2) -> int:
    """Compiles the cores into ``BUILD`` (a minute or two on 2 cores); nothing to do when the build
    matches the sources. Returns a process exit status."""
    old = read_manifest()
    if old is not None and not force and not outdated(old):
        print(f"compiled cores: up to date ({len(old['modules'])} modules in {BUILD.relative_to(ROOT)})")
        return 0
    try:
        from mypyc.build import mypycify
        from setuptools import setup
    except ImportError as exc:
        print(f"compiled cores: cannot build ({exc}); the Python sources run", file=sys.stderr)
        return 1
    srcs = sources()
    t0 = time.monotonic()
    print(f"compiled cores: compiling {len(srcs)} modules with mypyc (a minute or two)...", flush=True)
    BUILD.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mypyc-", dir=BUILD.parent))
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)  # mypyc names modules by their paths from here
        exts = mypycify([str(p.relative_to(ROOT)) for p in srcs], group_name=GROUP, multi_file=True,
                        target_dir=str(work / "c"))
        setup(name=GROUP, ext_modules=exts, script_args=[
            "--quiet", "build_ext", "--build-lib", str(work / "lib"), "--build-temp", str(work / "o"),
            "--parallel", str(jobs)])
    except (SystemExit, Exception) as exc:  # setup() exits on a compiler error
        shutil.rmtree(work, ignore_errors=True)
        print(f"compiled cores: the build failed ({exc}); the Python sources run", file=sys.stderr)
        return 1
    finally:
        os.chdir(cwd)
    return _publish(work, srcs, t0)


def _publish(work: Path, sources: list[Path], t0: float) -> int:
    """Moves the built libraries into ``BUILD`` with their manifest (written last: a build cut short
    leaves no manifest, so it is never used)."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    lib = work / "lib"
    modules = {}
    for src in sources:
        so = src.relative_to(ROOT).with_suffix(suffix)
        if not (lib / so).is_file():
            print(f"compiled cores: {so} was not built; the Python sources run", file=sys.stderr)
            return 1
        modules[module_name(src)] = {"source": str(src.relative_to(ROOT)), "sha256": sha256(src), "so": str(so)}
    shared = sorted(lib.glob(f"{GROUP}__mypyc*{suffix}"))
    if len(shared) != 1:
        print(f"compiled cores: expected one {GROUP}__mypyc library, found {len(shared)}", file=sys.stderr)
        return 1
    shutil.rmtree(BUILD, ignore_errors=True)
    shutil.move(str(lib), str(BUILD))
    shutil.rmtree(work, ignore_errors=True)
    manifest = {"suffix": suffix, "library": f"{GROUP}__mypyc", "library_so": shared[0].name,
                "modules": modules}
    (BUILD / MANIFEST).write_text(json.dumps(manifest, indent=1))
    print(f"compiled cores: {len(modules)} modules built in {time.monotonic() - t0:.0f} s "
          f"({BUILD.relative_to(ROOT)})")
    return 0


if __name__ == "__main__":
    sys.exit(build(force="--force" in sys.argv[1:]))
