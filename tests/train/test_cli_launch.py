"""The launcher of ``matrixfsdp train`` under failure: a rank killed mid-training ends the
run, naming the rank, without waiting for the surviving rank's collective to time out;
SIGTERM to the launcher ends every rank before the launcher itself exits. Neither leaves a
process behind. A launcher (or torchrun's agent) SIGKILLed mid-run takes its ranks with it
within a fraction of a second (20 s is the hang guard), and no checkpoint is committed after.

The one time in these tests is :data:`END_LIMIT`: the run must end well before the process
group's timeout (``cli.DEFAULT_TIMEOUT_S``, 300 s), which is what would end it if the
launcher did not notice; 30 s is 10x below that and far above the ~1 s it takes when
shared cores are busy, so it never fails by load alone. The waits after the end (for the
output to be read to its end, for the last processes to leave) end as soon as that has
happened, with END_LIMIT as their hang guard."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers.processes import child_pids, rank_pids, session_processes, still_alive

if not sys.platform.startswith("linux"):
    pytest.skip("reads /proc", allow_module_level=True)

END_LIMIT = 30.0  # seconds: see the module docstring
TRAIN = ["train", "--ranks", "2", "--steps", "1000000", "--layers", "1", "--d-model", "32",
         "--heads", "2", "--mlp", "64", "--seq", "32", "--batch", "2"]


def _ignore_sigint() -> None:
    """As a background job of a non-interactive shell (``cmd &`` in a script, ``nohup cmd &``)
    starts: SIGINT ignored, which every process it starts inherits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Launcher:
    """``matrixfsdp train`` in a session of its own, its output read as it comes."""

    def __init__(self, tmp_path, *extra: str, ignore_sigint: bool = False):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "matrixfsdp", *TRAIN, "--out", str(tmp_path), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True, preexec_fn=_ignore_sigint if ignore_sigint else None)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=lambda s=stream, k=sink: k.extend(s), daemon=True)
                        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def wait_training(self, limit: float = 60.0) -> list[int]:
        """Block until rank 0 is in the training loop; return the ranks' pids."""
        deadline = time.monotonic() + limit
        while not any("corpus:" in line for line in self.out):
            assert self.proc.poll() is None, "".join(self.err)[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        time.sleep(0.5)  # a few steps in
        ranks = rank_pids(self.proc.pid)
        assert len(ranks) == 2, session_processes(self.proc.pid)
        return ranks

    def finish(self, limit: float = END_LIMIT) -> int:
        """The launcher's exit status; fails if it still runs ``limit`` s later."""
        try:
            return self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"launcher still running {limit} s later") from None

    def drain(self, limit: float = END_LIMIT) -> None:
        """Wait until the output has been read to its end (every process holding the pipes
        has left)."""
        for reader in self.readers:
            reader.join(limit)
        assert not any(r.is_alive() for r in self.readers), \
            f"output still open {limit} s later; still running: {session_processes(self.proc.pid)}"

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *session_processes(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def assert_nothing_left(self, limit: float = END_LIMIT) -> None:
        # multiprocessing's resource tracker leaves once the launcher and ranks are gone
        deadline = time.monotonic() + limit
        while (left := session_processes(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            self.kill_all()
        assert not left, f"left behind: {left}"


def test_a_killed_rank_ends_the_run_naming_it(tmp_path):
    run = _Launcher(tmp_path)
    try:
        victim = run.wait_training()[-1]
        os.kill(victim, signal.SIGKILL)
        rc = run.finish()
        run.drain()
        err = "".join(run.err)
        assert rc != 0
        assert re.search(rf"matrixfsdp train: rank [01] \(pid {victim}\) was killed by signal SIGKILL",
                         err), err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        run.assert_nothing_left()
    finally:
        run.kill_all()


def test_sigterm_to_the_launcher_ends_every_rank_first(tmp_path):
    run = _Launcher(tmp_path)
    try:
        ranks = run.wait_training()
        os.kill(run.proc.pid, signal.SIGTERM)
        rc = run.finish()
        alive = [pid for pid in ranks if pid in session_processes(run.proc.pid)]
        assert not alive, f"ranks {alive} outlived the launcher"
        assert rc == 128 + signal.SIGTERM, rc
        run.drain()
        assert "stopped by SIGTERM; all ranks ended" in "".join(run.err)
        run.assert_nothing_left()
    finally:
        run.kill_all()


def _committed(ckpts) -> list[str]:
    return sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) if ckpts.is_dir() else []


def _first_checkpoint(proc, ckpts, err) -> None:
    deadline = time.monotonic() + 120  # a hang guard
    while not (ckpts / "step_00000010").is_dir():
        assert proc.poll() is None, "".join(err)[-3000:]
        assert time.monotonic() < deadline, "no checkpoint committed"
        time.sleep(0.05)


def _sigkill_launcher(proc, ranks: list[int], out) -> float:
    """SIGKILL ``proc`` mid-run: every one of ``ranks`` must be gone within 20 s (a hang
    guard: it takes a fraction of a second) and no checkpoint appear after. Returns the
    seconds from the SIGKILL to the last rank gone."""
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    assert proc.wait(END_LIMIT) == -signal.SIGKILL
    while (alive := still_alive(ranks)) and time.monotonic() - killed < 20:
        time.sleep(0.01)
    gone_s = time.monotonic() - killed
    assert not alive, f"ranks {alive} still run {gone_s:.1f} s after their launcher was SIGKILLed"
    committed = _committed(out / "checkpoints")
    print(f"last rank gone {gone_s:.2f} s after the launcher's SIGKILL; committed: {committed}")
    time.sleep(2.0)  # a window for any leftover writer to show itself
    assert _committed(out / "checkpoints") == committed
    assert "step_00000400" not in committed and not (out / "summary.json").exists()
    return gone_s


def test_sigkill_to_the_launcher_ends_every_rank_and_nothing_is_committed_after(tmp_path):
    """A scheduler or the OOM killer SIGKILLs the launcher mid-run, which was started with
    SIGINT ignored as background jobs are (torch's own parent-death signal is SIGINT: these
    ranks trained on and committed every checkpoint to step 400). Every rank must be gone
    within seconds (the kernel SIGKILLs it: PR_SET_PDEATHSIG), and no checkpoint appear after."""
    run = _Launcher(tmp_path, "--steps", "400", "--save-every", "10", ignore_sigint=True)
    try:
        _first_checkpoint(run.proc, tmp_path / "checkpoints", run.err)
        ranks = rank_pids(run.proc.pid)
        assert len(ranks) == 2, session_processes(run.proc.pid)
        _sigkill_launcher(run.proc, ranks, tmp_path)
        run.drain()
        run.assert_nothing_left()
    finally:
        run.kill_all()


def test_sigkill_to_torchrun_ends_its_ranks(tmp_path):
    """The same under torchrun, whose agent starts each rank in a session of its own and
    sets no parent-death signal: the ranks of a SIGKILLed agent trained on."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    err: list[str] = []
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "matrixfsdp", *TRAIN[:1], *TRAIN[3:], "--steps", "400", "--save-every", "10",
         "--out", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    ranks: list[int] = []
    try:
        _first_checkpoint(proc, tmp_path / "checkpoints", err)
        ranks = child_pids(proc.pid)
        assert len(ranks) == 2, ranks
        _sigkill_launcher(proc, ranks, tmp_path)
    finally:
        for pid in [proc.pid, *still_alive(ranks)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
