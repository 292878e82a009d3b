"""The pure parts of `make test-compose` (tests/compose/): the swap verdict, the start tiers, the
compose file resolved for podman-compose 1.0.3; and `python -m ampd.healthcheck` against real servers."""
from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "compose"))
import stack  # noqa: E402
import verdict  # noqa: E402

W = "decode-0"


def sess(i, worker=W, completed=True, error="", started=0.0, ended=10.0):
    return {"id": f"s{i}", "decode_worker": worker, "completed": completed, "error": error,
            "started": started, "ended": ended}


def test_outcomes():
    assert verdict.outcome(sess(0)) == "completed"
    assert verdict.outcome(sess(0, completed=False, error="UNAVAILABLE: decode worker lost")) == "failed"
    assert verdict.outcome(sess(0, completed=False, error="DEADLINE_EXCEEDED: Deadline Exceeded")) == "hung"
    assert verdict.outcome(sess(0, completed=False, ended=None)) == "hung"
    assert verdict.outcome(sess(0, completed=False)) == "lost"
    assert verdict.outcome(sess(0, completed=False, error="expected 4 rounds, got 3")) == "lost"


def test_hit_means_bound_there_and_open_in_the_window():
    assert verdict.is_hit(sess(0, started=1, ended=6), W, 5, 9)
    assert verdict.is_hit(sess(0, started=8, ended=20), W, 5, 9)
    assert not verdict.is_hit(sess(0, started=1, ended=4), W, 5, 9)       # ended before the swap
    assert not verdict.is_hit(sess(0, started=10, ended=20), W, 5, 9)     # opened after it
    assert not verdict.is_hit(sess(0, worker="decode-1", started=1, ended=20), W, 5, 9)
    assert verdict.is_hit(sess(0, worker="", completed=False, error="UNAVAILABLE: x", started=6, ended=7), W, 5, 9)


def test_judge_lenient_accepts_clear_failures_on_the_swapped_worker_only():
    runs = [sess(0, started=1, ended=20, completed=False, error="UNAVAILABLE: worker lost"),
            {**sess(1, started=2, ended=30), "recovered_rounds": 2},  # recovered
            sess(2, worker="decode-1", started=1, ended=20)]
    v = verdict.judge(runs, W, 5, 9)
    assert v.ok, v.problems
    assert v.hit == {"failed": 1, "completed": 1} and v.others == {"completed": 1} and v.on_worker == 2
    assert v.recovered_rounds == 2 and "recovered 1" in v.summary()
    strict = verdict.judge(runs, W, 5, 9, require_complete=True)
    assert not strict.ok and "s0" in strict.problems[0]


@pytest.mark.parametrize("bad", [
    sess(9, started=1, ended=20, completed=False, error="DEADLINE_EXCEEDED: Deadline Exceeded"),
    sess(9, started=1, ended=20, completed=False),
    sess(9, worker="decode-1", started=1, ended=20, completed=False, error="UNAVAILABLE: x"),
])
def test_judge_rejects_hangs_silent_losses_and_collateral_failures(bad):
    v = verdict.judge([sess(0, started=1, ended=20), bad], W, 5, 9)
    assert not v.ok and any("s9" in p for p in v.problems)


def test_judge_needs_the_swap_to_hit_something():
    v = verdict.judge([sess(0, started=1, ended=2), sess(1, worker="decode-1", started=1, ended=20)], W, 5, 9)
    assert not v.ok and "hit no running session" in v.problems[-1]
    with pytest.raises(ValueError):
        verdict.judge([], W, 9, 5)


def test_start_tiers_follow_depends_on():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    names = stack.selected(services)
    assert "redis" in names and "coordinator" in names and not {"prometheus", "grafana"} & set(names)
    order = stack.tiers(services, names)
    level = {n: i for i, tier in enumerate(order) for n in tier}
    assert sorted(level) == sorted(names)
    for n in names:
        for dep in services[n].get("depends_on") or ():
            assert level[dep] < level[n], (n, dep)
    with pytest.raises(stack.Failed, match="cycle"):
        stack.tiers({"a": {"depends_on": {"b": {}}}, "b": {"depends_on": ["a"]}}, ["a", "b"])


def test_resolve_interpolates_like_compose(tmp_path):
    import resolve

    (tmp_path / "docker-compose.yml").write_text(
        "x: &x\n  e: ${ONE:-}\nservices:\n  a:\n    <<: *x\n    image: ${IMG:-ampd:local}\n"
        "    build: .\n    volumes: [./deploy/p.yml:/etc/p.yml:ro]\n"
        "    command: [\"$$HOME\", \"${TWO-two}\", \"${THREE}\", \"${ENVFILE:-no}\"]\n")
    (tmp_path / ".env").write_text("# settings\nENVFILE='from .env'\nIMG=fromenvfile\n")
    doc = resolve.resolve(tmp_path / "docker-compose.yml", {"IMG": "shell:1", "TWO": ""})
    a = doc["services"]["a"]
    assert a["e"] == "" and a["image"] == "shell:1", "the shell wins over .env; empty means the default"
    assert a["command"] == ["$$HOME", "", "", "from .env"]
    assert a["build"] == {"context": str(tmp_path)}
    assert a["volumes"] == [f"{tmp_path}/deploy/p.yml:/etc/p.yml:ro"]
    (tmp_path / "bad.yml").write_text("a: ${X?required}\n")
    with pytest.raises(resolve.ResolveError, match="unsupported"):
        resolve.resolve(tmp_path / "bad.yml", {})
    (tmp_path / "req.yml").write_text("a: ${X:?set X}\n")
    assert resolve.resolve(tmp_path / "req.yml", {"X": "x"}) == {"a": "x"}
    with pytest.raises(resolve.ResolveError, match="X: set X"):
        resolve.resolve(tmp_path / "req.yml", {"X": ""})
    # The real file resolves with only its required secret set, and leaves no variable behind.
    text = yaml.safe_dump(resolve.resolve(ROOT / "docker-compose.yml", {"AMPD_INTERNAL_TOKEN": "s"}))
    assert "${" not in text and "redis:7" in text


# ---------------------------------------------------------------------------- python -m ampd.healthcheck
def healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampd.healthcheck", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


async def test_healthcheck_grpc_serving_and_not():
    import asyncio

    from ampd import grpcserver

    server, port, _health = await grpcserver.start_server("127.0.0.1:0", lambda s: None, [])
    try:
        ok = await asyncio.to_thread(healthcheck, f"127.0.0.1:{port}")
        assert ok.returncode == 0, ok.stderr
    finally:
        await server.stop(None)
    down = await asyncio.to_thread(healthcheck, f"127.0.0.1:{port}", "--timeout", "1")
    assert down.returncode == 1 and "unhealthy" in down.stderr and "UNAVAILABLE" in down.stderr


def test_healthcheck_http_and_bad_input():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{srv.server_port}"
        assert healthcheck("--http", f"{base}/health").returncode == 0
        bad = healthcheck("--http", f"{base}/nope")
        assert bad.returncode == 1 and "404" in bad.stderr
    finally:
        srv.shutdown()
    usage = healthcheck("127.0.0.1:1", "--timeout", "0")
    assert usage.returncode == 2 and "--timeout must be > 0" in usage.stderr and "Traceback" not in usage.stderr
