"""The planner's byte and op model equals the runtime, to the byte, the op and the launch,
and the runtime counts from the tensors it hands to each collective
(``runtime/collectives.py``'s ``charge``), never from the planner's load functions: so a
wrong load function, op list or launch rule in the planner fails here.

On 8 ranks, one steady training step, each rank's counters against:

* ``matrixfsdp.plan_costs`` (per rank and collective kind: ops, payload, sent, received,
  critical and mean bytes; launches per phase; bytes held), 1-D and 2 x 4 HSDP (bf16
  gathers, two micro-batches), on gloo (one launch per op) and on grouped_gloo (NCCL's
  coalesced launches on CPU);
* the layout search's own cost path (``layout_eval.cost_path`` -> ``passes.rank_counts``:
  launches, ops and critical bytes per phase), in those runs and at tp 2 (dp 4 x tp 2,
  torchtitan's TP plan) and pp 2 (2 stages x dp 4, torch's 1F1B over
  ``mf.pipelining.PipelineStage``)."""

from __future__ import annotations

import pytest
import torch
from helpers.rank_pool import spawn
from torch.distributed.fsdp import MixedPrecisionPolicy

import matrixfsdp as mf
from matrixfsdp.advisor.layout_eval import cost_path
from matrixfsdp.advisor.model_shapes import shapes_of
from matrixfsdp.costs.links import Links
from matrixfsdp.costs.passes import rank_counts, step_counts
from matrixfsdp.costs.predict import default_units
from matrixfsdp.layout.traffic import Dtypes
from matrixfsdp.runtime.module import get_root
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


def _phases(stats) -> dict[str, dict[str, float]]:
    """The runtime's counts per phase: launches, ops, critical bytes."""
    calls, crit = stats.phase("calls"), stats.phase("critical_bytes")
    return {ph: {"launches": stats.launches[ph], "calls": calls[ph],
                 "critical_bytes": float(crit[ph])} for ph in calls if calls[ph]}


def _searched(model, units, shape, d: Dtypes, coalesced: bool, stage: int = 0):
    """The search's costs of this layout (``shape``: (pp, replicate, shard, tp)) for one
    stage: its units' collectives, as ``matrixfsdp plan`` costs them."""
    pp, R, S, T = shape
    found = cost_path(shapes_of(model, units), R, S, T, pp, dtypes=d,
                      links=Links(coalesced=coalesced))
    return found[stage][2].units


