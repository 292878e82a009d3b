"""A replay through a live mock deployment, as the integration tests run it (not a test module)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from ampd import perf
from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.workload import Session
from tests.integration.rpc_metrics import worker_metrics


def replayed(opts: Options, sessions: list[Session], timeout_s: float = 60.0):
    """(records, replay stats, worker id -> Metrics values): ``sessions`` replayed through a deployment
    of ``opts`` with every token verified, the workers' metrics read before it stops."""
    with Deployment(opts) as dep:
        records, stats, _, _ = asyncio.run(replay(dep.coordinator, sessions, verify_tokens=True, progress=False,
                                                  timeout_s=timeout_s))
        metrics = {w: m for w, (_, m) in asyncio.run(worker_metrics(opts.deployment.redis_url,
                                                                      opts.deployment.namespace)).items()}
    return records, stats, metrics


def fast_profile(tmp_path: Path, name: str, kv_tokens: int | None = None) -> str:
    """zero@none with a prefill of 20 ms plus 0.1 ms a token (so skipped tokens show) and 5 ms decode
    steps (and a KV pool of ``kv_tokens``), written as ``name`` under ``tmp_path``; its path."""
    d = json.loads((Path(perf.__file__).parent / "profiles" / "zero@none.json").read_text())
    d["name"] = name
    t1 = d["tp"]["1"]
    if kv_tokens is not None:
        t1["kv_capacity_tokens"] = kv_tokens
    t1["t_pre"]["l_incr"]["alpha"] = [0.02] * len(t1["t_pre"]["l_incr"]["alpha"])
    t1["t_pre"]["l_incr"]["beta"] = [1e-4] * len(t1["t_pre"]["l_incr"]["beta"])
    t1["t_dec"]["batch"]["alpha"] = [0.005] * len(t1["t_dec"]["batch"]["alpha"])
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(d))
    return str(path)
