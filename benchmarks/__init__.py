"""Benchmarks (`make bench`): each module writes its results under benchmarks/results."""
from __future__ import annotations

import json
import os


def write_json(path: str, doc: dict, indent: int = 1) -> None:
    """Writes a benchmark's result ``doc`` to ``path`` (its folder made if missing), newline-ended."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=indent)
        f.write("\n")
