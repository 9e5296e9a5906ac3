"""`matrixfsdp train` never destroys work: --resume without a checkpoint, a run into an --out
that holds checkpoints, a corrupt newest checkpoint and a model of another shape are refused
before any rank starts; --resume-fallback loads the previous checkpoint saying so, the data
order continues under the saved seed, --keep-last prunes; a raising rank ends the run at
once, named first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.cli import run_cli
from helpers.inject_faults import train as train_with_faults

from matrixfsdp.__main__ import main
from matrixfsdp.state.files import is_complete

if not sys.platform.startswith("linux"):
    pytest.skip("signals and /proc", allow_module_level=True)

TRAIN = [sys.executable, "-m", "matrixfsdp", "train", "--layers", "1", "--d-model", "32",
         "--heads", "2", "--mlp", "64", "--seq", "32", "--batch", "2", "--ranks", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(*extra: str, env=None) -> subprocess.CompletedProcess:
    return run_cli(*TRAIN[3:], *extra, env=env or ENV)


def _refused(capsys, *extra: str, needles: tuple[str, ...]) -> str:
    """``matrixfsdp train ...`` refused before any rank starts: exit 2 with a one-line error.
    Run in this process (the command's own ``main``): a refusal never reaches the launcher,
    and one that did would start ranks and fail these asserts. Returns its stdout."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main([*TRAIN[3:], *extra])
    out, err = capsys.readouterr()
    assert stop.value.code == 2, (stop.value.code, err[-2000:])
    last = err.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, last
    assert "Traceback" not in err and "MatrixFSDP plan" not in out  # no rank started
    return out


def test_resume_never_destroys(tmp_path, capsys):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    first = _run("--steps", "6", "--save-every", "2", "--keep-last", "2", "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004", "step_00000006"]  # step 2 pruned
    losses = json.loads((out / "summary.json").read_text())["losses"]
    stamps = {p: p.stat().st_mtime_ns for p in ckpts.rglob("*")}

    # an earlier run's checkpoints are never overwritten by a run that did not ask to resume
    _refused(capsys, "--steps", "6", "--save-every", "2", "--out", str(out),
             needles=(f"--out {out} already holds checkpoints ({ckpts}: step_00000004 .. step_00000006)",))
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(capsys, "--steps", "6", "--resume", str(empty), "--out", str(tmp_path / "x"),
             needles=(f"--resume {empty}: no complete checkpoint in {empty} or", "--resume-or-start"))
    # --resume <out> (not <out>/checkpoints) finds them; another model shape is an error
    _refused(capsys, "--steps", "8", "--resume", str(out), "--out", str(out), "--d-model", "64",
             needles=("the model differs from the checkpoint's: --d-model 64 (checkpoint: 32)",))
    assert {p: p.stat().st_mtime_ns for p in ckpts.rglob("*")} == stamps

    # a corrupt newest checkpoint is refused naming the file; --resume-fallback takes the previous
    shard = ckpts / "step_00000006" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])  # 16 flipped bytes
    shard.write_bytes(data)
    resume = ["--steps", "8", "--save-every", "2", "--keep-last", "2", "--resume", str(out),
              "--out", str(out)]
    _refused(capsys, *resume, needles=(f"{shard} does not match its checksum", "--resume-fallback"))
    run = _run(*resume, "--resume-fallback", "--seed", "7", "--lr", "0.03")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{shard} does not match its checksum (the file changed after the save); refusing to load it; " \
           "--resume-fallback: trying the previous complete checkpoint" in run.stdout
    assert "--seed 7 differs from the checkpoint's 0; using 0 so that the data order continues" in run.stdout
    assert "--lr 0.03 differs from the checkpoint's 0.02; the checkpoint's is used" in run.stdout
    assert f"resumed from {ckpts / 'step_00000004'} (step 4" in run.stdout
    resumed = json.loads((out / "summary.json").read_text())["losses"]
    assert resumed[:6] == losses  # steps 5-6 again under the saved seed: the same batches, bit for bit
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000006", "step_00000008"]
    assert all(is_complete(ckpts / n) for n in ("step_00000006", "step_00000008"))

    # a newest checkpoint without its marker is skipped, saying which and why (before: silently)
    os.remove(ckpts / "step_00000008" / "COMPLETE")
    out_text = _refused(capsys, "--steps", "8", "--resume", str(out), "--out", str(out), "--layers", "2",
                        needles=("--layers 2 (checkpoint: 1)",))
    assert f"--resume: skipping {ckpts / 'step_00000008'}: it has no COMPLETE file" in out_text


def test_a_raising_rank_ends_the_run_at_once_naming_it_first(tmp_path):
    """Rank 1 raises at step 2: the launcher names rank 1 and its exception first, and the run
    ends without any rank finishing. What made this slow before (9.9 s from the start of
    training; now 0.3 s from the rank's report to the command's exit, measured on a loaded
    2-core machine) was the raising rank's normal interpreter exit (about 7 s: torch's error
    file, finalization with gloo's threads alive). No time is asserted (shared cores); the
    structural evidence is the launcher's line: it is the one made from the rank's own
    report after the rank left at once through ``exit_rank`` (torch's process-exit branch of
    the launcher, ``rank 1 failed: ...``); a rank that let the exception reach torch's process
    wrapper and exit normally gives torch's other branch (``rank 1 (pid N) failed: ...``)."""
    run = train_with_faults(*TRAIN[3:], "--steps", "4", "--out", str(tmp_path), faults="raise@1:2", env=ENV)
    lines = run.stderr.splitlines()
    failed = [ln for ln in lines if "failed" in ln]
    assert run.returncode == 1 and failed, lines[-20:]
    assert failed[0] == "rank 1 failed: RuntimeError: injected fault at step 2", failed
    summary = [ln for ln in lines if ln.startswith("matrixfsdp train:")]
    assert summary == ["matrixfsdp train: rank 1 failed: RuntimeError: injected fault at step 2; "
                       "the other ranks were stopped"], lines[-5:]
    assert lines.index(failed[0]) < lines.index(summary[0])  # the rank's report, then the launcher's
    assert not (tmp_path / "summary.json").exists()  # no rank ran to the end (rank 0 writes it last)
