"""The committed stubs in ampd/v1 must be what `make proto` generates from proto/."""
from pathlib import Path

from ampd.protogen import ROOT, generate


def test_generated_stubs_are_fresh(tmp_path):
    generate(tmp_path)
    fresh = {p.name: p.read_text() for p in (tmp_path / "ampd" / "v1").iterdir() if p.is_file()}
    committed = {p.name: p.read_text() for p in (ROOT / "ampd" / "v1").iterdir()
                 if p.is_file() and p.suffix in (".py", ".pyi")}
    assert set(fresh) == set(committed), "stub files differ: run `make proto`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run `make proto` and commit ampd/v1"


def test_every_service_has_a_proto():
    names = {p.stem for p in (Path(ROOT) / "proto" / "ampd" / "v1").glob("*.proto")}
    assert {"coordinator", "prefill", "decode", "sidecar", "common"} <= names
