"""Damaged checkpoints refused in words, checksums or not: a truncated or garbage
``.metadata``, a missing or swapped shard, a missing ``CHECKSUMS.json``. ``--resume``
names the file of the checkpoint and how it is damaged, before any rank starts;
``--resume-fallback`` skips each damaged one, saying why, and resumes from the newest one
that loads. Before: raw tracebacks (UnpicklingError, FileNotFoundError for
``__0.metadata``, ``'int' object has no attribute 'size'``, a miniz error), a checkpoint
without its CHECKSUMS.json loaded unchecked, and no fallback.

Without any checksums (a checkpoint saved before they existed), DCP's ``.metadata`` and
the files it places data in are still checked, and a file the load cannot read is named."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from helpers.cli import run_cli
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.__main__ import main
from matrixfsdp.state.files import checkpoint_dir
from matrixfsdp.state.integrity import CHECKSUMS, COMPLETE, CheckpointError
from matrixfsdp.train.models import GPT, GPTConfig

TRAIN = ["train", "--layers", "1", "--d-model", "32", "--heads", "2", "--mlp", "64", "--seq", "32",
         "--batch", "2", "--ranks", "2"]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _truncate(f) -> None:
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])


def _garbage(f) -> None:
    f.write_bytes(random.Random(0).randbytes(f.stat().st_size))


def _swap(a, b) -> None:
    tmp = a.with_name("swap")
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)


def _forget_checksums(path) -> None:
    """Make ``path`` a checkpoint as saved before checksums existed: no CHECKSUMS.json, a
    marker that does not record one."""
    os.remove(path / CHECKSUMS)
    marker = json.loads((path / COMPLETE).read_text())
    del marker["checksums"]
    (path / COMPLETE).write_text(json.dumps(marker))


def test_each_damaged_checkpoint_is_refused_naming_the_file_and_the_fallback_skips_it(tmp_path, capsys):
    out = tmp_path / "run"
    first = run_cli(*TRAIN, "--steps", "14", "--save-every", "2", "--out", str(out), env=ENV)
    assert first.returncode == 0, first.stderr[-3000:]
    ck = {n: checkpoint_dir(out / "checkpoints", n) for n in (2, 4, 6, 8, 10, 12, 14)}
    saved = (ck[12] / ".metadata").stat().st_size
    os.remove(ck[14] / CHECKSUMS)
    _truncate(ck[12] / ".metadata")
    _garbage(ck[10] / ".metadata")
    os.remove(ck[8] / "__1_0.distcp")
    _swap(ck[6] / "__0_0.distcp", ck[6] / "__1_0.distcp")
    _forget_checksums(ck[4])  # and then swapped: named by the name each file ends with
    _swap(ck[4] / "__0_0.distcp", ck[4] / "__1_0.distcp")
    swapped = ("holds the bytes the save wrote into __1_0.distcp (the files were swapped or copied "
               "over each other)")
    why = {
        14: f"{ck[14] / CHECKSUMS} is missing (its COMPLETE marker records that the save wrote it), so "
            "its files cannot be verified",
        12: f"{ck[12] / '.metadata'} is truncated: {saved // 2} bytes, the save wrote {saved}",
        10: f"{ck[10] / '.metadata'} is not DCP's metadata (UnpicklingError: ",
        8: f"{ck[8] / '__1_0.distcp'} is missing",
        6: f"{ck[6] / '__0_0.distcp'} {swapped}",
        4: f"{ck[4] / '__0_0.distcp'} {swapped}",
    }
    for n, text in why.items():  # --resume of each one alone: refused before any rank starts
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            main([*TRAIN, "--steps", "14", "--resume", str(ck[n]), "--out", str(tmp_path / "x")])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2, line
        assert line.startswith(f"matrixfsdp train: error: --resume: checkpoint {ck[n]} is damaged: "
                               f"{text}"), line
        assert line.endswith("; refusing to load it. Pass --resume-fallback to load the previous complete "
                             "checkpoint instead"), line

    run = run_cli(*TRAIN, "--steps", "4", "--save-every", "2", "--resume", "--resume-fallback",
                  "--out", str(out), env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    skipped = [ln for ln in run.stdout.splitlines() if ln.startswith("--resume: checkpoint")]
    assert len(skipped) == 6, run.stdout[-3000:]
    for line, (n, text) in zip(skipped, why.items()):  # newest first, each with its reason
        assert line.startswith(f"--resume: checkpoint {ck[n]} is damaged: {text}"), line
        assert line.endswith("refusing to load it; --resume-fallback: trying the previous complete "
                             "checkpoint"), line
    assert f"resumed from {ck[2]} (step 2" in run.stdout
    assert json.loads((out / "summary.json").read_text())["resumed_from"]["step"] == 2
    assert mf.verify_checkpoint(ck[4])  # the damaged step 4 was replaced by this run's own


def _model():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=1, d_mlp=24))
    mesh = init_device_mesh("cpu", (1,))
    mf.fully_shard(model.layers[0], mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    return model, mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=3e-3))


@pytest.mark.parametrize("damage", ["truncated metadata", "garbage metadata", "missing shard",
                                    "truncated shard", "garbage shard"])
def test_without_checksums_the_metadata_and_the_reads_name_the_file(world1, tmp_path, damage):
    """A checkpoint as saved before checksums existed (no CHECKSUMS.json, a marker that does
    not record one): verify_checkpoint checks DCP's metadata and the sizes of the files it
    names; a shard of the right size that does not read is named by the load itself."""
    model, opt = _model()
    path = mf.save_checkpoint(mf.get_state_dict(model, opt), tmp_path / "step_1").path
    _forget_checksums(path)
    assert mf.verify_checkpoint(path) is False  # nothing to compare the bytes with: structure only
    shard = path / "__0_0.distcp"
    {"truncated metadata": lambda: _truncate(path / ".metadata"),
     "garbage metadata": lambda: _garbage(path / ".metadata"),
     "missing shard": lambda: os.remove(shard),
     "truncated shard": lambda: _truncate(shard),
     "garbage shard": lambda: _garbage(shard)}[damage]()
    expected = {
        "truncated metadata": rf"{path / '.metadata'} is not DCP's metadata \(\w+: .*\)",
        "garbage metadata": rf"{path / '.metadata'} is not DCP's metadata \(UnpicklingError: .*\)",
        "missing shard": rf"{shard} is missing \(DCP's .metadata places data in it\)",
        "truncated shard": rf"{shard} is truncated: \d+ bytes, DCP's .metadata places data up to byte \d+",
        "garbage shard": rf"{shard.name} is damaged: reading it failed \(.+\); it was truncated, "
                         "overwritten or swapped with another file after the save"}[damage]
    other, other_opt = _model()
    with pytest.raises(CheckpointError, match=expected):
        mf.load_checkpoint(other, other_opt, path)
