"""What a plan costs, summed up over its ranks: the largest and the mean rank's model state,
the transient buffers, Newton-Schulz FLOPs, and the bytes of a training step on the critical
path against FSDP2's (``matrixfsdp.plan_costs(model, mesh_shape).summary``).

No model of its own: the plan is costed as ``matrixfsdp plan`` costs one stage of a layout
(:mod:`~matrixfsdp.costs.layout_costs`). The collectives are the ops the runtime issues
(:func:`~matrixfsdp.layout.units.calls`, charged by
:meth:`~matrixfsdp.layout.units.Call.load`); the model state is
:func:`~matrixfsdp.layout.traffic.rank_held`'s for every rank (segments with their
padding and alignment, the gradient buffers, Muon momentum and AdamW's two moments). The
per-rank figures themselves are ``plan_costs``' ``comm`` and ``held``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout.traffic import Dtypes
from ..layout.types import Plan
from ..layout.units import unit_layouts
from .layout_costs import stage_costs, units_part
from .links import Links, Mesh
from .ns_costs import ns_loads
from .passes import step_bytes


@dataclass(frozen=True)
class Spread:
    """A per-rank quantity: its largest value and its mean over the world ranks."""

    max: float
    mean: float

    @property
    def ratio(self) -> float:
        return self.max / self.mean if self.mean else 1.0



@dataclass
class StepBytes:
    """Bytes of one optimizer step (its micro-batches) on the critical path, each
    collective's most loaded rank summed: this plan's and FSDP2's (every parameter padded
    to ``ceil(rows / shard)`` rows, one all-gather / reduce-scatter per unit; HSDP: its
    padded shard all-reduced), and the replicate dim's share of each."""

    ours: float
    fsdp2: float
    ours_replicate: float = 0.0
    fsdp2_replicate: float = 0.0

    @property
    def ratio(self) -> float:
        return self.ours / self.fsdp2 if self.fsdp2 else 1.0


@dataclass
class PlanCosts:
    """Per world rank: model state (bytes), NS FLOPs; the transient buffers; per step:
    bytes on the critical path."""

    world_size: int
    shard_size: int
    state: Spread  # storage segments + gradient buffers + optimizer state, per rank
    fsdp2_state: float  # FSDP2's model state per rank (padded shards: every rank alike)
    buffers: float  # gathered units, their unsharded gradients, the reduce buffers
    ns: Spread
    ns_bound: float  # max(largest matrix, total / world): what no assignment beats
    step: StepBytes
    bare_shard_ranks: int  # shard ranks that hold no Muon matrix or expert

    @property
    def peak(self) -> float:
        """The largest rank's model state plus the buffers (no activations)."""
        return self.state.max + self.buffers

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size


def plan_summary(plan: Plan, dtypes: Dtypes | None = None, micro_batches: int = 1) -> PlanCosts:
    """:class:`PlanCosts` of ``plan`` (1-D or HSDP, no tensor parallelism) with ``dtypes``'
    bytes per element (default: 4 each) and ``micro_batches`` forward/backward passes per
    step, each reducing."""
    if any(pl.spec.tp > 1 for pl in plan.placements.values()):
        raise NotImplementedError("plan_summary: tensor-parallel plans are costed by the layout "
                                  "search (matrixfsdp.advisor.search)")
    dtypes = dtypes or Dtypes()
    S, R = plan.shard_size, plan.replicas
    mesh = Mesh(1, R, S, 1)
    layouts = unit_layouts(plan)
    part = units_part(layouts, mesh, mesh.costs(Links()), dtypes)  # seconds: not read here
    c = stage_costs(plan, [part], mesh, dtypes, False, ns_loads(plan, 1))
    ours, ours_rep = step_bytes(c.units, micro_batches)
    fsdp2, fsdp2_rep = step_bytes(c.fsdp2_units, micro_batches)
    holders = {pc.rank for lay in layouts for pc in lay.pieces}
    return PlanCosts(plan.world_size, S, Spread(c.state_max, c.state_mean), c.fsdp2_state,
                     c.buffers, Spread(c.ns_max, sum(plan.rank_cost) / plan.world_size), c.ns_bound,
                     StepBytes(ours, fsdp2, ours_rep, fsdp2_rep), S - len(holders))
