"""The compiled cores (ampd/compiled.py, built by `make compile`, which `make test` runs first) are
built from the sources as they are, and the simulator gives the same results on them as on the
Python sources: every hash of benchmarks/sim_fingerprint.py's 32 runs; and the unit tests that use
a core pass on the compiled cores too (``on_compiled``)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from ampd import compiled

ROOT = Path(__file__).resolve().parents[2]
CORE = re.compile(r"^\s*(from|import) ampd\.(sim|worker|policy|perf|window|workload)\b", re.M)
# Unit tests that use a core but stay on the sources: a compiled class takes no interpreted subclass
# and no stand-in ``self``, and a compiled caller does not see a patched method (``monkeypatch``).
SOURCES_ONLY = {"test_decode_tier.py": "subclasses the simulator's Tiering",
                "test_policy_outlen.py": "calls Admitting.expected_kv on a stand-in"}


def on_compiled() -> list[str]:
    """The unit test files that use a core and run on the compiled cores too."""
    out = []
    for p in sorted((ROOT / "tests" / "unit").glob("test_*.py")):
        text = p.read_text()
        if CORE.search(text) and "monkeypatch" not in text and p.name not in SOURCES_ONLY:
            out.append(str(p.relative_to(ROOT)))
    return out


def _run(args: list[str], on_compiled: bool, timeout: int = 600, **env_extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, AMPD_COMPILED="1" if on_compiled else "0", **env_extra)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_build_matches_the_sources():
    manifest = compiled.read_manifest()
    assert manifest is not None, "no compiled cores in build/mypyc: run `make compile`"
    assert not compiled.outdated(manifest), f"{compiled.outdated(manifest)}: run `make compile`"


def test_the_simulator_gives_the_same_fingerprints_on_the_compiled_cores(tmp_path):
    outs = {}
    for on in (False, True):
        out = tmp_path / f"{on}.json"
        r = _run(["-m", "benchmarks.sim_fingerprint", "--json", str(out)], on)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        first = r.stdout.splitlines()[0]
        assert first == ("cores: compiled" if on else "cores: python (AMPD_COMPILED=0)"), first
        outs[on] = json.loads(out.read_text())
    def hashes(doc: dict) -> dict:  # (each run's hashes and summary; not its wall-clock seconds)
        return {name: {k: v for k, v in run.items() if k != "wall_s"} for name, run in doc["runs"].items()}

    compiled_runs, source_runs = hashes(outs[True]), hashes(outs[False])
    assert len(compiled_runs) == 32
    differ = [name for name in source_runs if compiled_runs.get(name) != source_runs[name]]
    assert not differ, differ


def test_the_cores_unit_tests_pass_on_the_compiled_cores():
    files = on_compiled()
    assert len(files) >= 30, files  # (the rule above still finds the cores' tests)
    # (tests/conftest.py installs the compiled cores under AMPD_TEST_COMPILED, and fails if it cannot)
    r = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", *files], True, AMPD_TEST_COMPILED="1")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1], r.stdout[-500:]
