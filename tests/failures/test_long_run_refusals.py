"""The lesser failures of long runs, each refused in words: summary.json written whole or
not at all (a full disk names the file), a --out inside a live run's folder refused naming
that run, a rank given a mesh that does not hold it told so, and a unit in another dtype on
one rank named on every rank (before: that rank alone said so, the others saw "Connection
closed by peer")."""

from __future__ import annotations

import os
import resource
import sys

import pytest
import torch
import torch.distributed as dist
from helpers.rank_pool import spawn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import matrixfsdp as mf
from matrixfsdp.__main__ import main
from matrixfsdp.train.models import GPT, GPTConfig
from matrixfsdp.train.outlock import enclosing_run, lock_out
from matrixfsdp.train.report import SummaryError, write_atomic

if not sys.platform.startswith("linux"):
    pytest.skip("rlimits and flock", allow_module_level=True)


def test_summary_json_is_written_whole_or_not_at_all(tmp_path):
    """A write that fails (here a 4 KiB file-size limit: EFBIG; a full disk is ENOSPC)
    leaves the previous summary.json as it was and no temporary file, and says which file
    (before: a 0-byte summary.json and a bare "[Errno 28] No space left on device")."""
    path = tmp_path / "summary.json"
    write_atomic(path, '{"old": true}')
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # Python ignores SIGXFSZ: EFBIG
    try:
        with pytest.raises(SummaryError) as failed:
            write_atomic(path, "x" * 65536)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(failed.value) == (f"cannot write {path}: File too large (EFBIG); {path} was left as "
                                 "it was")
    assert path.read_text() == '{"old": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_an_out_inside_a_live_runs_folder_is_refused(tmp_path, capsys):
    """A run holds tmp/run; --out tmp/run/checkpoints (and deeper) is refused before anything
    is written there, naming the live run and its holder; once it ends, it is allowed."""
    live = lock_out(tmp_path / "run", ["matrixfsdp", "train", "--out", str(tmp_path / "run")])
    try:
        for nested in (tmp_path / "run" / "checkpoints", tmp_path / "run" / "a" / "b"):
            with pytest.raises(SystemExit) as stop:
                main(["train", "--steps", "1", "--out", str(nested)])
            line = capsys.readouterr().err.strip().splitlines()[-1]
            assert stop.value.code == 2, line
            assert line.startswith(f"matrixfsdp train: error: --out {nested} is inside the folder of a "
                                   f"live run, {tmp_path / 'run'} (pid {os.getpid()} on host "), line
            assert "matrixfsdp train --out" in line and line.endswith("Choose an --out outside it"), line
            assert not nested.exists()
    finally:
        live.release()
    assert enclosing_run(tmp_path / "run" / "checkpoints") is None  # a finished run's folder: fine


def _outside(rank, world, out):
    """A mesh of ranks 0 and 1 handed to every rank: rank 2 is not in it."""
    mesh = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("dp",))
    try:
        mf.fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh=mesh)
        message = "no error"
    except ValueError as e:
        message = str(e)
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(message)


def test_a_rank_outside_its_mesh_is_told_so(tmp_path):
    """Before: IndexError: list index out of range, from torch (runtime/hsdp.py)."""
    spawn(_outside, 3, str(tmp_path), timeout=120)
    assert (tmp_path / "rank0.txt").read_text() == (tmp_path / "rank1.txt").read_text() == "no error"
    assert (tmp_path / "rank2.txt").read_text() == (
        "matrixfsdp: rank 2 is not in the mesh it was given: a 2 cpu mesh (dp) of ranks [0, 1]. Every "
        "rank that calls fully_shard must be in its mesh: build the part of the model it trains on its "
        "own mesh (a pipeline stage's), or pass a mesh that holds it")


def _float64_on_one_rank(rank, world, out):
    """Rank 1 alone turns one unit's MLP to float64 (that unit mixes dtypes there)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_mlp=24))
    if rank == 1:
        model.layers[0].mlp.double()
    mesh = init_device_mesh("cpu", (world,))
    try:
        for block in model.layers:
            mf.fully_shard(block, mesh=mesh)
        mf.fully_shard(model, mesh=mesh)
        message = "no error"
    except ValueError as e:
        message = str(e)
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(message)
    dist.barrier()  # both ranks are still in step


def test_a_dtype_that_differs_on_one_rank_is_named_on_every_rank(tmp_path):
    spawn(_float64_on_one_rank, 2, str(tmp_path), timeout=120)
    messages = {(tmp_path / f"rank{r}.txt").read_text() for r in range(2)}
    assert messages == {
        "matrixfsdp: unit 'layers.0' mixes parameters 'layers.0.norm1.weight' (torch.float32, cpu) and "
        "'layers.0.mlp.fc.weight' (torch.float64, cpu); all parameters of one unit need the same dtype "
        "and device (found on rank 1 of the mesh [0, 1]; every rank of it raises this)"}, messages
