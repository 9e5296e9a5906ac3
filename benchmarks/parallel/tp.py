"""Tensor parallelism: the most loaded rank's bytes, MatrixFSDP dp x tp against FSDP2 + TP.

``matrixfsdp bench --tp`` (or ``python -m benchmarks.parallel.tp``) runs, for every grid of
``--grids`` (default ``2x2,4x2``: dp 2 x tp 2 on 4 ranks, dp 4 x tp 2 on 8), on local gloo
ranks, in the same run and on the same data:

* ``matrixfsdp``: a Llama-shaped model (:class:`Llama`, torchtitan's layout), torchtitan's
  TP plan (:func:`apply_tp`) on ``mesh["tp"]``, then ``matrixfsdp.fully_shard`` per block
  and on the root over ``mesh["dp"]``, ``matrixfsdp.Muon`` (fp32 Newton-Schulz);
* ``fsdp2_tp``: the same model and plan, then torch's FSDP2 ``fully_shard`` per block and
  on the root over ``mesh["dp"]``, ``torch.optim.AdamW`` (its step issues no collective,
  as ours).

Each system trains ``--warmup`` steps (lazy initialisation), then one measured step
(forward, backward, ``optimizer.step()``) during which every call a rank makes to
``torch.distributed``'s collectives is recorded (:func:`.record.recording`: the functions
are wrapped, as ``tests/runtime/test_most_loaded_rank.py`` does; FSDP2 and the runtime look them up at call
time), with its process group. Each call is charged by NCCL's algorithms, the model of
:mod:`matrixfsdp.layout.units` (and of the main
bench's critical-path table): ring all-gather / reduce-scatter ``(P-1)/P`` of the buffer per
rank, ring all-reduce twice that, pipelined broadcast / reduce the buffer once (the root
only sends or only receives), all-to-all what a rank sends to and receives from the others.

**Critical path.** A collective ends when its most loaded rank is done: each call costs
``max over its group's ranks of max(sent, received)`` (calls matched across ranks by process
group and order; a mismatch raises). Calls that run at once on different groups make one
**unit pass**, a unit's gather or its reduce, which ends when its most loaded rank has moved
its bytes: FSDP2's all-gather of a unit runs on every data-parallel group at once;
MatrixFSDP's gather of a unit is an all-to-all in each tp row plus the broadcasts and the
all-gather in each data-parallel group (the calls are tagged with their unit by
:func:`.record.tagging`). A pass costs the maximum over ranks of the summed costs of the
calls the rank takes part in; the step's critical bytes are the sum over passes, per kind
(``gather``, ``reduce``; ``other``: MatrixFSDP's one-byte-per-parameter gradient flags) and
in total. For FSDP2 this is exactly "per collective, its most loaded rank, summed".

DTensor's own collectives (the TP plan's all-reduces and all-gathers of activations, and
their gradients) go through ``torch.ops._c10d_functional``, not through the wrapped
functions, so neither system's count includes them: they are the same in both systems
(the same plan on the same model), and FSDP2's calls are checked to run on data-parallel
groups only. MatrixFSDP's own counters (``matrixfsdp.comm_stats``, per kind) are compared
with the recording per rank (``comm_stats_agrees``).

**The owner layout's floor.** For a unit (a block, or the root) let ``M`` be the bytes of
its tp-split Muon matrices (whole, logical) and ``E`` the bytes of its other parameters as
one tp rank holds them (tp-local). On a ``d x T`` grid (``d`` data-parallel, ``T`` tp):

* FSDP2 + TP all-gathers (reduce-scatters) the tp-local tensors over the ``d`` ranks of a
  data-parallel group: ``(M/T + E)(d-1)/d`` per rank per gather (reduce);
* the owner layout broadcasts (reduces) each ``1/T`` slice over the data-parallel group of
  its tp rank: ``M/T`` per rank (a pipelined broadcast moves the slice through every rank
  once), plus the one hop between the holder and its tp row: one all-to-all of the slices
  of the matrices owned by data-parallel row ``d``; with every row owning ``M/d`` and its
  ``T`` holders ``M/(dT)`` each, a holder sends ``(T-1)/T`` of its matrices,
  ``(T-1)M/(dT^2)``, and every rank receives as much. The even part ``E`` travels as FSDP2's.

So per gather (and per reduce) ``(M/T)(1 + (T-1)/(dT)) + E(d-1)/d`` against FSDP2 + TP's
``(M/T + E)(d-1)/d``: on the matrices, ``(dT + T - 1) / ((d-1) T)`` (2.5 at 2x2, 1.5 at
4x2; the 1-D floor ``d/(d-1)`` times ``1 + (T-1)/(dT)``). This **balanced** floor needs every
unit's matrices split evenly over the ``dT`` holders, which whole matrices of unequal sizes
rarely allow; :func:`owner_floor` also gives the floor for **whole** matrices (the best
placement of each unit's matrices, searched exhaustively: :func:`best_hop`) and the
**plan**'s prediction (the plan's placement under this byte flow), which the measured bytes
must equal (``as_designed``): the plan balances Newton-Schulz cost over the whole model,
not each unit's bytes, so it may sit above the whole-matrix floor. The number of times a
step gathers each unit is counted from the tagged passes (root once, each block twice: the
same as FSDP2, which ``fsdp2_as_modelled`` checks).

Outputs in ``--out`` (default ``runs/bench_tp``): ``tp.json`` (everything) and ``tp.md``
(the table, also printed).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import matrixfsdp as mf
from matrixfsdp.diagnosis.agree import all_gather_object
from matrixfsdp.train.launch import DefaultsHelp

from ..harness.record import parse_grids, record_step, run_grids
from .tp_model import SYSTEMS, Llama, LlamaConfig, TPBenchConfig, apply_tp
from .tp_report import render, summarise


# ---- one rank -------------------------------------------------------------------------------
def _build(system: str, cfg: TPBenchConfig, mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(cfg.seed)
    model = apply_tp(Llama(cfg.model), mesh["tp"], cfg.sequence_parallel)
    if system == "matrixfsdp":
        for block in model.layers:
            mf.fully_shard(block, mesh=mesh["dp"])
        mf.fully_shard(model, mesh=mesh["dp"])
        # fp32 NS: the step's time is not measured here, its bytes are (none)
        return model, mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=3e-3,
                                                   ns_dtype=torch.float32))
    from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _units(model: nn.Module) -> list[dict[str, Any]]:
    """Per unit of the plan: bytes of its tp-split Muon matrices (whole) and of its other
    parameters as one tp rank holds them."""
    plan = mf.plan_of(model)
    out = []
    for u, name in enumerate(plan.unit_names):
        split = [pl.spec for pl in plan.unit_params(u) if pl.spec.muon and pl.spec.tp > 1]
        rest = [pl.spec for pl in plan.unit_params(u) if not (pl.spec.muon and pl.spec.tp > 1)]
        out.append({"name": name, "matrix_bytes": sum(s.nbytes for s in split),
                    "even_bytes": sum(s.nbytes for s in rest), "matrices": len(split),
                    "tp_dim": sorted({s.tp_dim for s in split}),
                    # a reduce's chunks: one fp32 flag per parameter (which ranks had a gradient)
                    "flag_bytes": 4 * len(plan.unit_params(u))})
    return out


def _placements(model: nn.Module) -> list[dict[str, Any]]:
    plan = mf.plan_of(model)
    return [{"name": n, "unit_name": plan.unit_names[pl.spec.unit], "shape": list(pl.spec.shape),
             "bytes": pl.spec.nbytes, "dp_owner": pl.owner, "tp_holder": pl.tp_owner}
            for n, pl in plan.placements.items() if pl.spec.muon and pl.spec.tp > 1]


def measure_rank(cfg: TPBenchConfig, dp: int, tp: int) -> dict[str, Any]:
    """Both systems on this rank of a ``dp x tp`` world (the default process group): the
    calls of the measured step, and MatrixFSDP's own counters. Every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != dp * tp:
        raise ValueError(f"grid {dp}x{tp} needs {dp * tp} ranks, the world has "
                         f"{dist.get_world_size()}")
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(cfg.seed * 1000 + dp_rank)  # the same on a tp row
    data = [torch.randint(0, cfg.model.vocab, (cfg.batch, cfg.seq + 1), generator=g)
            for _ in range(cfg.warmup + 1)]
    rec: dict[str, Any] = {"rank": dist.get_rank(), "dp_rank": dp_rank,
                           "tp_rank": mesh["tp"].get_local_rank()}
    with warnings.catch_warnings():
        # FSDP2 warns that the root returns a view (the TP plan's replicated logits): harmless
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        for system in SYSTEMS:
            rec[system] = _measure_system(system, cfg, mesh, data)
    return rec


