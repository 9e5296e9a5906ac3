"""Expert parallelism as torchtitan lays it out: experts DTensors over ``ep``, the experts'
``fully_shard`` over the data-parallel ranks outside ep (``dp_shard_mod_ep``), the dense
units over every data-parallel rank (dp x ep flattened), and FSDP2's
``set_gradient_divide_factor`` on the experts.

Against one process running torch.optim.Muon (fp32 NS, every expert its own 2-D matrix) +
AdamW on the whole batch: parameters within 1e-5, the gradient norm equal (so the experts'
gradients are averaged right; torch's norm of the list of gradients too), zero collectives
in the step; the checkpoint loads at dp 4
without EP."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from helpers.collectives import Collectives
from helpers.ep_models import VOCAB, apply_ep, build_moe
from helpers.parity import ADAMW, MUON, muon_groups
from helpers.rank_pool import spawn
from helpers.reference import assert_params_close, reference_ns_fp32
from helpers.titan_hf import titan_hf_export
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.runtime.param import sharded_param

STEPS, PER, SEQ, CLIP = 3, 1, 8, 1.0


def _data(ranks: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (ranks * PER, SEQ + 1), generator=g) for _ in range(STEPS)]


def _is_muon(name: str, p: torch.Tensor) -> bool:
    return name.startswith("layers.") and p.dim() in (2, 3)


def _reference(data):
    """One process: torch.optim.Muon on every expert as its own matrix (a stack's
    ``unbind(0)`` views), AdamW on the rest; the parameters and gradient norm per step."""
    model = build_moe()
    named = list(model.named_parameters())
    mats = [m for n, p in named if _is_muon(n, p) for m in (p.unbind(0) if p.dim() == 3 else [p])]
    muon_params = [torch.nn.Parameter(m.detach().clone()) for m in mats]
    adamw = torch.optim.AdamW([p for n, p in named if not _is_muon(n, p)], **ADAMW)
    muon = torch.optim.Muon(muon_params, **MUON)
    after, norms = [], []
    with reference_ns_fp32():
        for x in data:
            model.loss(x[:, :-1], x[:, 1:]).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            flat = [g for n, p in named if _is_muon(n, p)
                    for g in (p.grad.unbind(0) if p.dim() == 3 else [p.grad])]
            for mp, g in zip(muon_params, flat):
                mp.grad = g.clone()
            muon.step()
            adamw.step()
            with torch.no_grad():  # the stepped copies back into the model
                it = iter(muon_params)
                for n, p in named:
                    if _is_muon(n, p):
                        for m in (p.unbind(0) if p.dim() == 3 else [p]):
                            m.copy_(next(it))
            model.zero_grad()
            adamw.zero_grad()
            muon.zero_grad()
            after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return after, norms


def _shard_ep(model, mesh, dense):
    for block in model.layers:
        experts = mf.fully_shard(block.moe.experts, mesh=mesh["dp_shard_mod_ep"])
        experts.set_gradient_divide_factor(dense.size())  # torchtitan's: the whole dp degree
        mf.fully_shard(block, mesh=dense)
    return mf.fully_shard(model, mesh=dense)


def _ep_2x2(rank, world, ckpt):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    dense = mesh["dp_shard_mod_ep", "ep"]._flatten("dp")
    data = _data(4)
    ref, ref_norms = _reference(data)
    model = _shard_ep(apply_ep(build_moe(), mesh["ep"]), mesh, dense)
    # set_gradient_divide_factor before the block's fully_shard planned the experts as a
    # root of their own first: under the model's root they are a block again, resharded
    # after forward (FSDP2's default), as every block
    assert [u.reshard_after_forward for u in mf.get_root(model).units] == [False] + [True] * 4
    opt = mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32))
    norms = []
    counted = Collectives()
    for step, x in enumerate(data):
        x = x[rank * PER:(rank + 1) * PER]
        with counted.during("forward", step == 0):
            loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        # torch's norm of the list of gradients (torchtitan's clip): the experts' units are
        # on a mesh of their own inside the root's, each element counted once
        listed = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()
                                                if p.grad is not None], foreach=True)
        norms.append(mf.clip_grad_norm_(model.parameters(), CLIP).item())
        torch.testing.assert_close(listed.full_tensor().item(), norms[-1], rtol=1e-6, atol=0)
        with counted.during("step"):
            opt.step()
        opt.zero_grad()
        if step == 1:
            dcp.save(mf.get_state_dict(model, opt), checkpoint_id=ckpt)
    assert counted["step"] == 0 and counted["forward"] > 0, counted
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    # each expert whole on one rank: this rank's experts are a whole-expert range of its
    # ep rank's local stack
    for p in model.parameters():
        info = sharded_param(p)
        if info.placement.spec.is_experts:
            assert p.shape[1:] == info.placement.spec.shape[1:]
    full = mf.full_state_dict(model)
    assert_params_close(full, ref[-1], what="ep 2x2 ")
    # torch's full export: every expert gathered over dp_shard_mod_ep, then ep
    exported = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert all(torch.equal(exported[n], t) for n, t in full.items())
    # torchtitan's HF export of the same sharded state (DCP + HuggingFaceStorageWriter): exact
    hf = titan_hf_export(model, os.path.dirname(ckpt), len(data))
    if rank == 0:
        assert sorted(hf) == sorted(full), sorted(set(hf) ^ set(full))
        assert all(torch.equal(hf[n], t) for n, t in full.items())
    # the checkpoint, at dp 4 without expert parallelism
    plain = build_moe(seed=3)
    for block in plain.layers:
        mf.fully_shard(block, mesh=dense)
    mf.fully_shard(plain, mesh=dense)
    opt = mf.Muon(muon_groups(plain, MUON, ADAMW, torch.float32))
    state = mf.get_state_dict(plain, opt)
    dcp.load(state, checkpoint_id=ckpt)
    mf.set_state_dict(plain, opt, state)
    assert_params_close(mf.full_state_dict(plain), ref[1], what="loaded at dp 4 ")


def test_ep_2x2_matches_one_process(tmp_path):
    """EP 2 x dp_shard_mod_ep 2 on 4 ranks (torchtitan's layout): within 1e-5 of one
    process, gradient norms equal, no collective in the step; torch's full export equals
    ``mf.full_state_dict``; its checkpoint loads at dp 4 with the experts unsplit."""
    spawn(_ep_2x2, 4, str(tmp_path / "ckpt"))  # torch's get_model_state_dict(full) too
