"""The live decode worker's host KV tier settings (services/decode/tier.py): off by default and
inert; on, a host pool too small for one session's KV is refused with the sizes named, and so is an
engine that keeps its KV outside the worker's pool (nothing there for the tier to move). The tier at
work: tests/integration/test_decode_tier_live.py."""
from __future__ import annotations

import pytest

from ampd.config import ConfigError
from ampd.runtime import worker_config
from services.decode.server import build_parser
from services.decode.tier import check_host_tier

BASE = ["--worker-id", "d0", "--redis-url", "redis://127.0.0.1:1"]


def test_the_decode_worker_takes_the_tier_settings_off_by_default():
    cfg = worker_config(build_parser().parse_args(BASE), "decode", 1)
    assert (cfg.kv_host_mb, cfg.kv_offload_pressure, cfg.kv_prefetch_early) == (0.0, 0.7, False)
    check_host_tier(cfg.kv_host_mb, cfg.block_tokens, cfg.kv_bytes_per_token, 1 << 20)  # off: nothing
    cfg = worker_config(build_parser().parse_args(
        [*BASE, "--kv-host-mb", "64", "--kv-offload-pressure", "0.5", "--kv-prefetch-early"]), "decode", 1)
    assert (cfg.kv_host_mb, cfg.kv_offload_pressure, cfg.kv_prefetch_early) == (64.0, 0.5, True)


def test_a_host_pool_too_small_for_one_session_is_refused_with_its_sizes():
    # 1 MiB of 16-token blocks at 1024 bytes a token: 64 blocks, 1024 tokens; a session may reach 4096
    with pytest.raises(ConfigError) as e:
        check_host_tier(1, 16, 1024, 4096)
    msg = str(e.value)
    assert "--kv-host-mb 1" in msg and "1024 tokens" in msg and "4096 tokens" in msg and "at least 4" in msg


def test_a_big_enough_host_pool_is_taken_unless_the_engine_keeps_its_own_kv():
    assert check_host_tier(8, 16, 1024, 4096) == 512  # 8 MiB of 16 KiB blocks
    assert check_host_tier(0, 16, 1024, 4096, "sglang", kv_in_pool=False) == 0  # off: nothing
    with pytest.raises(ConfigError, match="engine 'sglang' keeps its KV outside the worker's pool"):
        check_host_tier(8, 16, 1024, 4096, "sglang", kv_in_pool=False)


def test_an_offload_pressure_outside_the_pool_is_refused():
    with pytest.raises(ConfigError, match=r"--kv-offload-pressure must be in \[0, 1\].*got 1.5"):
        check_host_tier(8, 16, 1024, 4096, offload_pressure=1.5)


@pytest.mark.parametrize("flags, says", [(["--kv-host-mb", "1"], "--kv-host-mb 1: "),
                                         (["--kv-host-mb", "64", "--kv-offload-pressure", "1.5"],
                                          "--kv-offload-pressure must be in [0, 1]")])
def test_the_decode_process_refuses_the_tier_at_start_up_before_redis(flags, says):
    """The real start-up path (the mock engine's pool): the refusal comes before Redis is dialled."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "services.decode", *BASE, "--port", "0", *flags],
                       cwd=root, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert p.returncode != 0
    first = p.stderr.splitlines()[0]
    assert first.startswith("ampd-decode: error: " + says) and "Redis" not in first
    assert "Traceback" not in p.stderr, p.stderr  # the one line only: the gRPC server started is stopped
