"""The live decode worker's host KV tier settings (services/decode/tiersize.py): off with
--kv-host-ratio 0, sized by --kv-host-ratio (1, the default: the device pool's size) or by
--kv-host-mb. An explicit --kv-host-mb too small for one session's KV, or larger than the memory the
process may use, is refused with the sizes named, and so is one for an engine that keeps its KV
outside the worker's pool (nothing there for the tier to move); a ratio-sized pool never refuses a
start. The tier at work: tests/integration/test_kv_tier_live.py."""
from __future__ import annotations

import pytest

from ampd.config import ConfigError
from ampd.runtime import worker_config
from services.decode.server import build_parser
from ampd.policy.hostpool import MIB
from services.decode.tiersize import available_memory_bytes, check_host_tier

BASE = ["--worker-id", "d0", "--redis-url", "redis://127.0.0.1:1"]


def test_the_decode_worker_takes_the_tier_at_ratio_1_by_default_off_at_0_and_sized_by_the_ratio_or_in_mib():
    cfg = worker_config(build_parser().parse_args(BASE), "decode", 1)
    assert (cfg.kv_host_ratio, cfg.kv_host_mb, cfg.kv_offload_pressure, cfg.kv_prefetch_early) == (1.0, 0.0, 0.7, False)
    cfg = worker_config(build_parser().parse_args([*BASE, "--kv-host-ratio", "0"]), "decode", 1)
    size = check_host_tier(cfg.kv_host_mb, 16, 1024, 4096, ratio=cfg.kv_host_ratio, device_bytes=4 * MIB)
    assert (size.mb, size.source, size.note) == (0.0, "off", "")
    cfg = worker_config(build_parser().parse_args([*BASE, "--kv-host-ratio", "1"]), "decode", 1)
    # 4096 tokens of 1 KiB in 16-token blocks: the device pool is 4 MiB, and so is the host pool
    size = check_host_tier(cfg.kv_host_mb, 16, 1024, 4096, ratio=cfg.kv_host_ratio, device_bytes=4 * MIB)
    assert (size.mb, size.source, size.note) == (4.0, "ratio", "")
    cfg = worker_config(build_parser().parse_args(
        [*BASE, "--kv-host-mb", "64", "--kv-offload-pressure", "0.5", "--kv-prefetch-early"]), "decode", 1)
    assert (cfg.kv_host_mb, cfg.kv_offload_pressure, cfg.kv_prefetch_early) == (64.0, 0.5, True)
    size = check_host_tier(cfg.kv_host_mb, 16, 1024, 4096, ratio=cfg.kv_host_ratio, device_bytes=4 * MIB)
    assert (size.mb, size.source) == (64.0, "explicit")  # --kv-host-mb overrides the ratio
    size = check_host_tier(cfg.kv_host_mb, 16, 1024, 4096, ratio=1, device_bytes=4 * MIB)
    assert (size.mb, size.source) == (64.0, "explicit")


def test_a_ratio_sized_pool_is_cut_to_the_memory_left_and_never_refuses_a_start():
    # 2 x a 4 MiB device pool wants 8 MiB; 10 MiB available: cut to half of it, 5 MiB, and logged
    size = check_host_tier(0, 16, 1024, 4096, ratio=2, device_bytes=4 * MIB, available_bytes=10 * MIB)
    assert (size.mb, size.source) == (5.0, "ratio")
    assert "cut from 8.0 MiB" in size.note and "to 5.0 MiB" in size.note and "10 MiB" in size.note
    # 6 MiB available: 3 MiB cannot hold one session's 4096 tokens (4 MiB): off, saying so, no error
    size = check_host_tier(0, 16, 1024, 4096, ratio=2, device_bytes=4 * MIB, available_bytes=6 * MIB)
    assert (size.mb, size.source) == (0.0, "off")
    assert "to 3.0 MiB" in size.note and "4096 tokens (4.0 MiB)" in size.note and "tier is off" in size.note
    size = check_host_tier(0, 16, 1024, 4096, ratio=0.5, device_bytes=4 * MIB)  # a ratio too small: off too
    assert (size.mb, size.source) == (0.0, "off") and "is 2.0 MiB" in size.note
    # an engine that keeps its own KV (sglang): the ratio-sized tier is off, the start goes on
    size = check_host_tier(0, 16, 1024, 4096, "sglang", kv_in_pool=False, ratio=1, device_bytes=4 * MIB)
    assert (size.mb, size.source) == (0.0, "off") and "engine 'sglang'" in size.note


def test_an_explicit_host_pool_larger_than_the_memory_left_is_refused_with_the_sizes():
    with pytest.raises(ConfigError) as e:
        check_host_tier(64, 16, 1024, 4096, ratio=1, device_bytes=4 * MIB, available_bytes=32 * MIB)
    msg = str(e.value)
    assert "--kv-host-mb 64" in msg and "32 MiB" in msg and "at most 32" in msg
    assert check_host_tier(16, 16, 1024, 4096, available_bytes=32 * MIB).mb == 16


def test_the_memory_left_is_read_from_the_host():
    left = available_memory_bytes()
    assert left is not None and 0 < left < 1 << 50  # Linux: /proc/meminfo's MemAvailable at least


def test_a_host_pool_too_small_for_one_session_is_refused_with_its_sizes():
    # 1 MiB of 16-token blocks at 1024 bytes a token: 64 blocks, 1024 tokens; a session may reach 4096
    with pytest.raises(ConfigError) as e:
        check_host_tier(1, 16, 1024, 4096)
    msg = str(e.value)
    assert "--kv-host-mb 1" in msg and "1024 tokens" in msg and "4096 tokens" in msg and "at least 4" in msg


def test_a_big_enough_host_pool_is_taken_unless_the_engine_keeps_its_own_kv():
    assert check_host_tier(8, 16, 1024, 4096).mb == 8  # 8 MiB: 512 blocks of 16 KiB
    assert check_host_tier(0, 16, 1024, 4096, "sglang", kv_in_pool=False).mb == 0  # off: nothing
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
