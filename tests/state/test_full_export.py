"""``mf.full_state_dict(model, cpu_offload=True)``, torch's meaning: the full tensors on the
model's rank 0 only (a node of 8 ranks holds one host copy of the model, not 8), each unit
gathered and moved to the CPU in turn; ``every_rank=True`` keeps every rank's copy."""

from __future__ import annotations

import torch
from helpers.rank_pool import spawn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.train.models import GPT, GPTConfig


def _export(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_mlp=24))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    on_device = mf.full_state_dict(model)
    offloaded = mf.full_state_dict(model, cpu_offload=True)
    everyone = mf.full_state_dict(model, cpu_offload=True, every_rank=True)
    if rank == 0:
        assert offloaded.keys() == on_device.keys()
        assert all(torch.equal(offloaded[k], on_device[k]) and offloaded[k].device.type == "cpu"
                   for k in on_device)
    else:  # no full tensor held here
        assert offloaded == {}, sorted(offloaded)[:3]
    assert everyone.keys() == on_device.keys()
    assert all(torch.equal(everyone[k], on_device[k]) for k in on_device)


def test_cpu_offload_keeps_the_full_tensors_on_rank_0_only():
    spawn(_export, 4)
