"""Checkpoints that cannot lose work: checksums verified on load (a flipped byte is refused,
naming the file), a newest checkpoint without its marker is reported, a model-only load
checks the saved names both ways, retention keeps the newest N, and a full disk gives one
clear line on every rank with the previous checkpoint intact."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch
from helpers.rank_pool import spawn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.state.files import checkpoint_dir, is_complete
from matrixfsdp.state.integrity import CHECKSUMS, CheckpointError
from matrixfsdp.train.models import GPT, GPTConfig


def _model(layers: int = 1, seed: int = 0, world: int = 1):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=layers, d_mlp=24))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    opt = mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=3e-3))
    return model, opt


def _flip(path, count: int = 16) -> None:
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[len(data) // 2 + i] ^= 0xFF
    path.write_bytes(data)


def test_flipped_bytes_are_refused_naming_the_file(world1, tmp_path):
    """16 flipped bytes in a shard file: load_checkpoint raises naming that file and loads
    nothing (before: dcp.load took the bytes, and training went on from other weights)."""
    model, opt = _model()
    saved = mf.save_checkpoint(mf.get_state_dict(model, opt), tmp_path / "step_1")
    listed = (saved.path / CHECKSUMS).read_text()
    assert "__0_0.distcp" in listed and ".metadata" in listed
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    other, other_opt = _model(seed=1)
    shutil.copytree(saved.path, tmp_path / "good")
    _flip(saved.path / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"step_1/__0_0\.distcp does not match its checksum"):
        mf.load_checkpoint(other, other_opt, saved.path)
    assert not torch.equal(dict(other.named_parameters())["embed.weight"], want["embed.weight"])
    mf.load_checkpoint(other, other_opt, tmp_path / "good")  # the intact copy loads, bit for bit
    for n, p in other.named_parameters():
        assert torch.equal(p, want[n]), n


def test_a_newest_checkpoint_without_its_marker_is_reported(world1, tmp_path):
    """step_2 lost its COMPLETE marker: latest_checkpoint falls back to step_1 and says which
    and why (before: skipped without a word); loading step_2 itself is refused."""
    model, opt = _model()
    for step in (1, 2):
        mf.save_checkpoint(mf.get_state_dict(model, opt), checkpoint_dir(tmp_path, step))
    newest = checkpoint_dir(tmp_path, 2)
    os.remove(newest / "COMPLETE")
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step_00000002: it has no COMPLETE"):
        assert mf.latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1)
    with pytest.raises(CheckpointError, match="no COMPLETE"):
        mf.load_checkpoint(model, opt, newest)


def test_a_model_only_load_checks_the_saved_names_both_ways(world1, tmp_path):
    """A 1-layer model from a 2-layer checkpoint, and the reverse, are refused naming the
    names (before: dcp.load read the names the model asked for and ignored the rest)."""
    two, two_opt = _model(layers=2)
    mf.save_checkpoint(mf.get_state_dict(two, two_opt), tmp_path / "two")
    one, one_opt = _model(layers=1)
    mf.save_checkpoint(mf.get_state_dict(one, one_opt), tmp_path / "one")
    with pytest.raises(ValueError, match=r"the checkpoint has \d+ names the model lacks \(\['layers\.1\."):
        mf.load_checkpoint(one, None, tmp_path / "two")
    with pytest.raises(ValueError, match=r"the model has \d+ names the checkpoint lacks \(\['layers\.1\."):
        mf.load_checkpoint(two, None, tmp_path / "one")


def _disk_worker(rank, world, tmp):
    from torch.distributed.checkpoint import filesystem
    model, opt = _model(world=world)
    for step in (1, 2, 3):  # keep_last=2: step 1 goes once step 3 is committed
        mf.save_checkpoint(mf.get_state_dict(model, opt), checkpoint_dir(tmp, step), keep_last=2)
    write_item = filesystem._write_item

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if rank == 1:  # only rank 1's disk is full
        filesystem._write_item = full_disk
    messages = []
    for async_save in (False, True):
        try:
            saved = mf.save_checkpoint(mf.get_state_dict(model, opt), checkpoint_dir(tmp, 4),
                                       keep_last=2, async_save=async_save)
            if async_save:
                saved.result()
            messages.append("no error")
        except CheckpointError as e:
            messages.append(str(e))
    filesystem._write_item = write_item
    with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(messages))
    torch.distributed.barrier()  # still in step after the failures


def test_keep_last_and_a_full_disk(tmp_path):
    """2 ranks, keep_last=2: step_1 is deleted once step_3 is committed. Then rank 1's disk is
    full in the save of step 4 (sync and async): every rank raises the same one-line error
    naming the directory and the previous checkpoint, which stays complete and verified;
    nothing is deleted and no partial directory is left (before: every checkpoint kept, and a
    multi-line DCP CheckpointException of tracebacks)."""
    spawn(_disk_worker, 2, str(tmp_path), timeout=180)
    lines = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(2)]
    assert lines[0] == lines[1] and len(lines[0]) == 2, lines
    for line in lines[0]:
        assert "no space left on the device writing" in line and "step_00000004" in line, line
        assert f"the previous checkpoint {checkpoint_dir(tmp_path, 3)} is intact" in line, line
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["step_00000002", "step_00000003"], names
    for step in (2, 3):
        assert is_complete(checkpoint_dir(tmp_path, step))
        assert mf.verify_checkpoint(checkpoint_dir(tmp_path, step))


def test_a_plain_dcp_save_gets_its_own_diagnosis_and_fix(world1, tmp_path):
    """The README saves with plain ``dcp.save``: ``mf.load_checkpoint`` of that directory says
    what it is and how to load it (before: "no COMPLETE file (a save that did not finish, or
    a damaged directory)"), and the fix it names loads it, bit for bit."""
    import torch.distributed.checkpoint as dcp

    model, opt = _model()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    dcp.save(mf.get_state_dict(model, opt), checkpoint_id=str(tmp_path / "plain"))
    other, other_opt = _model(seed=1)
    with pytest.raises(CheckpointError) as refused:
        mf.load_checkpoint(other, other_opt, tmp_path / "plain")
    text = str(refused.value)
    assert "it is a plain torch.distributed.checkpoint save" in text, text
    assert "dcp.load(state, checkpoint_id=" in text and "mf.set_state_dict(model, optimizer, state)" in text
    assert "damaged" not in text and "did not finish" not in text
    state = mf.get_state_dict(other, other_opt)
    dcp.load(state, checkpoint_id=str(tmp_path / "plain"))
    mf.set_state_dict(other, other_opt, state)
    for n, p in other.named_parameters():
        assert torch.equal(p, want[n]), n
