"""The parity runs' shared settings and their N-rank run: MatrixFSDP on N gloo ranks
against torch.optim.Muon + torch.optim.AdamW on one process over the concatenated global
batch (the parity tests, the grouped (NCCL) path's tests, and every test that trains
against torch with these settings)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from helpers.collectives import Collectives
from helpers.rank_pool import spawn
from helpers.reference import (
    batches,
    build_model,
    is_muon_name,
    linear_decay,
    muon_with_head,
    rank_slice,
    train_reference,
)
from matrixfsdp.runtime.param import placement_of
from matrixfsdp.train.models import GPTConfig

STEPS, PER_RANK, SEQ = 10, 2, 16
# Shapes divisible by none of 2, 3, 4, 8: d_model 35 (5 heads of 7), MLP 55, 17 positions.
ODD = dict(vocab_size=256, d_model=35, n_heads=5, n_layers=2, d_mlp=55, seq_len=17)
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
# AdamW's update g / (sqrt(v) + eps) has slope up to 1/eps at g ~ 0. With eps = 1e-8 the
# ~1e-10 rounding difference between one process summing the global batch and N ranks
# summing their shards moves a near-zero-gradient element by ~1e-5 (measured). eps = 1e-6
# bounds that amplification, so the tight tests check the distribution logic, not Adam's
# conditioning. The bit-identical test uses torch's default eps.
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)


def muon_groups(model, muon_kw, adamw_kw, ns_dtype, **options):
    """``mf.muon_param_groups`` from a Muon and an AdamW keyword dict (as torch's optimizers
    take them)."""
    adamw = {f"adamw_{k}": v for k, v in adamw_kw.items() if k != "lr"}
    return mf.muon_param_groups(model, **muon_kw, ns_dtype=ns_dtype, adamw_lr=adamw_kw["lr"],
                                **adamw, **options)


def train_worker(rank, world_size, case, out_path):
    """One rank of :func:`run_parity`: ``case`` trained, rank 0 saving what the checks read."""
    cfg = GPTConfig(**case["cfg"])
    model = build_model(case.get("kind", "gpt"), cfg)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh, reshard_after_forward=case.get("reshard", None))
    mf.fully_shard(model, mesh=mesh, muon_filter=case.get("rule"))
    # the path taken: one launch per unit on a group that coalesces (grouped_gloo)
    assert mf.get_root(model).comm.coalesce == (dist.get_backend() != "gloo" or world_size == 1)
    ns_dtype = torch.float32 if case["ns_fp32"] else torch.bfloat16
    opt = mf.Muon(muon_groups(model, case["muon"], case["adamw"], ns_dtype))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_decay) if case.get("schedule") else None
    data = batches(STEPS, world_size, PER_RANK, SEQ)
    counted = Collectives()
    for i, x in enumerate(data):
        x = rank_slice(x, rank, PER_RANK, case["same_data"])
        micro = case.get("micro", 1)  # gradient accumulation over micro-batches
        for xm in x.chunk(micro):
            with counted.during("forward", i == 0):
                loss = model.loss(xm[:, :-1], xm[:, 1:]) / micro
            loss.backward()
        # Between steps only this rank's shards stay allocated: every unit is resharded.
        assert all(u.storage.gathered.untyped_storage().size() == 0 for u in mf.get_root(model).units)
        with counted.during("step"):
            opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())
        if sched:
            sched.step()
        if case.get("checkpoint_at") == i + 1:  # save, rebuild from scratch, load, go on
            saved = (mf.full_state_dict(model), opt.state_dict())
            model = build_model(case.get("kind", "gpt"), cfg, seed=123)
            for block in model.layers:
                mf.fully_shard(block, mesh=mesh)
            mf.fully_shard(model, mesh=mesh)
            mf.load_full_state_dict(model, saved[0])
            opt = mf.Muon(muon_groups(model, case["muon"], case["adamw"], ns_dtype))
            opt.load_state_dict(saved[1])
    step_collectives, other_collectives = counted["step"], counted["forward"]
    owners = {}
    for p in model.parameters():
        pl = placement_of(p)
        if pl.spec.muon:
            has_state = "momentum_buffer" in opt.state.get(p, {})
            assert has_state == (pl.owner == rank), f"momentum of {pl.spec.name} on rank {rank}"
            owners[pl.spec.name] = pl.owner
    state = mf.full_state_dict(model)
    if rank == 0:
        torch.save({"params": state, "step_collectives": step_collectives,
                    "other_collectives": other_collectives, "owners": owners}, out_path)


def run_parity(case, world_size, tmp_path, backend="gloo"):
    """``case`` trained on ``world_size`` ranks (:func:`train_worker`) and on one process
    (torch's optimizers); no collective inside ``optimizer.step()``. Returns (ours, the
    reference's parameters)."""
    torch.set_num_threads(1)
    out = os.path.join(tmp_path, "out.pt")
    spawn(train_worker, world_size, case, out, backend=backend)
    ours = torch.load(out)
    data = batches(STEPS, world_size, PER_RANK, SEQ)
    if case["same_data"]:
        data = [x[:PER_RANK] for x in data]
    ref = train_reference(GPTConfig(**case["cfg"]), data, muon_kw=case["muon"],
                          adamw_kw=case["adamw"], ns_fp32=case["ns_fp32"],
                          schedule=linear_decay if case.get("schedule") else None,
                          kind=case.get("kind", "gpt"), rule=case.get("rule") or is_muon_name)
    assert ours["step_collectives"] == 0, "optimizer.step() issued collectives"
    if world_size > 1:
        assert ours["other_collectives"] > 0, "the profiler saw no collective at all"
    assert list(ours["params"]) == list(ref), "parameter names changed under sharding"
    return ours, ref


# Different data per rank, fp32 NS, by world size: runtime/test_parity.py runs them on gloo,
# runtime/test_nccl_path.py on the grouped (NCCL) path.
FP32_CASES = {
    1: dict(cfg={**ODD, "fused_qkv": True, "norm_bias": False}),
    2: dict(cfg={**ODD, "mlp_bias": True}, reshard=False, rule=muon_with_head,
            muon={**MUON, "nesterov": False, "adjust_lr_fn": "match_rms_adamw", "lr": 0.002}),
    3: dict(cfg={**ODD, "fused_qkv": True}, schedule=True),
    4: dict(cfg={**ODD, "norm_bias": False, "gated_mlp": True}, micro=2),
    8: dict(cfg={**ODD, "n_layers": 1}),  # one block: 6 matrices for 8 ranks
}
