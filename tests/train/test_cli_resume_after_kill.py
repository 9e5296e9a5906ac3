"""`matrixfsdp train --save-every N --resume [DIR]`: a rank killed in the middle of a save
leaves the previous checkpoint as the latest complete one; resuming from it loses nothing
(same ranks: the losses of the killed run again, bit for bit) and works at other --ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch.distributed.checkpoint as dcp
from helpers.cli import run_cli
from helpers.inject_faults import train as train_with_faults

import matrixfsdp as mf
from matrixfsdp.state.files import COMPLETE, is_complete

if not sys.platform.startswith("linux"):
    pytest.skip("signals and /proc", allow_module_level=True)

TRAIN = [sys.executable, "-m", "matrixfsdp", "train", "--layers", "1", "--d-model", "32",
         "--heads", "2", "--mlp", "64", "--seq", "32", "--batch", "2", "--steps", "4",
         "--save-every", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _train(out, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    run = run_cli(*TRAIN[3:], "--ranks", str(ranks), "--out", str(out), *extra, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_rank_killed_mid_save_then_resume_loses_nothing(tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    # 1. the last rank stalls in the save of step 4 after writing its data, before the commit
    #    (the launcher runs in a thread of this process: its ranks are what is killed)
    crash: list = []
    launcher = threading.Thread(target=lambda: crash.append(train_with_faults(
        *TRAIN[3:], "--ranks", "2", "--out", str(out), faults="stall@1:4", env=ENV)))
    launcher.start()
    pid_file = out / "stalled_rank.pid"
    deadline = time.monotonic() + 180
    while not pid_file.exists():
        assert launcher.is_alive(), f"the run ended with no rank stalled in the save: {crash}"
        assert time.monotonic() < deadline, "no rank stalled in the save"
        time.sleep(0.2)
    time.sleep(0.3)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    launcher.join(60)
    assert not launcher.is_alive(), "the launcher did not end after its rank was killed"
    assert crash[0].returncode != 0 and "killed by signal SIGKILL" in crash[0].stderr, crash[0].stderr[-2000:]

    partial = ckpts / ".step_00000004.partial"
    assert is_complete(ckpts / "step_00000002")
    assert not (ckpts / "step_00000004").exists()
    assert (partial / ".metadata").is_file() and not (partial / COMPLETE).exists()
    assert mf.latest_checkpoint(ckpts) == ckpts / "step_00000002"
    # what the killed run had reached: its step-4 data, written but never committed
    reached = {"train": ""}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(reached, checkpoint_id=str(partial), no_dist=True)
    killed_losses = json.loads(reached["train"])["losses"]
    assert len(killed_losses) == 4

    # 2. resume at the same ranks: from step 2, and steps 3-4 give the killed run's losses exactly
    run = _train(out, 2, "--resume")
    assert f"resumed from {ckpts / 'step_00000002'} (step 2" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["losses"] == killed_losses
    assert summary["resumed_from"]["step"] == 2
    assert is_complete(ckpts / "step_00000004") and not partial.exists()
    assert [c["path"] for c in summary["checkpoints"]] == [str(ckpts / "step_00000004")]
    assert summary["checkpoints"][0]["bytes"] > 0

    # 3. resume at other --ranks from that same step-2 checkpoint, named explicitly
    other = tmp_path / "other"
    run = _train(other, 3, "--resume", str(ckpts / "step_00000002"))
    assert "saved at 2 ranks; now 3" in run.stdout
    summary = json.loads((other / "summary.json").read_text())
    assert summary["ranks"] == 3 and len(summary["losses"]) == 4
    assert summary["losses"][:2] == killed_losses[:2]
    assert is_complete(other / "checkpoints" / "step_00000004")
