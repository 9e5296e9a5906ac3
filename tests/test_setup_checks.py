"""Set-up checks and well-aimed failures: ranks initialised with different seeds are refused
naming the first parameter (or synced from rank 0 on request), a module added after
sharding is refused before it trains apart, HSDP's mesh groups wait at most the user's
timeout, and debug mode names the rank that did not arrive."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _dist import spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.runtime.checks import (
    check_optimizer_params,
    check_same_init,
    check_unsharded_trainable,
)
from matrixfsdp.runtime.debug import FORWARD_GATHER, CollectiveCheck
from matrixfsdp.runtime.hsdp import MeshGroups
from matrixfsdp.train.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=1, d_mlp=24)


def _timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _worker(rank, world, tmp):
    out = []
    # 1. different seeds: the first parameter is named on every rank; sync=True copies rank 0's
    torch.manual_seed(rank)
    model = GPT(CFG)
    try:
        check_same_init(model.named_parameters())
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    assert check_same_init(model.named_parameters(), sync=True) == len(list(model.parameters()))
    check_same_init(model.named_parameters())  # equal now
    torch.manual_seed(0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), GPT(CFG).parameters()))
    # 2. HSDP: init_device_mesh's sub-groups keep torch's 30 minutes; ours wait at most the world's
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    groups = MeshGroups.from_mesh(mesh)
    out.append(f"{_timeout(dist.group.WORLD)} {_timeout(mesh.get_group(1))} "
               f"{_timeout(groups.shard)} {_timeout(groups.replicate)}")
    # 3. debug mode: rank 1 stops after one collective; rank 0 is told that rank 1 did not arrive
    check = CollectiveCheck(dist.group.WORLD, torch.device("cpu"), ["<root>", "layers.0"], timeout=3)
    check(1, FORWARD_GATHER)
    if rank == 0:
        try:
            check(0, FORWARD_GATHER)
            out.append("no error")
        except RuntimeError as e:
            out.append(str(e))
    with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(out))


def test_set_up_checks_on_two_ranks(tmp_path):
    """(before: the seeds mixed silently, the HSDP shard group waited 30 minutes, and debug
    mode said only that "some rank never issued a collective", naming the waiting rank)"""
    spawn(_worker, 2, str(tmp_path), timeout=180)
    r0, r1 = ((tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(2))
    assert r0[0] == r1[0] and "parameter 'embed.weight' differs between ranks" in r0[0], r0[0]
    assert "ranks [1]" in r0[0]
    world, mesh_default, shard, replicate = r0[1].split(" ")
    assert world == "0:01:00" and mesh_default == "0:30:00", r0[1]  # _dist's 60 s; torch's default
    assert shard == world and replicate == world, r0[1]
    assert r0[2].startswith("matrixfsdp debug: rank 1 did not arrive (its last collective: step 0, "
                            "unit 'layers.0', forward gather)"), r0[2]
    assert "rank 0 waited 3 s" in r0[2]


def test_a_module_added_after_sharding_is_refused(world1):
    """A head added after fully_shard is in no unit: its gradient would never be averaged
    (before: each rank trained its own copy, 1.2e-2 apart after a few steps)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = init_device_mesh("cpu", (1,))
    mf.fully_shard(model.layers[0], mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    mf.get_root(model)
    check_unsharded_trainable(model)  # all sharded: passes
    model.extra = nn.Linear(16, 16)
    with pytest.raises(ValueError, match=r"'extra.weight' \(16, 16\) is trainable but belongs to no"):
        check_unsharded_trainable(model)
    with pytest.raises(ValueError, match=r"AdamW holds parameter 'extra.weight' \(16, 16\)"):
        check_optimizer_params(torch.optim.AdamW(model.parameters()))
    check_optimizer_params(torch.optim.AdamW(nn.Linear(2, 2).parameters()))  # not ours: passes
    model.extra.requires_grad_(False)
    check_unsharded_trainable(model)  # frozen: nothing trains apart
