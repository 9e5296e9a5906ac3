"""`mf.save_checkpoint(..., async_save=True)` (torch's `dcp.async_save` with our own staging):
the call returns before the commit and training goes on while the save is in flight, the
checkpoint holds the values at the time of the call although training changes them right
after it, a second save waits for the first, an asynchronous checkpoint loads at another world
size exactly as a synchronous one, and `matrixfsdp train --async-save` trains on before its
commit and resumes.

That a save did not block its caller is shown by order, not by time (shared cores): the
commit is held (the library's ``_commit`` patched from here: :func:`_commit_preceded_by`)
until an event that the caller sets only after the call has returned and it has trained on.
A save that runs its commit inside the call never gets there, and fails after :data:`HOLD_S`
(a hang guard only) instead of hanging."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from helpers.checkpointing import (
    GLOBAL,
    SEQ,
    build_sharded,
    checkpoint_state,
    load_state,
    tie_and_freeze,
    train_steps,
)
from helpers.cli import run_cli
from helpers.inject_faults import train as train_with_faults
from helpers.rank_pool import spawn
from helpers.reference import batches
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import matrixfsdp as mf
from matrixfsdp.runtime.param import placement_of
from matrixfsdp.state import files
from matrixfsdp.state.files import AsyncCheckpoint, is_complete
from matrixfsdp.state.staging import stage_state
from matrixfsdp.tensors.row_shard import RowShard

HOLD_S = 60.0  # how long a held commit waits for its release: a hang guard only


@contextlib.contextmanager
def _commit_preceded_by(hook):
    """Within: ``hook(path)`` runs before each commit of ``save_checkpoint`` (in this process),
    on the thread that commits, after every rank has written its data: the library's
    ``_commit`` is patched (and restored on leaving: a pool rank serves other tests)."""
    commit = files._commit

    def hooked(tmp, path, *args, **kwargs):
        hook(path)
        return commit(tmp, path, *args, **kwargs)
    files._commit = hooked
    try:
        yield
    finally:
        files._commit = commit


def _held_commit(name: str) -> tuple[threading.Event, list[str], object]:
    """(release, log, hook): ``hook`` (for :func:`_commit_preceded_by`) holds the commit of the
    checkpoint called ``name`` until ``release`` is set, then logs "commit"; it raises if
    ``release`` is not set within HOLD_S (the caller never got to set it)."""
    release, log = threading.Event(), []

    def hold(path) -> None:
        if path.name != name:
            return
        if not release.wait(HOLD_S):
            raise RuntimeError("the commit came before the caller released it: "
                               "save_checkpoint(async_save=True) blocked its caller")
        log.append("commit")
    return release, log, hold


def _snapshot(model, opt, sched):
    """Everything a checkpoint holds, as copies: full parameters (a collective), this rank's
    optimizer state by name, the schedule."""
    state = {placement_of(p).spec.name: {k: v.clone() for k, v in opt.state.get(p, {}).items()}
             for g in opt.param_groups for p in g["params"]}
    return dict(model=mf.full_state_dict(model), optim=state, sched=sched.state_dict(),
                lr=[g["lr"] for g in opt.param_groups])


def _assert_holds(model, opt, sched, want, what):
    got = _snapshot(model, opt, sched)
    assert got["model"].keys() == want["model"].keys()
    for n, v in want["model"].items():
        assert torch.equal(got["model"][n], v), f"{what}: parameter {n}"
    assert got["optim"].keys() == want["optim"].keys()
    for n, st in want["optim"].items():
        assert got["optim"][n].keys() == st.keys(), f"{what}: state keys of {n}"
        for k, v in st.items():
            assert torch.equal(got["optim"][n][k], v), f"{what}: {k} of {n}"
    assert got["sched"] == want["sched"] and got["lr"] == want["lr"], what


def _perturb(opt):
    """Change every parameter and every optimizer state tensor in place, at once."""
    with torch.no_grad():
        for g in opt.param_groups:
            for p in g["params"]:
                p.add_(1.0)
                for v in opt.state.get(p, {}).values():
                    v.add_(1)


def test_stage_state_copies_rows_and_keeps_their_place():
    """A staged RowShard is a CPU copy of the rows with the same shape and offsets; a tied
    value is staged once; plain tensors and other values are copies too."""
    local = torch.arange(6.0).view(2, 3)
    rs = RowShard(local, (5, 3), (3, 0), "w")
    step = torch.tensor(4.0)
    groups = [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]
    staged = stage_state({"model": {"w": rs, "tied": rs}, "optim": {"state": {"w": {"step": step}},
                                                                     "param_groups": groups}})
    s = staged["model"]["w"]
    assert isinstance(s, RowShard) and s is staged["model"]["tied"]
    assert tuple(s.shape) == (5, 3) and s.offsets == (3, 0) and s.fqn == "w"
    assert torch.equal(s.local, local) and s.local.data_ptr() != local.data_ptr()
    local.add_(1)
    step.add_(1)
    groups[0]["params"].append("x")
    assert torch.equal(s.local, torch.arange(6.0).view(2, 3))
    assert float(staged["optim"]["state"]["w"]["step"]) == 4.0
    assert staged["optim"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]


def test_a_failed_async_save_is_raised_and_leaves_no_checkpoint(world1, tmp_path):
    """A background failure (here before the commit) is raised by result(); one never asked
    for is raised by the next save; neither leaves a checkpoint, and saving goes on after."""
    state = {"x": torch.arange(4.0)}

    def full_disk(path):
        raise OSError("disk full")

    with _commit_preceded_by(full_disk):
        pending = mf.save_checkpoint(state, tmp_path / "step_1", async_save=True)
        with pytest.raises(OSError, match="disk full"):
            pending.result()
        mf.save_checkpoint(state, tmp_path / "step_2", async_save=True)
        with pytest.raises(RuntimeError, match="step_2 failed: OSError: disk full"):
            mf.save_checkpoint(state, tmp_path / "step_3")
    assert mf.latest_checkpoint(tmp_path) is None
    saved = mf.save_checkpoint(state, tmp_path / "step_3", async_save=True).result()
    assert mf.latest_checkpoint(tmp_path) == saved.path


# ---- the values at the time of the call, despite the steps after it (2 ranks) --------------------
def _staging_buffers() -> dict:
    """The host buffers the asynchronous saves stage into (the save group's pool), by address."""
    from matrixfsdp.state import files
    return {k: (t.data_ptr(), t.shape) for pool in files._POOLS.values() for k, t in pool.items()}


def _at_call_worker(rank, world, tmp):
    data = batches(6, 1, GLOBAL, SEQ)
    model, opt, sched = build_sharded(world, tweak=tie_and_freeze)
    train_steps(model, opt, sched, data, range(2), rank, world)
    want2 = _snapshot(model, opt, sched)
    release, log, hold = _held_commit("step_2")
    with _commit_preceded_by(hold):
        first = mf.save_checkpoint(checkpoint_state(model, opt, sched), os.path.join(tmp, "step_2"),
                                   async_save=True)
        log.append("returned")
        assert isinstance(first, AsyncCheckpoint)
        assert not first.done() and not is_complete(first.path)  # in flight: its commit is held
        _perturb(opt)  # right after the call, while the save is in flight
        train_steps(model, opt, sched, data, range(2, 4), rank, world)
        log.append("trained")
        assert not first.done() and not is_complete(first.path)  # two steps trained, still in flight
        release.set()
        want4 = _snapshot(model, opt, sched)
        buffers = _staging_buffers()
        second = mf.save_checkpoint(checkpoint_state(model, opt, sched), os.path.join(tmp, "step_4"),
                                    async_save=True)
        assert first.done()  # the second save waited for the first (never two commits at once)
        assert buffers and _staging_buffers() == buffers  # staged into the first's buffers
        assert log == ["returned", "trained", "commit"], log
    _perturb(opt)
    train_steps(model, opt, sched, data, range(4, 5), rank, world)
    for pending, want in ((first, want2), (second, want4)):
        saved = pending.result()
        assert saved.path == pending.path and is_complete(saved.path) and saved.bytes > 0
        assert 0 <= saved.blocking_seconds <= saved.seconds
        fresh = build_sharded(world, tweak=tie_and_freeze, seed=123)  # other weights: all from the file
        load_state(*fresh, saved.path)
        _assert_holds(*fresh, want, str(saved.path))
    assert mf.latest_checkpoint(tmp) == second.path
    assert mf.wait_for_checkpoint() is not None and mf.wait_for_checkpoint() is None


def test_async_checkpoint_holds_the_values_at_the_call(tmp_path):
    """2 ranks, a tied head and a frozen parameter: async save, then at once every parameter
    and optimizer state tensor changed in place and two more optimizer steps, a second async
    save (which first waits for the first, and stages into its host buffers: allocated, and
    on an accelerator pinned, once), more changes. Each checkpoint, loaded into a model
    with other weights, equals the parameters, Muon momentum, AdamW moments and steps and the
    lr schedule captured at its call, bit for bit."""
    spawn(_at_call_worker, 2, str(tmp_path))


# ---- saved at 2 ranks, loaded at 3: the same as a synchronous checkpoint ----------------------
def _save_both_worker(rank, world, tmp):
    data = batches(5, 1, GLOBAL, SEQ)
    model, opt, sched = build_sharded(world)
    train_steps(model, opt, sched, data, range(3), rank, world)
    mf.save_checkpoint(checkpoint_state(model, opt, sched), os.path.join(tmp, "sync"))
    pending = mf.save_checkpoint(checkpoint_state(model, opt, sched), os.path.join(tmp, "async"),
                                 async_save=True)
    _perturb(opt)
    train_steps(model, opt, sched, data, range(3, 5), rank, world)
    pending.result()


def _load_both_worker(rank, world, tmp):
    loaded = []
    for name, seed in (("sync", 7), ("async", 8)):
        model, opt, sched = build_sharded(world, seed=seed)
        load_state(model, opt, sched, os.path.join(tmp, name))
        loaded.append((model, opt, sched))
    _assert_holds(*loaded[1], _snapshot(*loaded[0]), "async vs sync at 3 ranks")
    data = batches(5, 1, GLOBAL, SEQ)
    for trio in loaded:  # and training on from either is the same
        train_steps(*trio, data, range(3, 5), rank, world)
    _assert_holds(*loaded[1], _snapshot(*loaded[0]), "2 steps after the load")


def test_async_checkpoint_loads_at_another_world_size_like_a_sync_one(tmp_path):
    """Saved at 2 ranks once synchronously and once asynchronously (then the state changed
    and trained on), loaded at 3 ranks: parameters, optimizer state and schedule of the two
    loads are equal bit for bit, and so are they after two more steps."""
    spawn(_save_both_worker, 2, str(tmp_path))
    spawn(_load_both_worker, 3, str(tmp_path))


# ---- the CLI: train --save-every 2 --async-save, then --resume ---------------------------------
TRAIN = [sys.executable, "-m", "matrixfsdp", "train", "--layers", "1", "--d-model", "32",
         "--heads", "2", "--mlp", "64", "--seq", "32", "--batch", "2", "--steps", "4",
         "--save-every", "2", "--ranks", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(*extra: str, env=None) -> subprocess.CompletedProcess:
    run = run_cli(*TRAIN[3:], *extra, env=env or ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}/").items()}
    return {prefix: tree}


def test_cli_async_save_then_resume(tmp_path):
    """`--async-save`: the loop trains on while a save is in flight: with the fault ``hold@*:2``
    (:mod:`inject_faults`) the commit of the step-2 checkpoint waits (on every rank) until the
    loop has trained step 3, which a save that blocked the loop until its commit never lets it
    do (the run fails after the hold's hang guard). Both checkpoints complete (the last one
    committed before the run ends). Resuming from the step-2 one gives the async run's losses
    of steps 3-4 bit for bit, and the resumed run's step-4 checkpoint (written synchronously)
    equals the async one bit for bit."""
    a, b = tmp_path / "async", tmp_path / "resumed"
    held = train_with_faults(*TRAIN[3:], "--out", str(a), "--async-save", faults="hold@*:2", env=ENV)
    assert held.returncode == 0, held.stderr[-3000:]
    for rank in range(2):  # the hold ran, and was released by the loop's step 3
        assert (a / f"held_commit.rank{rank}").read_text() == "step 2 committed after step 3 was trained\n"
    ckpts = a / "checkpoints"
    assert [p.name for p in sorted(ckpts.iterdir())] == ["step_00000002", "step_00000004"]
    assert mf.latest_checkpoint(ckpts) == ckpts / "step_00000004"
    summary = json.loads((a / "summary.json").read_text())
    assert summary["async_save"] and summary["save_steps"] == [2, 4] and len(summary["step_wall_ms"]) == 4
    assert [c["path"] for c in summary["checkpoints"]] == [str(ckpts / "step_00000002"),
                                                          str(ckpts / "step_00000004")]
    run = _run("--out", str(b), "--resume", str(ckpts / "step_00000002"))
    assert "resumed from" in run.stdout and "(step 2" in run.stdout
    assert json.loads((b / "summary.json").read_text())["losses"] == summary["losses"]
    files = []
    for root in (a, b):
        dcp_to_torch_save(root / "checkpoints" / "step_00000004", tmp_path / f"{root.name}.pt")
        files.append(_flat(torch.load(tmp_path / f"{root.name}.pt", weights_only=False)))
    assert files[0].keys() == files[1].keys()
    for k, v in files[0].items():
        assert torch.equal(v, files[1][k]) if isinstance(v, torch.Tensor) else v == files[1][k], k
