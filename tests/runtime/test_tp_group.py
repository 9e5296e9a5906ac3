"""Tensor parallelism with ``tp_ownership="group"``: each tp-split matrix owned by its owner's
whole tp group, each tp rank keeping and stepping its own slice, the Newton-Schulz run over
the group. On 8 gloo ranks, replicate 2 x shard 2 x tp 2 (torchtitan's Llama plan with
sequence parallelism: ColwiseParallel q, k, v, w1, w3 sliced by rows, RowwiseParallel wo, w2
by columns), against one process running torch.optim.Muon (fp32 NS) + AdamW on the whole
batch, with torch's clipping:

* the parameters after 3 steps within the parity bound (1e-5); torch's norm of the list of
  gradients (what torchtitan's clip takes) is the global norm, mf.clip_grad_norm_'s;
* forward and backward move nothing inside the tp groups (no tp hop: ``tp_all_to_all`` /
  ``tp_grad_all_to_all`` never issued), the step's only collectives are the tp groups'
  Newton-Schulz all-reduces (``tp_step_allreduce``), none on a data-parallel group;
* "rank" (the tp hop) and "group" give the same parameters, and each loads the other's DCP
  checkpoint (model and optimizer state: the group's column slices are placed in the whole
  matrix);
* per-head Muon on group-owned q, k, v equals torch.optim.Muon on each head's rows;
  ``mf.matrix_params`` (other matrix optimizers) refuses a slice, naming it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.parity import ADAMW, MUON, muon_groups
from helpers.per_head import per_head_reference
from helpers.rank_pool import spawn
from helpers.reference import assert_params_close
from helpers.tp_models import apply_tp, build_llama
from helpers.tp_training import CLIP, PER, tp_data, tp_reference
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.optim.groups import head_blocks


def _model(mesh, ownership: str):
    dp = mesh["replicate", "shard"]
    model = apply_tp(build_llama(seed=5), mesh["tp"], True)  # another init: loads must fill it
    for block in model.layers:
        mf.fully_shard(block, mesh=dp)
    mf.fully_shard(model, mesh=dp, tp_ownership=ownership)
    return model, mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32))


def _train(model, opt, data, dp_rank: int, step_calls: dict, clip: bool = True) -> None:
    stats = mf.comm_stats(model)
    for x in data:
        x = x[dp_rank * PER:(dp_rank + 1) * PER]
        model.loss(x[:, :-1], x[:, 1:]).backward()
        if clip:  # torch's norm of the list (torchtitan's clip) is the global norm under TP too
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            listed = torch.nn.utils.get_total_norm(grads, foreach=True).full_tensor()
            ours = mf.clip_grad_norm_(model.parameters(), CLIP)
            torch.testing.assert_close(listed, ours, rtol=1e-6, atol=0)
        before = dict(stats.calls)
        opt.step()
        for k, n in stats.calls.items():
            if n > before.get(k, 0):
                step_calls[k] = step_calls.get(k, 0) + n - before.get(k, 0)
        opt.zero_grad()


def _run(mesh, ownership: str, ckpt: str, load_from: str | None) -> dict:
    """Steps 1-2 from the seed (or, ``load_from``, step 2's checkpoint of another
    placement), a checkpoint, step 3."""
    dp_rank = mesh["replicate", "shard"]._flatten().get_local_rank()
    data = tp_data(4)
    model, opt = _model(mesh, ownership)
    seed = {"model": model.state_dict()}  # the one-process init (FSDP2's way to load it)
    dcp.load(seed, checkpoint_id=f"{ckpt}/seed")
    model.load_state_dict(seed["model"])
    step_calls: dict[str, int] = {}
    if load_from is None:
        _train(model, opt, data[:2], dp_rank, step_calls)
        dcp.save(mf.get_state_dict(model, opt), checkpoint_id=f"{ckpt}/{ownership}")
    else:  # the other placement's checkpoint: model and optimizer state
        state = mf.get_state_dict(model, opt)
        dcp.load(state, checkpoint_id=f"{ckpt}/{load_from}")
        mf.set_state_dict(model, opt, state)
    after2 = mf.full_state_dict(model)
    _train(model, opt, data[2:], dp_rank, step_calls)
    return dict(after2=after2, params=mf.full_state_dict(model),
                calls=dict(mf.comm_stats(model).counts), step_calls=step_calls)


def _per_head(mesh) -> dict[str, torch.Tensor]:
    """Per-head Muon on group-owned q, k, v (whole heads in each tp rank's row slice): two
    steps without clipping."""
    dp = mesh["replicate", "shard"]
    model = apply_tp(build_llama(), mesh["tp"], True)
    for block in model.layers:
        mf.fully_shard(block, mesh=dp)
    mf.fully_shard(model, mesh=dp, tp_ownership="group")
    opt = mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32, per_head=True))
    with pytest.raises(ValueError, match=r"'layers.0.attention.wq.weight' \(32, 32\) is owned by "
                                         r"its tp group.*tp_ownership=\"rank\""):
        mf.matrix_params(model)  # a matrix optimizer would step a slice as a matrix
    _train(model, opt, tp_data(4)[:2], dp._flatten().get_local_rank(), {}, clip=False)
    return mf.full_state_dict(model)


def _worker(rank, world, out):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    res = {"group": _run(mesh, "group", out, None), "rank": _run(mesh, "rank", out, None),
           "group<-rank": _run(mesh, "group", out, "rank"),
           "rank<-group": _run(mesh, "rank", out, "group")}
    torch.save(dict(runs=res, per_head=_per_head(mesh)), f"{out}/rank{rank}.pt")


def test_group_owned_matrices_match_one_process(tmp_path):
    """Both placements within the parity bound of one process at every step; each loads
    the other's DCP checkpoint (model and optimizer state) and its step 3 lands on one
    process's; the "group" checkpoint loads into a plain model; no tp hop under "group",
    and its step's only collectives are the tp groups' NS all-reduces."""
    torch.manual_seed(0)
    dcp.save({"model": build_llama().state_dict()}, checkpoint_id=str(tmp_path / "seed"), no_dist=True)
    spawn(_worker, 8, str(tmp_path))
    ref = tp_reference(tp_data(4))
    plain = build_llama(seed=9)
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "group"), no_dist=True)
    plain.load_state_dict(state["model"])
    assert_params_close(dict(plain.named_parameters()), ref[1], what="plain model ")
    model = build_llama()
    heads = per_head_reference(model, tp_data(4)[:2], head_blocks(model),
                               loss=lambda m, x: m.loss(x[:, :-1], x[:, 1:]))
    for r in range(8):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert_params_close(got["per_head"], heads, what=f"rank {r} per-head ")
        res = got["runs"]
        for name, run in res.items():
            assert_params_close(run["after2"], ref[1], what=f"rank {r} {name} step 2 ")
            assert_params_close(run["params"], ref[2], what=f"rank {r} {name} step 3 ")
        group, rank = res["group"], res["rank"]
        # nothing crosses the tp group in forward or backward; the step's collectives are the
        # tp group's all-reduces alone
        hop = ("tp_all_to_all", "tp_grad_all_to_all")
        assert sum(group["calls"].get(k, {}).get("sent_bytes", 0) for k in hop) == 0, group["calls"]
        assert set(group["step_calls"]) == {"tp_step_allreduce"}, group["step_calls"]
        assert rank["step_calls"] == {}, rank["step_calls"]  # one tp rank steps it whole
        assert sum(rank["calls"].get(k, {}).get("sent_bytes", 0) for k in hop) > 0  # its hop
