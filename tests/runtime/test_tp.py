"""Tensor parallelism: torchtitan's Llama TP plan, then fully_shard over the dp dim.

Against one process running torch.optim.Muon (fp32 NS) + AdamW on the whole batch: the
step equals Muon on each whole logical matrix, with zero collectives in optimizer.step();
gradient clipping is global over dp x tp; DCP checkpoints saved at dp 2 x tp 2 load at
dp 4 and into a plain model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.collectives import Collectives
from helpers.rank_pool import spawn
from helpers.reference import assert_params_close
from helpers.tp_models import VOCAB, apply_tp, build_llama
from helpers.tp_training import CLIP, PER, SEQ, tp_data, tp_optimizer, tp_reference, tp_shard, tp_train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import matrixfsdp as mf
from matrixfsdp.runtime.param import sharded_param


def _tp_2x2(rank, world, ckpt):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    data = tp_data(2)
    ref = tp_reference(data)
    for sp in (True,):  # sequence parallelism: the Replicate norms' Partial gradients too
        model = tp_shard(apply_tp(build_llama(), mesh["tp"], sp), mesh["dp"])
        opt = tp_optimizer(model)
        counted = Collectives()
        tp_train(model, opt, data[:2], mesh["dp"].get_local_rank(), counted)
        dcp.save(mf.get_state_dict(model, opt), checkpoint_id=ckpt)
        tp_train(model, opt, data[2:], mesh["dp"].get_local_rank(), counted)
        inside, other = counted["step"], counted["forward"]
        assert inside == 0 and other > 0, (inside, other)
        # every Muon matrix whole on exactly one rank of the 2 x 2 grid, with its momentum
        for p in model.parameters():
            info = sharded_param(p)
            if info.is_matrix:
                whole = torch.tensor([int(p.numel() == info.placement.spec.numel)])
                dist.all_reduce(whole)
                assert whole.item() == 1, (info.name, whole.item())
                assert ("momentum_buffer" in opt.state.get(p, {})) == bool(p.numel())
        assert_params_close(mf.full_state_dict(model), ref[-1], what=f"sp={sp} ")
    # the checkpoint of dp 2 x tp 2, loaded at dp 4 (no TP), trains on exactly
    dp4 = init_device_mesh("cpu", (4,))
    model = tp_shard(build_llama(seed=5), dp4)
    opt = tp_optimizer(model)
    state = mf.get_state_dict(model, opt)
    dcp.load(state, checkpoint_id=ckpt)
    mf.set_state_dict(model, opt, state)
    assert_params_close(mf.full_state_dict(model), ref[1], what="loaded at dp 4 ")
    for x in data[2:]:  # the same global batch, one row per rank
        x = x[rank:rank + 1]
        model.loss(x[:, :-1], x[:, 1:]).backward()
        mf.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    assert_params_close(mf.full_state_dict(model), ref[2], what="resumed at dp 4 ")


def test_tp_2x2_matches_one_process_and_reshards_to_dp4(tmp_path):
    """dp 2 x tp 2, torchtitan's Llama plan with sequence parallelism: within
    1e-5 of one process after 3 steps with clipping, zero collectives in every step; the
    DCP checkpoint taken after step 2 loads at dp 4 (no TP) and step 3 there lands on one
    process's step 3; the same checkpoint loads into a plain model."""
    ckpt = str(tmp_path / "ckpt")
    spawn(_tp_2x2, 4, ckpt)
    plain = build_llama(seed=7)
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    plain.load_state_dict(state["model"])
    ref = tp_reference(tp_data(2))
    assert_params_close(dict(plain.named_parameters()), ref[1], what="plain model ")


def _hsdp_tp(rank, world):
    """HSDP (replicate 2 x shard 1) with tp 2, then a model whose ColwiseParallel weight
    tp 2 does not divide."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    data = tp_data(2)
    ref = tp_reference(data)
    model = tp_shard(apply_tp(build_llama(), mesh["tp"], True), mesh["replicate", "shard"])
    opt = tp_optimizer(model)
    counted = Collectives()
    tp_train(model, opt, data, mesh["replicate"].get_local_rank(), counted)
    assert counted["step"] == 0 and counted["forward"] > 0, counted
    assert_params_close(mf.full_state_dict(model), ref[-1], what="hsdp 2x1 x tp 2 ")
    # a (5, 32) weight split over tp 2 along dim 0
    model = build_llama()
    model.layers[0].attention.wq = torch.nn.Linear(32, 5, bias=False)
    parallelize_module(model.layers[0], mesh["tp"], {"attention.wq": ColwiseParallel()})
    with pytest.raises(NotImplementedError, match=r"'layers.0.attention.wq.weight' \(5, 32\) is "
                                                  r"split over 2 tp ranks along dim 0"):
        tp_shard(model, mesh["replicate", "shard"])


def test_hsdp_with_tp_matches_one_process():
    """A 3-D (replicate, shard, tp) layout: HSDP over the first two dims after the TP plan
    on the third, within 1e-5 of one process, no collective in the step; an uneven TP
    split is refused naming the parameter."""
    spawn(_hsdp_tp, 4)


def _built_before(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = apply_tp(build_llama(), mesh["tp"])
    opt = torch.optim.AdamW(model.parameters())
    tp_shard(model, mesh["dp"])
    x = torch.randint(0, VOCAB, (PER, SEQ + 1))
    model.loss(x[:, :-1], x[:, 1:]).backward()
    with pytest.raises(ValueError, match="tensor-parallel DTensor parameter .* Build the optimizer after"):
        opt.step()


def _compiled(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tp_shard(apply_tp(build_llama(), mesh["tp"]), mesh["dp"])
    model.layers[0].compile(backend="eager")
    x = torch.randint(0, VOCAB, (PER, SEQ + 1))
    with pytest.raises(NotImplementedError, match=r"unit 'layers.0' was compiled .* tensor parallelism"):
        model.loss(x[:, :-1], x[:, 1:])


def test_compiled_block_with_tp_is_refused():
    """module.compile() on a block of a TP model computes wrong gradients on torch 2.13 (and
    crashes under FSDP2 + TP): refused at its first forward, on every rank, naming the unit."""
    spawn(_compiled, 4)


def test_optimizer_built_before_fully_shard_is_refused():
    """FSDP2 replaces every parameter; here a DTensor parameter is replaced too (a DTensor
    cannot become a plain shard): an optimizer holding the old one raises at its step on
    every rank instead of silently never stepping it."""
    spawn(_built_before, 4)


def _compile_wrapped(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tp_shard(apply_tp(build_llama(), mesh["tp"]), mesh["dp"])
    model.layers[0] = torch.compile(model.layers[0], backend="eager")
    x = torch.randint(0, VOCAB, (PER, SEQ + 1))
    with pytest.raises(NotImplementedError, match=r"'layers.0' is a torch.compile wrapper .* tensor"):
        model.loss(x[:, :-1], x[:, 1:])


def test_a_compile_wrapper_in_a_tp_model_is_refused():
    """torch.compile(block) put back into a TP model raises at the first forward, naming
    the block (torch 2.13 computes such a block's gradients wrongly under TP)."""
    spawn(_compile_wrapped, 4)
