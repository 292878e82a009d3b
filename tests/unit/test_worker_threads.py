"""--worker-threads: `ampd up` splits the cores among its engine workers, and a worker applies it."""
import os

import torch

from ampd import launcher
from ampd.engine import use_threads


def test_ampd_up_splits_the_cores_among_its_engine_workers(tmp_path):
    cores = os.cpu_count() or 1
    dep = launcher.Deployment(launcher.Options(prefill="tp1*1", decode="tp1*2", run_dir=str(tmp_path)),
                              supervise=False)
    assert dep.worker_threads() == max(1, cores // 3)
    dep = launcher.Deployment(launcher.Options(prefill="tp1*1", decode="tp1*1", worker_threads=5,
                                              run_dir=str(tmp_path)), supervise=False)
    assert dep.worker_threads() == 5  # given: taken as is


def test_a_worker_sets_torch_and_openmp_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        use_threads(0)  # 0: torch's default stays
        assert torch.get_num_threads() == before and "OMP_NUM_THREADS" not in os.environ
        use_threads(1)
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)
