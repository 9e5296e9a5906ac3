"""One run per ``--out``: two ``matrixfsdp train`` started together on one empty directory
(before: both trained and committed, the later commit moving the other's step_N aside and
deleting it, both exiting 0), and a ``--resume`` retry while the first run still lives
(before: it ran to the end beside it). The second is refused at once, naming the
directory and the holder, and touches nothing of the first; once the first is SIGKILLed,
the retry is allowed (the kernel released the lock).

No wall-clock thresholds but hang guards: "at once" is asserted as "while the first run
still runs"."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import inject_faults
from helpers.cli import run_cli
from helpers.processes import rank_pids, still_alive

from matrixfsdp.state.files import is_complete
from matrixfsdp.state.integrity import verify_checkpoint
from matrixfsdp.train import outlock
from matrixfsdp.train.outlock import LOCK_NAME, OutInUse, lock_out

if not sys.platform.startswith("linux"):
    pytest.skip("flock, signals and /proc", allow_module_level=True)

ARGS = ["train", "--ranks", "2", "--layers", "1", "--d-model", "32", "--heads", "2", "--mlp", "64",
        "--seq", "32", "--batch", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
HANG_GUARD = 300.0


def _start(out, *extra: str, faults: str | None = None) -> subprocess.Popen:
    """``matrixfsdp train`` in a process of its own; ``faults``: injected into its ranks
    (:mod:`inject_faults`)."""
    args = [*ARGS, "--out", str(out), *extra]
    command = inject_faults.command(*args) if faults else [sys.executable, "-m", "matrixfsdp", *args]
    env = {**ENV, inject_faults.VARIABLE: faults} if faults else ENV
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


def _kill(*procs: subprocess.Popen) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _refusal(err: str, out, holder_pid: int) -> str:
    """The one line of a run refused because ``holder_pid``'s run holds ``out``."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    assert line.startswith(f"matrixfsdp train: error: --out {out} is in use by another run "
                           f"(pid {holder_pid} on host {socket.gethostname()} since "), line
    assert "matrixfsdp train" in line.split(" since ", 1)[1]  # the holder's command
    return line


def _tree(root) -> dict[str, tuple[int, int]]:
    """Every path under ``root``: (size, mtime in ns)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_the_lock_names_its_holder_and_ends_with_it(tmp_path, monkeypatch):
    """In one process: a second lock of the directory is refused naming the first's holder
    (another open of the file is another holder, as another process's would be), released
    it can be taken again; a filesystem without locks gives a lock that holds nothing."""
    out = tmp_path / "new" / "run"
    first = lock_out(out, ["matrixfsdp", "train", "--out", str(out)])
    with pytest.raises(OutInUse) as refused:
        lock_out(out)
    assert str(refused.value).startswith(
        f"--out {out} is in use by another run (pid {os.getpid()} on host {socket.gethostname()} since ")
    assert f": matrixfsdp train --out {out}); " in str(refused.value)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing else written
    first.release()
    lock_out(out).release()

    def no_locks(fd, op):
        raise OSError(37, "No locks available")
    monkeypatch.setattr(outlock.fcntl, "flock", no_locks)
    unguarded = lock_out(out)
    assert unguarded.fd is None and unguarded.unsupported == "No locks available"


def test_two_runs_started_together_on_one_out(tmp_path):
    out = tmp_path / "run"
    runs = [_start(out, "--steps", "8", "--save-every", "4") for _ in range(2)]
    try:
        ended: list[subprocess.Popen] = []
        deadline = time.monotonic() + HANG_GUARD
        while len(ended) < 2:
            ended += [p for p in runs if p not in ended and p.poll() is not None]
            assert time.monotonic() < deadline, "a run did not end"
            time.sleep(0.05)
        refused, winner = ended  # the refused one ends first: at once, the other still training
        r_out, r_err = refused.communicate()
        w_out, w_err = winner.communicate()
        assert refused.returncode == 2, r_err[-3000:]
        assert winner.returncode == 0, w_err[-3000:]
        print(_refusal(r_err, out, winner.pid))
        assert "MatrixFSDP plan" not in r_out  # no rank of it started
    finally:
        _kill(*runs)
    # the winner's work is whole: every checkpoint committed and intact, its summary its own
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{s:08d}" for s in (4, 8)]
    for d in ckpts.iterdir():
        assert is_complete(d)
        verify_checkpoint(d)
    assert len(json.loads((out / "summary.json").read_text())["losses"]) == 8
    holder = json.loads((out / LOCK_NAME).read_text())
    assert holder["pid"] == winner.pid and holder["host"] == socket.gethostname()


def test_resume_beside_a_live_run_is_refused_then_allowed_once_it_is_killed(tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    # 1. the first run stalls in the save of step 4 (its last rank sleeps before the commit)
    first = _start(out, "--steps", "4", "--save-every", "2", faults="stall@1:4")
    try:
        deadline = time.monotonic() + HANG_GUARD
        while not (out / "stalled_rank.pid").exists():
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no rank stalled in the save"
            time.sleep(0.1)
        time.sleep(0.3)
        before = _tree(out)

        # 2. a --resume retry while it lives: refused, nothing of the first run touched
        retry = run_cli(*ARGS, "--steps", "4", "--save-every", "2", "--out", str(out), "--resume",
                        env={"OMP_NUM_THREADS": "1"})
        assert retry.returncode == 2, retry.stderr[-3000:]
        print(_refusal(retry.stderr, out, first.pid))
        assert "MatrixFSDP plan" not in retry.stdout
        assert first.poll() is None
        assert _tree(out) == before

        # 3. the first run's launcher SIGKILLed: its ranks die with it, the kernel releases the lock
        ranks = rank_pids(first.pid)
        assert len(ranks) == 2, ranks
        os.kill(first.pid, signal.SIGKILL)
        assert first.wait(60) == -signal.SIGKILL
        deadline = time.monotonic() + 20  # a hang guard: they end at once
        while (alive := still_alive(ranks)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive, f"ranks {alive} outlived their SIGKILLed launcher"
    finally:
        _kill(first)
    assert is_complete(ckpts / "step_00000002") and not (ckpts / "step_00000004").exists()

    # 4. the retry now: allowed, resumes from step 2 and finishes
    again = run_cli(*ARGS, "--steps", "4", "--save-every", "2", "--out", str(out), "--resume",
                    env={"OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpts / 'step_00000002'} (step 2" in again.stdout
    assert is_complete(ckpts / "step_00000004")
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()  # this run's record
