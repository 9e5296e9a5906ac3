"""Pipeline parallelism: torch's schedules over stages sharded by this library, 2 stages x
2 data-parallel ranks, against one process running torch.optim.Muon (fp32 NS) + AdamW on
the whole batch.

Stages are built as torchtitan builds them (the full model with other stages' layers
deleted, pp_models.py) and wrapped in ``mf.pipelining.PipelineStage`` (torch's class, taught
this library's module). Every schedule family trains within the parity bound, each stage
reduces its gradients once per step (the reduce bytes of a step do not depend on the
micro-batch count), and torch's own PipelineStage over this library's module is refused
at its first forward instead of silently leaving stages untrained."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.pp_models import build_full
from helpers.pp_training import DP, PP, PipelineRun, pp_data, pp_reference
from helpers.rank_pool import spawn
from helpers.reference import assert_params_close
from torch import nn
from torch.distributed import pipelining as tp_pipelining
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf


def _schedules(rank, world, names):
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    data = pp_data()
    ref = pp_reference(data)
    for name in names:
        for scale_grads in (True, False):
            run = PipelineRun(mesh, name, 4, scale_grads=scale_grads)
            for x in data:
                run.step(x)
            run.check(ref, f"{name} scale_grads={scale_grads} ")


@pytest.mark.parametrize("names", [["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"],
                                   ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]],
                         ids=["full-backward", "split-backward"])
def test_every_schedule_matches_one_process(names):
    """2 stages x 2 dp ranks (4 stages, 2 per rank, for the interleaved and V schedules),
    4 micro-batches, scale_grads on and off, gradients clipped by the whole model's norm
    (``pp_mesh``): every stage's parameters within the fp32-NS parity bound of one process
    after 2 steps."""
    spawn(_schedules, PP * DP, names)


def _reduced_bytes(run: PipelineRun) -> tuple[int, int]:
    """(gather, reduce) bytes of this rank's stages in one step, as the most loaded rank."""
    out = [0, 0]
    for m in run.modules:
        phases = mf.comm_stats(m).phase("critical_bytes")
        out[0] += phases.get("gather", 0)
        out[1] += phases.get("reduce", 0)
    return out[0], out[1]


def _bytes_per_step(rank, world):
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    x = pp_data(1)[0]
    ref = pp_reference([x, x])
    seen = {}
    for name in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
        for n_mb in (4, 8):
            run = PipelineRun(mesh, name, n_mb, reshard_after_forward=False)
            run.step(x)  # the first step also runs torch's shape inference
            for m in run.modules:
                mf.comm_stats(m).reset()
            run.step(x)
            seen[n_mb] = _reduced_bytes(run)
            run.check(ref, f"{name} reshard_after_forward=False, {n_mb} micro-batches ")
        assert seen[4] == seen[8] and seen[4][1] > 0, (name, seen)  # once per step


def test_one_reduce_per_step_whatever_the_micro_batch_count():
    """With reshard_after_forward=False (torchtitan's default under PP; exact against one
    process there too), a step's gather and reduce bytes are the same at 4 and 8
    micro-batches, for a full-backward, an interleaved and a split-backward schedule (torch's
    own PipelineStage over the same module reduced once per micro-batch: twice the bytes at
    8, docs/pipelining.md)."""
    spawn(_bytes_per_step, PP * DP)


def _torch_stage(rank, world):
    # One pipeline rank (its stages exchange activations in process) and 2 dp ranks: what
    # is checked is the first forward; with more pipeline ranks the later stages would
    # wait for activations that never come (the launcher ends them with the first).
    mesh = init_device_mesh("cpu", (1, DP), mesh_dim_names=("pp", "dp"))
    for name in ("GPipe", "ZBVZeroBubble"):
        run = PipelineRun(mesh, name, 4, stage_cls=tp_pipelining.PipelineStage)
        before = [p.detach().clone() for m in run.modules for p in m.parameters()]
        with pytest.raises(TypeError, match="own PipelineStage") as err:
            run.step(pp_data(1)[0])
        assert "matrixfsdp.pipelining.PipelineStage" in str(err.value)
        after = [p.detach() for m in run.modules for p in m.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), name


def test_torch_stage_is_refused_before_anything_moves():
    """torch's own PipelineStage drives data parallelism only for FSDP2 (over this library's
    module: a reduce per micro-batch, and a split backward that never reaches the
    parameters, leaving stages silently untrained): the first stage's first forward raises,
    naming the class to use, before any parameter has moved."""
    spawn(_torch_stage, DP)


