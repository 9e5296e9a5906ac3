"""Test helper: faults injected into the rank processes of `matrixfsdp train` from outside the
library (the library has no test hooks).

``INJECT_FAULTS=KIND@R:S[,KIND@R:S...]`` (``R`` a rank, or ``*`` for every rank) names them:

* ``raise`` / ``hang``: rank R raises ``RuntimeError("injected fault at step S")``, or
  sleeps an hour, at the start of training step S (0-based, before its forward);
* ``nanloss``: rank R's loss at step S is multiplied by NaN (every micro-batch);
* ``nan``: one element of rank R's first gradient piece is set to NaN after step S's
  backward, before the step's non-finite check;
* ``stall``: rank R, in the save of the checkpoint of step S, after every rank has written
  its data and before the commit, writes its pid into ``<out>/stalled_rank.pid`` and sleeps
  (the test kills it there);
* ``hold``: the commit of the checkpoint of step S waits (on rank R) until the loop has
  trained step S (0-based: the step after the checkpoint), then writes
  ``<out>/held_commit.rank<R>``; raises after :data:`HOLD_S` instead: proof that an
  asynchronous save returned to the loop before its commit.

How they get there: every rank runs :func:`spawned` instead of the launcher's own
``matrixfsdp.train.launch._spawned`` (the function each rank process starts in, pickled to it
by reference, so the rank imports this module); it patches the trainer's ``_step`` and
``clip_and_check`` (``matrixfsdp.train.loop``) and the checkpoint's ``_commit``
(``matrixfsdp.state.files``) in that rank, then runs the launcher's own. In the test process
:func:`train` does that around the command's own ``main`` (:func:`helpers.cli.run_cli`); as a
script, ``python tests/helpers/inject_faults.py ARGS...`` runs ``matrixfsdp ARGS...`` the same way
in a process of its own. The variable is read in the ranks, at each step and commit."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import torch.distributed as dist

from matrixfsdp.state import files
from matrixfsdp.train import launch, loop

VARIABLE = "INJECT_FAULTS"
SCRIPT = str(Path(__file__).resolve())
HOLD_S = 60.0  # a hang guard only: how long a held commit waits for the loop's step
_ORIGINAL_SPAWNED = launch._spawned  # in this process and in a rank alike, the launcher's own

_trained: dict[int, threading.Event] = {}  # step i trained (hold)
_lock = threading.Lock()


def _faults(rank: int, step: int) -> set[str]:
    kinds = set()
    for spec in filter(None, os.environ.get(VARIABLE, "").split(",")):
        kind, where = spec.split("@")
        r, at = where.split(":")
        if r in ("*", str(rank)) and int(at) == step:
            kinds.add(kind)
    return kinds


def _event(step: int) -> threading.Event:
    with _lock:
        return _trained.setdefault(step, threading.Event())


def _install() -> None:
    """In a rank: the trainer's step and the checkpoint's commit, with the faults around them."""
    step_fn, check_fn, commit_fn = loop._step, loop.clip_and_check, files._commit
    nan_now = threading.local()

    def step_with_faults(run, step, hist, bar):
        kinds = _faults(run.rank, step)
        if "hang" in kinds:
            time.sleep(3600)
        if "raise" in kinds:
            raise RuntimeError(f"injected fault at step {step}")
        loss_fn = run.loss_fn
        if "nanloss" in kinds:
            run.loss_fn = lambda *a, **k: loss_fn(*a, **k) * math.nan
        nan_now.value = "nan" in kinds
        try:
            step_fn(run, step, hist, bar)
        finally:
            run.loss_fn, nan_now.value = loss_fn, False
        _event(step).set()

    def check_with_faults(model, *args, **kwargs):
        if getattr(nan_now, "value", False):  # this rank's piece of one gradient
            grad = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.numel())
            grad.view(-1)[0] = math.nan
        return check_fn(model, *args, **kwargs)

    def commit_with_faults(tmp, path, *args, **kwargs):
        step, rank = files._step_of(path), dist.get_rank()
        out = path.parent.parent  # <out>/checkpoints/step_N
        kinds = _faults(rank, step) if step is not None else set()
        if "stall" in kinds:  # data written, not committed: the test kills this rank here
            (out / "stalled_rank.pid").write_text(str(os.getpid()))
            time.sleep(600)
        if "hold" in kinds:  # commit only once the loop has trained one more step
            if not _event(step).wait(HOLD_S):
                raise RuntimeError(f"{VARIABLE}: the commit of step {step}'s checkpoint came before "
                                   f"the loop trained step {step + 1}: the save blocked the loop")
            (out / f"held_commit.rank{rank}").write_text(
                f"step {step} committed after step {step + 1} was trained\n")
        return commit_fn(tmp, path, *args, **kwargs)

    loop._step, loop.clip_and_check, files._commit = step_with_faults, check_with_faults, commit_with_faults


def spawned(rank: int, *args) -> None:
    """A rank's entry: the faults installed, then the launcher's own entry."""
    _install()
    _ORIGINAL_SPAWNED(rank, *args)


def train(*args: str, faults: str, env: dict[str, str] | None = None):
    """``run_cli(*args)`` (in this process) with ``faults`` injected into its ranks."""
    from helpers.cli import run_cli
    with mock.patch.object(launch, "_spawned", spawned):
        return run_cli(*args, env={**(env or {}), VARIABLE: faults})


def command(*args: str) -> list[str]:
    """The command line that runs ``matrixfsdp *args`` in a process of its own with the
    faults of its environment's ``INJECT_FAULTS`` injected into its ranks."""
    return [sys.executable, SCRIPT, *args]


if __name__ == "__main__":
    import inject_faults  # by name, so that ranks unpickle ``inject_faults.spawned``

    from matrixfsdp.__main__ import run
    launch._spawned = inject_faults.spawned
    sys.argv = ["matrixfsdp", *sys.argv[1:]]
    run()
