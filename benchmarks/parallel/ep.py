"""Expert parallelism: the most loaded rank's bytes, MatrixFSDP against FSDP2 + EP.

``matrixfsdp bench --ep`` (or ``python -m benchmarks.parallel.ep``) runs, for every grid of
``--grids`` (default ``2x2,4x2``: dp_shard_mod_ep 2 x ep 2 on 4 ranks, 4 x 2 on 8), on local
gloo ranks, in the same run and on the same data, torchtitan's expert-parallel layout of a
small MoE (:class:`.ep_model.MoEModel`: GroupedExperts ``w1/w2/w3 (E, H, D)`` made DTensors
``Shard(0)`` over ``mesh["ep"]`` by :func:`.ep_model.apply_ep`), sharded as torchtitan does:
every block's experts over ``mesh["dp_shard_mod_ep"]`` with
``set_gradient_divide_factor(dp x ep)``, the blocks and the root over the flattened dp x ep
mesh. The systems:

* ``matrixfsdp``: ``matrixfsdp.fully_shard`` so, ``matrixfsdp.Muon`` (fp32 Newton-Schulz;
  every expert a matrix, whole on one rank of its experts' group);
* ``fsdp2_ep``: torch's FSDP2 ``fully_shard`` with the same meshes and calls,
  ``torch.optim.AdamW`` (its step issues no collective, as ours; torch's Muon takes no
  3-D expert stack).

Every call to ``torch.distributed``'s collectives in one step after ``--warmup`` steps is
recorded and charged as in ``bench --tp`` (:mod:`.tp`, :mod:`.record`): each call costs its
most loaded rank's ``max(sent, received)`` under NCCL's algorithms, calls that run at once
on different groups (an experts' unit on every ep rank's group) make one unit pass, and
the step's critical bytes are the sum of its passes' costs, per kind and per domain (the
experts' units over ``d = dp_shard_mod_ep`` ranks, the dense units over ``d x ep``). The
MoE's token dispatch over ep (all-gather and reduce-scatter of activations, torch's
functional collectives through ``torch.ops._c10d_functional``) is not wrapped and is the
same in both systems: it is left out of both.

**The owner floor.** Each domain is a 1-D layout: a unit over ``P`` ranks with Muon matrices
of ``M`` bytes (an experts' unit: the ep rank's local stacks) and other parameters of ``E``
bytes moves per gather (and per reduce) ``M + E(P-1)/P`` under the owner layout (every rank
relays or receives each whole matrix once, wherever it is placed, the pipelined broadcast's
cost) against FSDP2's ``(M + E)(P-1)/P``: ``P/(P-1)`` on the matrices. An experts' unit
holds whole experts split evenly over its ``d`` ranks, which travel in its even all-gather /
reduce-scatter at FSDP2's bytes; the dense units' matrices at up to ``dP/(dP-1)`` with
``P = d x ep``. The floor is the same for every placement, so the measured bytes must equal
the runtime's own layout arithmetic (``as_designed``) and stay within it (``within_floor``).

Outputs in ``--out`` (default ``runs/bench_ep``): ``ep.json`` (everything) and ``ep.md``
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
from matrixfsdp._compat import flatten
from matrixfsdp.diagnosis.agree import all_gather_object
from matrixfsdp.layout.units import calls
from matrixfsdp.train.launch import DefaultsHelp

from ..harness.record import parse_grids, record_step, run_grids
from .ep_model import SYSTEMS, EPBenchConfig, MoEConfig, apply_ep, build_moe
from .ep_report import render, summarise


# ---- one rank -------------------------------------------------------------------------------
def _build(system: str, cfg: EPBenchConfig, mesh, dense) -> tuple[nn.Module, torch.optim.Optimizer]:
    """torchtitan's layout: experts over ``dp_shard_mod_ep`` (divided by the whole dp
    degree), blocks and root over dp x ep; ours with our Muon, FSDP2 with AdamW."""
    model = apply_ep(build_moe(cfg.seed, cfg.model), mesh["ep"])
    if system == "matrixfsdp":
        shard = mf.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard
    for block in model.layers:
        experts = shard(block.moe.experts, mesh=mesh["dp_shard_mod_ep"])
        experts.set_gradient_divide_factor(dense.size())
        if system != "matrixfsdp" and dist.get_backend() == "gloo":
            # gloo has no PREMUL_SUM (FSDP2's reduce-scatter op for a divide factor): sum,
            # then divide, FSDP2's own fallback; the same bytes
            experts.set_force_sum_reduction_for_comms(True)
        shard(block, mesh=dense)
    shard(model, mesh=dense)
    if system == "matrixfsdp":
        # fp32 NS: the step's time is not measured here, its bytes are (none)
        return model, mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=3e-3,
                                                   ns_dtype=torch.float32))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _units(model: nn.Module) -> list[dict[str, Any]]:
    """Per unit of the plan: the ranks it is sharded over, the bytes of its Muon matrices
    and of its other parameters (as this rank's domain holds them: an experts' unit, the ep
    rank's local stacks)."""
    plan = mf.plan_of(model)
    units = mf.get_root(model).units
    out = []
    for u, name in enumerate(plan.unit_names):
        params = plan.unit_params(u)
        muon = [pl.spec for pl in params if pl.spec.muon]
        rest = [pl.spec for pl in params if not pl.spec.muon]
        # what the runtime moves for it, as the planner counts it (the unit's own layout)
        lay = units[u].layout
        red = lay.reduce_layout((True,) * len(lay.placements))[0]
        moved = {kind: sum(c.load(one, 0, 4).critical for c in calls(one, kind == "reduce"))
                 for kind, one in (("gather", lay), ("reduce", red))}
        out.append({"name": name, "ranks": len(params[0].row_ranges) if params else 0,
                    "experts": any(s.is_experts for s in muon),
                    "matrix_bytes": sum(s.nbytes for s in muon),
                    "even_bytes": sum(s.nbytes for s in rest),
                    "matrices": sum(s.matrices for s in muon),
                    # a reduce's chunks: one fp32 flag per parameter (which ranks had a gradient)
                    "flag_bytes": 4 * len(params),
                    "gather_bytes": moved["gather"], "reduce_bytes": moved["reduce"]})
    return out


def _grid_mesh(d: int, ep: int):
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != d * ep:
        raise ValueError(f"grid {d}x{ep} needs {d * ep} ranks, the world has "
                         f"{dist.get_world_size()}")
    mesh = init_device_mesh("cpu", (d, ep), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    return mesh, flatten(mesh["dp_shard_mod_ep", "ep"], "dp")


def measure_rank(cfg: EPBenchConfig, d: int, ep: int) -> dict[str, Any]:
    """Both systems on this rank of a ``d x ep`` world (the default process group): the
    calls of the measured step, and MatrixFSDP's own counters. Every rank calls it."""
    mesh, dense = _grid_mesh(d, ep)
    g = torch.Generator().manual_seed(cfg.seed * 1000 + dense.get_local_rank())
    data = [torch.randint(0, cfg.model.vocab, (cfg.batch, cfg.seq + 1), generator=g)
            for _ in range(cfg.warmup + 1)]
    rec: dict[str, Any] = {"rank": dist.get_rank(), "ep_rank": mesh["ep"].get_local_rank(),
                           "experts_group": dist.get_process_group_ranks(
                               mesh["dp_shard_mod_ep"].get_group()),
                           "dense_group": dist.get_process_group_ranks(dense.get_group())}
    with warnings.catch_warnings():
        # harmless here: FSDP2 on the experts' einsum output (a view), and the deprecated
        # names of the functional collectives the token dispatch uses
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        warnings.filterwarnings("ignore", category=FutureWarning, message=r".*_autograd` is "
                                "deprecated")
        for system in SYSTEMS:
            dist.barrier()
            model, opt = _build(system, cfg, mesh, dense)
            rec[system] = record_step(model, opt, data, system == "matrixfsdp")
            if system == "matrixfsdp":
                rec[system]["units"] = _units(model)
    return rec


def measure(cfg: EPBenchConfig, d: int, ep: int) -> dict[str, Any]:
    """Both systems on every rank of the ``d x ep`` world; the grid's results (every rank
    gets them)."""
    rec = measure_rank(cfg, d, ep)
    return summarise(all_gather_object(rec), d, ep)


# ---- command line ---------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> EPBenchConfig:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="matrixfsdp bench --ep", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelp)
    p.add_argument("--ep", action="store_true", help="this benchmark (with matrixfsdp bench)")
    p.add_argument("--grids", default="2x2,4x2",
                   help="comma list of DxEP grids (dp_shard_mod_ep x ep), each run on D*EP local "
                        "ranks (default 2x2,4x2)")
    default = EPBenchConfig().model
    for flag, value in (("--layers", default.layers), ("--d-model", default.d_model),
                        ("--hidden", default.hidden), ("--experts", default.experts),
                        ("--vocab", default.vocab), ("--seq", 64), ("--batch", 2),
                        ("--warmup", 1)):
        p.add_argument(flag, type=int, default=value)
    p.add_argument("--out", default="runs/bench_ep")
    a = p.parse_args(argv)
    grids = parse_grids(p, a.grids, ("D", "EP"))
    for d, ep in grids:  # every tensor split evenly (no padding): the floor is exact
        for what, n in (("--experts", a.experts), ("--vocab", a.vocab), ("--d-model", a.d_model)):
            if n % (d * ep):
                p.error(f"{what} {n} must be divisible by {d * ep} (grid {d}x{ep})")
    if a.warmup < 1 or min(a.layers, a.hidden, a.seq, a.batch) < 1:
        p.error("--warmup (lazy init), --layers, --hidden, --seq, --batch must be >= 1")
    model = MoEConfig(a.d_model, a.hidden, a.experts, a.vocab, a.layers)
    return EPBenchConfig(grids=grids, model=model, seq=a.seq, batch=a.batch, warmup=a.warmup,
                         out=a.out)


def main(argv: list[str] | None = None) -> int:
    return run_grids("ep", parse_args(argv), measure, render, __doc__,
                     lambda d, ep: f"dp_shard_mod_ep {d} x ep {ep}")


if __name__ == "__main__":
    sys.exit(main())
