"""``make gpu-check`` without a GPU: a dry run that names each check, says what it would
measure on a GPU, and passes the checks a CPU can run (parity with torch.optim.Muon +
AdamW on a model built on the CPU and sharded, nothing held after set-up)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_gpu_check_dry_run_names_every_check(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    table = (tmp_path / "gpu_check.md").read_text()
    assert "dry run, no GPU" in table
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    for check in ("parity", "host syncs", "memory", "Newton-Schulz speed", "several GPUs",
                  "context parallelism", "bench gpu preset"):
        assert check in rows, (check, table)
    assert rows["parity"].rstrip().endswith("| pass |") and "0.00e+00" in rows["parity"]
    assert rows["memory"].rstrip().endswith("| pass |") and "unsharded buffers held: 0 B" in rows["memory"]
    assert "set_sync_debug_mode" in rows["host syncs"] and "not run here" in rows["host syncs"]


def _context_parallel_plumbing(rank, world, out):
    from pathlib import Path

    import torch

    from tools.gpu_check import check_context_parallel
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))  # torchrun's
    res = check_context_parallel(torch.device("cpu"), Path(out), degree=1)
    if rank == 0:
        with open(os.path.join(out, "cp.txt"), "w") as f:
            f.write(repr(res))


@pytest.mark.heavy
def test_context_parallel_check_runs_its_comparison_at_degree_1_on_cpu(tmp_path):
    """The GPU check of context parallelism (torchtitan's trainer at cp 2, FSDP2 against the
    one line) cannot run on CPU; its script runs the same comparison at cp 1 on 2 CPU
    ranks (torchtitan's CPU shim): 10 steps, within its bound."""
    from helpers.rank_pool import spawn
    spawn(_context_parallel_plumbing, 2, str(tmp_path), timeout=600)
    res = (tmp_path / "cp.txt").read_text()
    print(res)
    assert "'ok': True" in res and "'steps': 10" in res, res
