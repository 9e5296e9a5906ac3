"""The per-operation step profile runs, and its timed step is the real Muon step (it checks
bit-equality itself and raises otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_step_ops_profile_matches_the_real_step():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "matrixfsdp.bench.step_ops", "--ranks", "2",
                          "--steps", "3"], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert len(rows) == 2 and all(row.endswith("x |") for row in rows), out.stdout
