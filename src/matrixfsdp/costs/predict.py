"""``matrixfsdp.plan_costs(model, mesh_shape)``: what sharding ``model`` on a mesh of that
shape would hold and move, per rank, before any rank exists.

The model may live on the meta device. It is planned exactly as ``fully_shard`` plans it
(same collector, same planner: :func:`~matrixfsdp.layout.planner.plan_module`) and the
runtime's layout and counters are redone over the plan
(:mod:`~matrixfsdp.layout.traffic`), so the prediction equals, to the byte, what
``matrixfsdp.comm_stats(model).summary()`` reads on each rank after one training step and
what each rank holds (``tests/advisor/test_plan_model.py`` checks it at 8 ranks, 1-D and HSDP).

:func:`matrixfsdp.costs.summary.plan_summary` (a :class:`~matrixfsdp.layout.types.Plan`
in, max / mean summaries out: the same plan costed as ``matrixfsdp plan`` costs a layout) is
where this one's ``summary`` comes from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..layout.planner import plan_module
from ..layout.traffic import Dtypes, Held, predict_comm, predict_launches, rank_held
from ..layout.types import MuonFilter, Plan
from ..layout.units import unit_layouts
from .summary import PlanCosts, plan_summary


@dataclass
class PlanPrediction:
    """Per world rank (``replica * shard_size + shard_rank``): ``comm[w]`` is what
    ``comm_stats(model).summary()`` reads on rank ``w`` after one steady training step
    (collective kind -> calls, payload / sent / received / critical / mean bytes);
    ``held[w]`` the bytes it holds after an optimizer step (segments, shards, gradients,
    optimizer state). ``launches[w]``: its ``CommStats.launches`` (per phase). ``summary``: the
    plan's max / mean costs (model state, buffers, NS, bytes per step against FSDP2's)."""

    plan: Plan
    comm: list[dict[str, dict[str, int]]]
    held: list[Held]
    summary: PlanCosts
    launches: list[dict[str, int]]

    def critical_bytes(self, rank: int) -> int:
        """Bytes on the critical path of rank ``rank``'s collectives over the step: each
        collective's most loaded rank, summed (``CommStats.total("critical_bytes")``)."""
        return sum(c["critical_bytes"] for c in self.comm[rank].values())


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` is usually called on before the root: every entry of
    every ``nn.ModuleList`` (the transformer blocks), outermost lists only."""
    units: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside:
            continue
        if isinstance(m, nn.ModuleList):
            units += list(m)
            inside |= {id(x) for block in m for x in block.modules()}
    return units


def _itemsize(dtype: torch.dtype | None, default: int) -> int:
    return default if dtype is None else torch.empty((), dtype=dtype).element_size()


def plan_costs(model: nn.Module, mesh_shape: Sequence[int] | int, *,
               units: Sequence[nn.Module] | None = None, muon_filter: MuonFilter | None = None,
               ns_steps: int = 5, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, micro_batches: int = 1,
               coalesced: bool = True) -> PlanPrediction:
    """Plan ``model`` for a mesh of shape ``mesh_shape`` (``(world,)`` or ``world``: 1-D;
    ``(replicate, shard)``: HSDP) and predict, per rank, the collectives of one training
    step and the bytes held.

    ``units``: the modules ``fully_shard`` will be called on before the root (default
    :func:`default_units`); ``muon_filter`` and ``ns_steps`` as in ``fully_shard`` and
    ``Muon``; ``param_dtype`` / ``reduce_dtype`` as in ``MixedPrecisionPolicy`` (default: the
    parameters' dtype); ``micro_batches``: forward/backward passes per optimizer step, each
    reducing (the runtime's default without ``set_requires_gradient_sync(False)``);
    ``coalesced``: the process groups run a unit's ops of one direction as one launch
    (NCCL), False for gloo's one launch per op.
    Tensor-parallel models are costed by ``matrixfsdp plan``'s layout search only."""
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    if len(shape) not in (1, 2) or any(int(n) < 1 for n in shape):
        raise ValueError(f"plan_costs: mesh_shape must be (world,) or (replicate, shard) with "
                         f"positive sizes, got {mesh_shape!r}")
    world = shape[0] * (shape[1] if len(shape) == 2 else 1)
    shard = shape[-1]
    units = default_units(model) if units is None else list(units)
    plan = plan_module(model, units, world, muon_filter, ns_steps, shard)
    first = next(iter(plan.placements.values()), None)
    storage = first.spec.itemsize if first is not None else 4
    dtypes = Dtypes(storage, _itemsize(param_dtype, storage), _itemsize(reduce_dtype, storage))
    layouts = unit_layouts(plan)
    held = [rank_held(layouts, w, 0, dtypes) for w in range(world)]
    return PlanPrediction(plan, predict_comm(plan, dtypes, micro_batches, coalesced), held,
                          plan_summary(plan, dtypes, micro_batches),
                          predict_launches(plan, dtypes, micro_batches, coalesced))
