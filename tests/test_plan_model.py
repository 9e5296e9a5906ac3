"""The plan's byte model equals the runtime, to the byte and the launch:
``matrixfsdp.plan_costs(model, mesh_shape)`` predicts on a meta-device copy what each of 8
ranks counts in ``comm_stats`` over one training step (every collective kind: calls,
payload, sent, received, critical and mean bytes) and what it holds (storage segments,
shards, gradients, optimizer state), 1-D and 2 x 4 HSDP (bf16 gathers, two micro-batches),
on gloo's calls and on NCCL's uneven ones (grouped_gloo)."""

from __future__ import annotations

import pytest
import torch
from _dist import spawn
from torch.distributed.fsdp import MixedPrecisionPolicy

import matrixfsdp as mf
from matrixfsdp.planning.predict import default_units
from matrixfsdp.runtime.fully_shard import get_root
from matrixfsdp.train.models import GPT, GPTConfig

# odd sizes on purpose: the vocabulary (50 rows) and the MLP (40) pad over 4 and 8 ranks,
# and matrices of 24 x 40 elements are not multiples of the 16-element alignment
CFG = GPTConfig(vocab_size=50, d_model=24, n_heads=2, n_layers=3, d_mlp=40, seq_len=8)


def _held(model, opt) -> dict[str, int]:
    root = get_root(model)
    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
             for p in model.parameters() if p.grad is not None}
    optim = sum(t.numel() * t.element_size() for st in opt.state.values()
                for k, t in st.items() if k != "step")
    return {"storage": sum(u.storage.local.numel() * u.storage.local.element_size()
                           for u in root.units),
            "params": sum(p.numel() * p.element_size() for p in model.parameters()),
            "grads": sum(grads.values()), "optim": optim}


def _worker(rank, world_size, shape, bf16, micro_batches, uneven):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = GPT(CFG)
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else None
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh, mp_policy=mp)
    mf.fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=1e-3))
    stats = mf.comm_stats(model)
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        if step == 1:  # a steady step: it starts with the previous step's broadcasts (HSDP)
            stats.reset()
        for _ in range(micro_batches):
            x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
            model.loss(x, x).backward()
        opt.step()
    counted, held = stats.summary(), _held(model, opt)
    opt.zero_grad()

    with torch.device("meta"):
        twin = GPT(CFG)
    bf = torch.bfloat16 if bf16 else None
    predicted = mf.plan_costs(twin, shape, units=list(twin.layers), param_dtype=bf,
                              reduce_dtype=torch.float32 if bf16 else None,
                              micro_batches=micro_batches, uneven_collectives=uneven)
    assert predicted.comm[rank] == counted, (rank, predicted.comm[rank], counted)
    h = predicted.held[rank]
    assert {"storage": h.storage, "params": h.params, "grads": h.grads, "optim": h.optim} == held
    assert predicted.critical_bytes(rank) == stats.total("critical_bytes")


@pytest.mark.parametrize("shape, bf16, micro_batches, backend",
                         [((8,), False, 1, "gloo"), ((2, 4), True, 2, "gloo"),
                          ((2, 4), True, 2, "grouped_gloo")],
                         ids=["1-D", "HSDP-2x4-bf16-2mb", "HSDP-2x4-bf16-2mb-uneven"])
def test_plan_predicts_every_collective_and_every_byte_held(shape, bf16, micro_batches, backend):
    spawn(_worker, 8, shape, bf16, micro_batches, backend == "grouped_gloo", backend=backend)


def test_default_units_are_the_blocks():
    with torch.device("meta"):
        model = GPT(CFG)
    assert default_units(model) == list(model.layers)
    p = mf.plan_costs(model, 4)  # an int is a 1-D mesh
    assert p.plan.world_size == 4 and len(p.plan.unit_names) == 1 + CFG.n_layers
    with pytest.raises(ValueError, match="mesh_shape"):
        mf.plan_costs(model, (2, 2, 2))
