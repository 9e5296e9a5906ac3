"""``make gpu-check`` without a GPU: a dry run that names each check, says what it would
measure on a GPU, and passes the checks a CPU can run (parity with torch.optim.Muon +
AdamW on a model built on the CPU and sharded, nothing held after set-up)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_gpu_check_dry_run_names_every_check(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    table = (tmp_path / "gpu_check.md").read_text()
    assert "dry run, no GPU" in table
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    for check in ("parity", "host syncs", "memory", "Newton-Schulz speed", "several GPUs",
                  "bench gpu preset"):
        assert check in rows, (check, table)
    assert rows["parity"].rstrip().endswith("| pass |") and "0.00e+00" in rows["parity"]
    assert rows["memory"].rstrip().endswith("| pass |") and "unsharded buffers held: 0 B" in rows["memory"]
    assert "set_sync_debug_mode" in rows["host syncs"] and "not run here" in rows["host syncs"]
