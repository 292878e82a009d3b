"""Generates the protobuf and gRPC stubs in ampd/v1 from proto/ampd/v1 (`make proto`)."""
from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc
import grpc_tools

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "ampd" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Writes ampd/v1/*_pb2.py, *_pb2.pyi and *_pb2_grpc.py under out_dir."""
    include = Path(grpc_tools.__file__).parent / "_proto"
    (out_dir / "ampd" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    init = out_dir / "ampd" / "v1" / "__init__.py"
    init.write_text('"""Generated from proto/ampd/v1 by `make proto`; do not edit."""\n')


if __name__ == "__main__":
    # `--out DIR` generates elsewhere (the staleness test compares with the committed stubs).
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else ROOT
    generate(out)
    print(f"generated {len(proto_files())} protos into {out / 'ampd' / 'v1'}", file=sys.stderr)