def _worker(rank, world_size, shape, bf16, micro_batches, coalesced):
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
                              micro_batches=micro_batches, coalesced=coalesced)
    assert predicted.comm[rank] == counted, (rank, predicted.comm[rank], counted)
    assert predicted.launches[rank] == dict(stats.launches), (rank, predicted.launches[rank])
    h = predicted.held[rank]
    assert {"storage": h.storage, "params": h.params, "grads": h.grads, "optim": h.optim} == held
    assert predicted.critical_bytes(rank) == stats.total("critical_bytes")
    S = shape[-1]
    d = Dtypes(4, 2 if bf16 else 4, 4)
    units = _searched(twin, list(twin.layers), (1, world_size // S, S, 1), d, coalesced)
    assert rank_counts(units, rank % S, 0, micro_batches) == _phases(stats), rank


@pytest.mark.parametrize("shape, bf16, micro_batches, backend",
                         [((8,), False, 1, "gloo"), ((2, 4), True, 2, "gloo"),
                          ((2, 4), True, 2, "grouped_gloo")],
                         ids=["1-D", "HSDP-2x4-bf16-2mb", "HSDP-2x4-bf16-2mb-coalesced"])
def test_plan_predicts_every_collective_and_every_byte_held(shape, bf16, micro_batches, backend):
    spawn(_worker, 8, shape, bf16, micro_batches, backend == "grouped_gloo", backend=backend)


def _tp_worker(rank, world_size, dp, tp, coalesced, ownership="auto"):
    from helpers.tp_models import TINY, VOCAB, Llama, apply_tp, build_llama
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = apply_tp(build_llama(0), mesh["tp"])
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh["dp"], tp_ownership=ownership)
    mf.fully_shard(model, mesh=mesh["dp"], tp_ownership=ownership)
    opt = mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=1e-3))
    stats = mf.comm_stats(model)
    g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    for step in range(2):
        if step == 1:
            stats.reset()
        x = torch.randint(0, VOCAB, (2, 9), generator=g)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    with torch.device("meta"):
        twin = Llama(TINY)
    (_, plan, costs), = cost_path(shapes_of(twin, list(twin.layers)), 1, dp, tp,
                                  dtypes=Dtypes(), links=Links(coalesced=coalesced),
                                  tp_ownership=ownership)
    predicted = rank_counts(costs.units, rank // tp, rank % tp, 1)
    predicted.update(step_counts(plan, rank // tp, tp, rank % tp))  # the split NS's all-reduces
    assert predicted == _phases(stats), (rank, predicted, _phases(stats))
    if ownership == "group":  # nothing hops inside the tp group; the step's ops stay in it
        assert not {"tp_all_to_all", "tp_grad_all_to_all"} & set(stats.counts)
        assert predicted["step"]["calls"] > 0


@pytest.mark.parametrize("dp, tp, backend, ownership",
                         [(4, 2, "grouped_gloo", "auto"), (2, 4, "gloo", "auto"),
                          (2, 4, "gloo", "group")],
                         ids=["dp4-tp2-coalesced", "dp2-tp4", "dp2-tp4-group"])
def test_search_counts_tensor_parallel_ops_as_the_runtime(dp, tp, backend, ownership):
    """The search's cost path, rank by rank, against the runtime's counters at dp x tp:
    every phase's launches, ops and critical bytes, with matrices held whole on one tp rank
    (the tiny model's "auto") or owned by their tp group (no tp hop in forward and backward;
    the optimizer step's split Newton-Schulz all-reduces over the tp group, batched by
    shape: ``passes.step_counts``)."""
    spawn(_tp_worker, 8, dp, tp, backend == "grouped_gloo", ownership, backend=backend)


def _keep_worker(rank, world_size, micro_batches):
    """HSDP 2 x 4 (bf16 gathers), the root and the first block gathered once per step and
    reduced once (FSDP2's methods), the last block not gathered again in backward: the
    runtime's counts against the search's ``keep="edges"``."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh, mp_policy=mp)
    mf.fully_shard(model, mesh=mesh, mp_policy=mp)
    first, last = model.layers[0], model.layers[-1]
    model.set_reshard_after_backward(False, recurse=False)
    first.set_reshard_after_forward(False)
    first.set_reshard_after_backward(False)
    last.set_reshard_after_forward(False)
    opt = mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=1e-3))
    stats = mf.comm_stats(model)
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        if step == 1:
            stats.reset()
        for mb in range(micro_batches):
            sync = mb == micro_batches - 1
            model.set_requires_gradient_sync(sync, recurse=False)
            first.set_requires_gradient_sync(sync)
            x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
            model.loss(x, x).backward()
        opt.step()
        opt.zero_grad()
    with torch.device("meta"):
        twin = GPT(CFG)
    units = _searched(twin, list(twin.layers), (1, 2, 4, 1), Dtypes(4, 2, 4), True)
    assert rank_counts(units, rank % 4, 0, micro_batches, keep="edges") == _phases(stats), rank


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_search_counts_the_units_kept_gathered_as_the_runtime(micro_batches):
    spawn(_keep_worker, 8, micro_batches, backend="grouped_gloo")


def _pp_worker(rank, world_size):
    from helpers.pp_models import PP_CONFIG
    from helpers.pp_training import PipelineRun, pp_data
    from helpers.tp_models import Llama
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    run = PipelineRun(mesh, "1F1B", 2, unused=False, reshard_after_forward=False)  # torchtitan's
    stats = [mf.comm_stats(m) for m in run.modules]
    for step, x in enumerate(pp_data(2, 4)):
        if step == 1:
            for s in stats:
                s.reset()
        run.step(x)
    with torch.device("meta"):
        full = Llama(PP_CONFIG)
    stage = mesh["pp"].get_local_rank()
    units = _searched(full, list(full.layers), (2, 1, 4, 1), Dtypes(), False, stage)
    assert rank_counts(units, rank % 4, 0, 2, pp=2) == _phases(stats[0]), rank


def test_search_counts_pipeline_stages_as_the_runtime():
    spawn(_pp_worker, 8)


def test_default_units_are_the_blocks():
    with torch.device("meta"):
        model = GPT(CFG)
    assert default_units(model) == list(model.layers)
    p = mf.plan_costs(model, 4)  # an int is a 1-D mesh
    assert p.plan.world_size == 4 and len(p.plan.unit_names) == 1 + CFG.n_layers
    with pytest.raises(ValueError, match="mesh_shape"):
        mf.plan_costs(model, (2, 2, 2))
