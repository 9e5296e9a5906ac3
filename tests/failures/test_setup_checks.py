"""Set-up checks and well-aimed failures: ranks initialised with different seeds are refused
naming the first parameter (or synced from rank 0 on request), a module added after
sharding is refused before it trains apart, HSDP's mesh groups wait at most the user's
timeout, and debug mode names the rank that did not arrive."""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers.rank_pool import spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import matrixfsdp as mf
from matrixfsdp.diagnosis.debug import FORWARD_GATHER, CollectiveCheck
from matrixfsdp.optim.policy import check_optimizer_params
from matrixfsdp.runtime.checks import check_same_init, check_unsharded_trainable
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
    # 2. HSDP: init_device_mesh's sub-groups get torch's 30 minutes; ours wait at most the
    # world's, set on the mesh's own groups (no twin group: on NCCL a communicator each)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    before = _timeout(mesh.get_group(1))
    groups = MeshGroups.from_mesh(mesh)
    assert groups.shard is mesh.get_group(1) and groups.replicate is mesh.get_group(0)
    out.append(f"{_timeout(dist.group.WORLD)} {before} "
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
    assert world == "0:01:00" and mesh_default == "0:30:00", r0[1]  # rank_pool's 60 s; torch's default
    assert shard == world and replicate == world, r0[1]
    assert r0[2].startswith("matrixfsdp debug: rank 1 did not arrive (its last collective: step 1, "
                            "unit 'layers.0', forward gather)"), r0[2]
    # measured: rank 1 left the job, closing its connections, so rank 0 stopped waiting at
    # once, not after the configured 3 s (before: "waited 3 s" whatever the wait was)
    waited = re.search(r"rank 0 waited (\d+\.\d) s for it", r0[2])
    assert waited and float(waited.group(1)) <= 3.5, r0[2]


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


def _diverging(rank: int, case: str):
    """Shard the test GPT on 2 ranks with one thing set up differently on rank 1 (synced:
    the parameters too)."""
    torch.manual_seed(rank if case == "buffer synced" else 0)
    cfg = GPTConfig(**{**CFG.__dict__, "d_mlp": 32 if case == "width" and rank else CFG.d_mlp})
    model = GPT(cfg)
    if case == "float64" and rank:
        model = model.double()
    model.register_buffer("scale", torch.full((3,), 1.0 + (case.startswith("buffer") and rank)))
    mesh = init_device_mesh("cpu", (2,))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if case == "policy" and rank else None
    mf.fully_shard(model.layers[0], mesh=mesh, mp_policy=bf16)
    mf.fully_shard(model, mesh=mesh, sync_module_states=case == "buffer synced")
    mf.get_root(model)
    return model


def _xy():
    x = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    return x[:, :-1], x[:, 1:]


def _divergence_worker(rank, world, out_dir):
    results = {}
    for case in ("width", "float64", "buffer", "buffer synced", "policy", "muon lr",
                 "weight decay", "matrix optimizer lr", "torch adamw betas"):
        try:
            model = _diverging(rank, case)
            if case == "buffer synced":
                torch.manual_seed(0)
                full, rank0 = mf.full_state_dict(model, every_rank=True), GPT(CFG).state_dict()
                same = all(torch.equal(full[k], v) for k, v in rank0.items())
                results[case] = f"synced {model.scale.tolist()} parameters as rank 0's: {same}"
                continue
            lr = 0.04 if case == "muon lr" and rank else 0.02
            wd = 0.0 if case == "weight decay" and rank else 0.1
            if case == "matrix optimizer lr":
                mf.matrix_optimizer(torch.optim.SGD, model, lr=0.1 * (1 + rank))
            elif case == "torch adamw betas":  # torch's own: compared at its first step
                opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95 if rank else 0.999))
                before = [p.detach().clone() for p in model.parameters()]
                model.loss(*_xy()).backward()
                try:
                    opt.step()
                finally:
                    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            else:
                mf.Muon(mf.muon_param_groups(model, lr=lr, weight_decay=wd))
            results[case] = "no error"
        except ValueError as e:
            results[case] = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def test_every_divergent_set_up_is_named_on_every_rank_before_anything_moves(tmp_path):
    """(before: a wider MLP or a float64 rank was reported as "other initial values ... seed
    every rank alike", a buffer that differed trained on 0.29 apart, a bf16 policy on one
    rank ended in a gloo size mismatch, and 2x Muon lr or weight_decay 0 on one rank trained
    on with no message)"""
    spawn(_divergence_worker, 2, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0 == r1, (r0, r1)  # every rank raises the same error
    expect = {
        "width": "ranks set up the model differently: parameter 'layers.0.mlp.fc.weight' shape: "
                 "(24, 16) on rank 0; (32, 16) on rank 1",
        "float64": "ranks set up the model differently: parameter 'embed.weight' dtype: float32 on "
                   "rank 0; float64 on rank 1",
        "buffer": "ranks set up the model differently: buffer 'scale' values: (1.0, 1.0, 1.0) on rank 0; "
                  "(2.0, 2.0, 2.0) on rank 1",
        "policy": "ranks set up the model differently: unit 'layers.0' mixed precision policy: ",
        "muon lr": "ranks set up the Muon optimizer differently: param group 0 lr: 0.02 on "
                   "rank 0; 0.04 on rank 1",
        "weight decay": "ranks set up the Muon optimizer differently: param group 0 "
                        "weight_decay: 0.1 on rank 0; 0.0 on rank 1",
        "matrix optimizer lr": "ranks set up the SGD optimizer differently: param group 0 lr: "
                               "0.1 on rank 0; 0.2 on rank 1",
        "torch adamw betas": "ranks set up the AdamW optimizer differently: param group 0 betas: "
                             "(0.9, 0.999) on rank 0; (0.9, 0.95) on rank 1",
    }
    for case, text in expect.items():
        assert text in r0[case], (case, r0[case])
        assert "initial values" not in r0[case], (case, r0[case])
    assert r0["buffer synced"] == r1["buffer synced"] == \
        "synced [1.0, 1.0, 1.0] parameters as rank 0's: True"
