"""The committed stubs in ampd/v1 must be what `make proto` generates from proto/."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path):
    # In a subprocess: grpc_tools bundles its own protobuf, which must not share a process with
    # NIXL's (the integration tests import NIXL).
    subprocess.run([sys.executable, "-m", "ampd.protogen", "--out", str(tmp_path)], check=True, cwd=ROOT)
    fresh = {p.name: p.read_text() for p in (tmp_path / "ampd" / "v1").iterdir() if p.is_file()}
    committed = {p.name: p.read_text() for p in (ROOT / "ampd" / "v1").iterdir()
                 if p.is_file() and p.suffix in (".py", ".pyi")}
    assert set(fresh) == set(committed), "stub files differ: run `make proto`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run `make proto` and commit ampd/v1"


def test_every_service_has_a_proto():
    names = {p.stem for p in (ROOT / "proto" / "ampd" / "v1").glob("*.proto")}
    assert {"coordinator", "prefill", "decode", "sidecar", "common"} <= names
