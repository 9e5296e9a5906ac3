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
from _dist import spawn
from collectives import Collectives
from reference import assert_params_close, reference_ns_fp32
from test_parity import ADAMW, MUON, _groups
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from tp_models import VOCAB, apply_tp, build_llama

import matrixfsdp as mf
from matrixfsdp.runtime.param import sharded_param

STEPS, PER, SEQ, CLIP = 3, 2, 16, 0.5


def _is_muon(name: str, p: torch.Tensor) -> bool:
    return name.startswith("layers.") and p.dim() == 2


def _data(dp: int, steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (dp * PER, SEQ + 1), generator=g) for _ in range(steps)]


def _reference(data, save_at: int | None = None):
    """One process: torch.optim.Muon (fp32 NS) + AdamW, torch's clipping; the parameters
    after every step."""
    model = build_llama()
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if _is_muon(n, p)], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named if not _is_muon(n, p)], **ADAMW)
    after = []
    with reference_ns_fp32():
        for x in data:
            model.loss(x[:, :-1], x[:, 1:]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return after


def _shard(model, dp_mesh):
    for block in model.layers:
        mf.fully_shard(block, mesh=dp_mesh)
    return mf.fully_shard(model, mesh=dp_mesh)


def _optimizer(model):
    return mf.Muon(_groups(model, MUON, ADAMW, torch.float32))


def _train(model, opt, data, dp_rank, counted: Collectives):
    """Steps over ``data``, this dp rank's rows; collectives counted in the steps and in the
    first forward (``counted["step"]``, ``counted["forward"]``)."""
    for x in data:
        x = x[dp_rank * PER:(dp_rank + 1) * PER]
        with counted.during("forward", not counted["forward"]):
            loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        mf.clip_grad_norm_(model.parameters(), CLIP)
        with counted.during("step"):
            opt.step()
        opt.zero_grad()


def _tp_2x2(rank, world, ckpt):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    data = _data(2)
    ref = _reference(data)
    for sp in (True,):  # sequence parallelism: the Replicate norms' Partial gradients too
        model = _shard(apply_tp(build_llama(), mesh["tp"], sp), mesh["dp"])
        opt = _optimizer(model)
        counted = Collectives()
        _train(model, opt, data[:2], mesh["dp"].get_local_rank(), counted)
        dcp.save(mf.get_state_dict(model, opt), checkpoint_id=ckpt)
        _train(model, opt, data[2:], mesh["dp"].get_local_rank(), counted)
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
    model = _shard(build_llama(seed=5), dp4)
    opt = _optimizer(model)
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
    ref = _reference(_data(2))
    assert_params_close(dict(plain.named_parameters()), ref[1], what="plain model ")


def _hsdp_tp(rank, world):
    """HSDP (replicate 2 x shard 1) with tp 2, then a model whose ColwiseParallel weight
    tp 2 does not divide."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    data = _data(2)
    ref = _reference(data)
    model = _shard(apply_tp(build_llama(), mesh["tp"], True), mesh["replicate", "shard"])
    opt = _optimizer(model)
    counted = Collectives()
    _train(model, opt, data, mesh["replicate"].get_local_rank(), counted)
    assert counted["step"] == 0 and counted["forward"] > 0, counted
    assert_params_close(mf.full_state_dict(model), ref[-1], what="hsdp 2x1 x tp 2 ")
    # a (5, 32) weight split over tp 2 along dim 0
    model = build_llama()
    model.layers[0].attention.wq = torch.nn.Linear(32, 5, bias=False)
    parallelize_module(model.layers[0], mesh["tp"], {"attention.wq": ColwiseParallel()})
    with pytest.raises(NotImplementedError, match=r"'layers.0.attention.wq.weight' \(5, 32\) is "
                                                  r"split over 2 tp ranks along dim 0"):
        _shard(model, mesh["replicate", "shard"])


def test_hsdp_with_tp_matches_one_process():
    """A 3-D (replicate, shard, tp) layout: HSDP over the first two dims after the TP plan
    on the third, within 1e-5 of one process, no collective in the step; an uneven TP
    split is refused naming the parameter."""
    spawn(_hsdp_tp, 4)


def _built_before(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = apply_tp(build_llama(), mesh["tp"])
    opt = torch.optim.AdamW(model.parameters())
    _shard(model, mesh["dp"])
    x = torch.randint(0, VOCAB, (PER, SEQ + 1))
    model.loss(x[:, :-1], x[:, 1:]).backward()
    with pytest.raises(ValueError, match="tensor-parallel DTensor parameter .* Build the optimizer after"):
        opt.step()


def _compiled(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _shard(apply_tp(build_llama(), mesh["tp"]), mesh["dp"])
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
    model = _shard(apply_tp(build_llama(), mesh["tp"]), mesh["dp"])
    model.layers[0] = torch.compile(model.layers[0], backend="eager")
    x = torch.randint(0, VOCAB, (PER, SEQ + 1))
    with pytest.raises(NotImplementedError, match=r"'layers.0' is a torch.compile wrapper .* tensor"):
        model.loss(x[:, :-1], x[:, 1:])


def test_a_compile_wrapper_in_a_tp_model_is_refused():
    """torch.compile(block) put back into a TP model raises at the first forward, naming
    the block (torch 2.13 computes such a block's gradients wrongly under TP)."""
    spawn(_compile_wrapped, 4)
