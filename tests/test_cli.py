"""The main job and the planner, as a user types them."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _run(*args, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "matrixfsdp.cli", *args], capture_output=True,
                         text=True, timeout=300, env=env, cwd=cwd)
    assert out.returncode == 0, f"matrixfsdp {' '.join(args)} exited {out.returncode}:\n{out.stderr[-4000:]}"
    return out


def test_train_runs_and_learns(tmp_path):
    out = _run("train", "--ranks", "2", "--steps", "12", "--layers", "1", "--d-model", "32",
               "--heads", "2", "--mlp", "64", "--seq", "32", "--batch", "4",
               "--out", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ranks"] == 2 and len(summary["losses"]) == 12
    assert summary["loss_end"] < summary["loss_start"]
    assert summary["collectives_per_step"] == {"gather_v": 3, "reduce_v": 2}
    assert "== summary ==" in out.stdout and "plan balance" in out.stdout


def test_plan_paper_model():
    out = _run("plan", "--model", "paper", "--world-size", "8").stdout
    assert "192 Muon matrices" in out  # 32 layers x (q, k, v, o, fc, proj)
    assert "NS cost imbalance (max/mean): 1.000" in out