def _measure_system(system: str, cfg: TPBenchConfig, mesh, data: list[torch.Tensor]
                    ) -> dict[str, Any]:
    """One system on this rank: warm-up steps, then the recorded step."""
    dist.barrier()
    model, opt = _build(system, cfg, mesh)
    r = record_step(model, opt, data, system == "matrixfsdp")
    if system == "matrixfsdp":
        r["units"] = _units(model)
        r["placements"] = _placements(model)
    return r


def measure(cfg: TPBenchConfig, dp: int, tp: int) -> dict[str, Any]:
    """Both systems on every rank of the ``dp x tp`` world; the grid's results (every rank
    gets them)."""
    rec = measure_rank(cfg, dp, tp)
    return summarise(all_gather_object(rec), cfg, dp, tp)



# ---- command line ---------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> TPBenchConfig:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="matrixfsdp bench --tp", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelp)
    p.add_argument("--tp", action="store_true", help="this benchmark (with matrixfsdp bench)")
    p.add_argument("--grids", default="2x2,4x2",
                   help="comma list of DPxTP grids, each run on DP*TP local ranks (default 2x2,4x2)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--out", default="runs/bench_tp")
    a = p.parse_args(argv)
    grids = parse_grids(p, a.grids, ("DP", "TP"))
    model = LlamaConfig(a.d_model, a.heads, a.ffn, a.layers, a.vocab)
    for dp, tp in grids:
        for what, n in (("--heads", a.heads), ("--d-model", a.d_model), ("--ffn", a.ffn),
                        ("--vocab", a.vocab)):
            if n % tp:
                p.error(f"{what} {n} must be divisible by tp {tp}")
        if a.vocab % (dp * tp) or a.d_model % dp:
            p.error(f"--vocab {a.vocab} must be divisible by {dp * tp} and --d-model by {dp}")
    if a.d_model % a.heads or a.warmup < 1:
        p.error("--d-model must be divisible by --heads, and --warmup >= 1 (lazy init)")
    return TPBenchConfig(grids=grids, model=model, seq=a.seq, batch=a.batch, warmup=a.warmup,
                         sequence_parallel=a.sequence_parallel, out=a.out)


def main(argv: list[str] | None = None) -> int:
    return run_grids("tp", parse_args(argv), measure, render, __doc__,
                     lambda dp, tp: f"dp {dp} x tp {tp}")


if __name__ == "__main__":
    sys.exit(main())
