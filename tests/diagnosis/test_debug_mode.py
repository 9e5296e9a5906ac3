"""Diagnosis: ranks that take different paths get a clear error on every rank at the first
collective that differs (debug mode), not a timeout, and a mesh smaller than the world is
flagged."""

from __future__ import annotations

import os
import re

import pytest
import torch
from helpers.diverging_model import CFG, SkippingGPT, train_until_error
from helpers.rank_pool import spawn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.runtime.param import placement_of
from matrixfsdp.train.models import GPT


def _diverge(rank, world_size, debug, out_dir):
    torch.manual_seed(0)
    model = SkippingGPT(CFG)
    model.skip_rank, model.skip_step = 1, 2
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh, debug=debug)
    opt = mf.Muon(mf.muon_param_groups(model))
    message = train_until_error(model, opt)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(message)


def test_debug_mode_names_the_diverging_rank_on_every_rank(tmp_path):
    """Rank 1 skips block 1 at step 2 (0-based; "step 3" in the message): with debug on,
    every rank raises the debug check's error, naming each rank's step, unit and phase, at
    the step it happened (without it: a
    gloo timeout after 60 s, or worse, a gather of one unit paired with another's). With
    prefetch on, the first collective that differs may come a little later than the
    skipped block (the next block's prefetched gather looks the same on both ranks), but
    within the same step. No rank waits for a timeout: neither message is the check's
    "waited N s" one."""
    spawn(_diverge, 2, True, str(tmp_path), timeout=120)
    for rank in range(2):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "ranks diverged" in message and "waited" not in message, message
        where = re.findall(r"rank (\d): (step \d+, unit '[^']+', [a-z ]+)", message)
        assert [r for r, _ in where] == ["0", "1"] and where[0][1] != where[1][1], message
        assert all(w.startswith("step 3, ") for _, w in where), message  # the step it happened, 1-based


def _frozen_apart(rank, world_size, out_dir):
    """Rank 1 freezes one more matrix than rank 0, before sharding (the set-up check) and
    after it (debug mode): their gradient reduces would differ."""
    messages = []
    for when in ("before", "after"):
        torch.manual_seed(0)
        model = GPT(CFG)
        if rank == 1 and when == "before":
            model.layers[1].attn.q.weight.requires_grad_(False)
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.layers:
            mf.fully_shard(block, mesh=mesh)
        try:
            mf.fully_shard(model, mesh=mesh, debug=True)
            mf.get_root(model)
            if rank == 1:
                model.layers[1].attn.q.weight.requires_grad_(False)
            x = torch.randint(0, 256, (2, 9))
            model.loss(x[:, :-1], x[:, 1:]).backward()
            messages.append("no error")
        except (ValueError, RuntimeError) as e:
            messages.append(str(e))
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(messages))


def test_debug_mode_names_ranks_that_froze_different_parameters(tmp_path):
    """Frozen parameters are planned apart (never Muon) and leave the gradient reduce, so
    ranks must freeze the same ones. Before sharding the set-up check compares them. After
    it, debug mode compares each collective's size and layout checksum and names both
    ranks' on every rank, at the first one that differs (the frozen matrix's reduce)."""
    spawn(_frozen_apart, 2, str(tmp_path), timeout=120)
    for rank in range(2):
        before, message = (tmp_path / f"rank{rank}.txt").read_text().split("\n")
        # frozen before sharding: the set-up check names it on every rank, debug mode or not
        assert before.startswith("matrixfsdp: ranks set up the model differently: parameter "
                                 "'layers.1.attn.q.weight' requires_grad: True on rank 0; False "
                                 "on rank 1"), before
        # frozen after sharding: debug mode names both ranks' collectives
        assert "ranks diverged" in message and "froze the model" in message, message
        where = re.findall(r"step 1, unit '([^']+)', gradient reduce of (\d+) elements, "
                           r"layout (\w+)", message)  # the frozen matrix leaves rank 1's reduce
        assert len(where) == 2 and where[0][0] == where[1][0], message
        assert where[0][1] != where[1][1] and where[0][2] != where[1][2], message


def _sub_mesh(rank, world_size, out_dir):
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)  # the same initial values on every rank (checked at sharding)
    model = GPT(CFG)
    with pytest.raises(ValueError, match=r"(?s)\['replicate'\] dim.*replicas would train apart.*"
                                         r"pass the 2-D mesh.*independent_replicas=True"):
        mf.fully_shard(model.layers[0], mesh=mesh2d["shard"])
    for block in model.layers:  # on purpose: independent replicas, still warned
        mf.fully_shard(block, mesh=mesh2d["shard"], independent_replicas=True)
    with pytest.warns(UserWarning, match=r"the mesh covers 2 of the 4 ranks"):
        mf.fully_shard(model, mesh=mesh2d["shard"], independent_replicas=True)
    (open(os.path.join(out_dir, f"ok{rank}"), "w")).close()


def test_mesh_smaller_than_the_world_is_flagged(tmp_path):
    """mesh2d['shard'] passed where the replicas should sync: an error on every rank,
    pointing to HSDP with the 2-D mesh and to the explicit opt-out (before: a warning, then
    replicas drifted apart); with the opt-out, the partial-mesh warning."""
    spawn(_sub_mesh, 4, str(tmp_path))
    assert all((tmp_path / f"ok{r}").exists() for r in range(4))


def _nonfinite(rank, world_size, out_dir):
    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    opt = mf.Muon(mf.muon_param_groups(model))
    before = mf.full_state_dict(model)
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(rank))
    model.loss(x[:, :-1], x[:, 1:]).backward()
    injected = None
    if rank == 1:  # a NaN in one rank's piece of one gradient only
        p = next(p for p in model.parameters() if p.grad is not None and p.numel())
        p.grad.view(-1)[0] = float("nan")
        injected = placement_of(p).spec.name
    norm = mf.total_grad_norm(model.parameters())
    skipped = not bool(torch.isfinite(norm))
    names = mf.nonfinite_grad_names(model.parameters()) if skipped else []
    if not skipped:
        opt.step()
    opt.zero_grad()
    unchanged = all(torch.equal(v, before[k]) for k, v in mf.full_state_dict(model).items())
    steps = sorted({int(s["step"]) for s in opt.state.values() if "step" in s})
    torch.save(dict(skipped=skipped, names=names, injected=injected, unchanged=unchanged,
                    steps=steps), os.path.join(out_dir, f"rank{rank}.pt"))


def test_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """A NaN in rank 1's piece of one gradient: the global norm is NaN on every rank, so
    every rank skips together, names the same parameter, and no parameter or optimizer
    state moves (the `--skip-nonfinite` path of matrixfsdp train)."""
    spawn(_nonfinite, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["skipped"] and r1["skipped"]
    assert r0["names"] == r1["names"] == [r1["injected"]]
    assert r0["unchanged"] and r1["unchanged"] and r0["steps"] == r1["steps"] == []