def _parts_state(run: PipelineRun) -> dict:
    """torchtitan's checkpoint of pipeline parts: every part's model and optimizer state
    through torch's helpers, the optimizer state flattened (keys by parameter name)."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {}
    for m, opt in zip(run.modules, run.part_opts):
        state.update(get_model_state_dict(m))
        state.update(get_optimizer_state_dict(m, opt, options=flat))
    return state


def _resume(rank, world, ckpt):
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    data = pp_data(3)
    ref = pp_reference(data)
    # (no unused parameter here: it has no optimizer state to save, and torch's helpers
    # create state for every parameter of a fresh optimizer, as under FSDP2)
    run = PipelineRun(mesh, "Interleaved1F1B", 4, per_part_optimizers=True, unused=False)
    run.step(data[0])
    dcp.save(_parts_state(run), checkpoint_id=ckpt)  # each stage its own names
    run = PipelineRun(mesh, "Interleaved1F1B", 4, seed=5, per_part_optimizers=True, unused=False)
    state = _parts_state(run)
    dcp.load(state, checkpoint_id=ckpt)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    for m, opt in zip(run.modules, run.part_opts):
        set_model_state_dict(m, state, options=StateDictOptions(strict=False))
        set_optimizer_state_dict(m, opt, state, options=flat)
    for x in data[1:]:
        run.step(x)
    run.check(ref, "resumed ")
    # the checkpoint holds the whole model: a plain model loads every name of every stage
    plain = build_full(seed=7)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    plain.load_state_dict(sd)
    one_step = pp_reference(data[:1])
    assert_params_close({n: p.detach() for n, p in plain.named_parameters()}, one_step,
                        what="plain model ")


def test_pipeline_checkpoint_through_torch_helpers_resumes_and_loads_into_a_plain_model(tmp_path):
    """Interleaved1F1B over 4 stages (2 per rank) x 2 dp, one optimizer per stage
    (torchtitan's OptimizersContainer): torch's get_model_state_dict /
    get_optimizer_state_dict(flatten_optimizer_state_dict=True) of every stage, dcp.save
    after step 1; fresh stages built from other values load it through set_*_state_dict
    and steps 2-3 land on one process's step 3; the same checkpoint loads into the plain
    full model as one process's step 1."""
    spawn(_resume, PP * DP, str(tmp_path / "ckpt"))


def _tp_blocks(stage: nn.Module, tp_mesh) -> None:
    """torchtitan's block plan (Colwise q/k/v/w1/w3, Rowwise wo/w2) on a stage's blocks; its
    embedding, norm and head stay whole on every tp rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    for block in stage.layers.values():
        parallelize_module(block, tp_mesh, {
            **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
            **{f"feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")},
            "attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})


def _pp_tp(rank, world):
    mesh = init_device_mesh("cpu", (PP, DP, 2), mesh_dim_names=("pp", "dp", "tp"))
    data = pp_data()
    ref = pp_reference(data)
    for name in ("1F1B", "ZBVZeroBubble"):
        run = PipelineRun(mesh, name, 4, tp_plan=_tp_blocks)
        for x in data:
            run.step(x)
        run.check(ref, f"{name} pp x dp x tp ")


def test_pipeline_with_tensor_parallelism_matches_one_process():
    """8 ranks, (pp 2, dp 2, tp 2): every stage TP'd with torchtitan's block plan, then
    sharded over dp; 1F1B and ZBVZeroBubble (split backward) within the parity bound of one
    process, gradients clipped over the whole model."""
    spawn(_pp_tp, 8)


def _pp_hsdp(rank, world):
    mesh = init_device_mesh("cpu", (PP, 2, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    data = pp_data(dp=4)
    ref = pp_reference(data)
    run = PipelineRun(mesh, "Interleaved1F1B", 4, dp_dims=("dp_replicate", "dp_shard"))
    for x in data:
        run.step(x)
    run.check(ref, "pp x HSDP ")


def test_pipeline_with_hsdp_matches_one_process():
    """8 ranks, (pp 2, dp_replicate 2, dp_shard 2): each stage under HSDP on its 2-D slice,
    Interleaved1F1B within the parity bound of one process on the whole batch."""
    spawn(_pp_hsdp, 8)
