"""One pipeline stage of one layout, costed from its plan: model state per rank, gather and
reduce buffers, NS per rank, and every unit's collectives (bytes on the critical path and
seconds on the links), this library's and FSDP2's.

Model state per rank is :func:`~matrixfsdp.layout.traffic.rank_held`'s (segments, the
gradient buffers the shards' ``.grad`` keep alive, Muon momentum and AdamW moments), computed
for all ranks at once from difference arrays over the shard ranks plus the ranks that hold
pieces, so a 16384-rank plan costs milliseconds. Each unit's collectives are costed in
:mod:`~matrixfsdp.costs.comm_costs`, the plan's Newton-Schulz in
:mod:`~matrixfsdp.costs.ns_costs`; :mod:`~matrixfsdp.costs.passes` counts a step's
passes over the units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..layout.traffic import Dtypes, reduce_layouts
from ..layout.types import Plan
from ..layout.units import UnitLayout
from .comm_costs import UnitComm, fsdp2_unit_comm, unit_comm
from .links import Mesh, MeshCost
from .ns_costs import NSLoads
from .state_costs import StateParts


@dataclass
class StageCosts:
    """A stage's costs per rank: model state (max, mean), buffers, NS, each unit's comm
    (ours and FSDP2's), and the matrices' NS for the baselines."""

    state_max: float
    state_mean: float
    buffers: float
    ns_max: float
    ns_bound: float
    ns_total: float  # every matrix once
    units: list[UnitComm]
    fsdp2_units: list[UnitComm]
    matrix_numel: list[int]  # per Muon matrix: its elements (whole)
    fsdp2_state: float  # FSDP2's model state per rank (padded shards: every rank alike)
    adamw_bytes: float  # bytes AdamW's element-wise update touches per step (7 per element)
    muon_bytes: float  # bytes Muon's momentum and update touch on the busiest rank (5 each)
    ns_seconds: float | None = None  # the busiest GPU's NS, its tp group's all-reduces in
    root_numel: int = 0  # elements of the root unit unsharded (its gradients kept unreduced)
    first_numel: int = 0  # the first block's, unsharded
    first_gathered: float = 0.0  # bytes of the first block's gather buffers


def _gathered(u: UnitLayout) -> int:
    """Elements of a unit's buffers while it is gathered."""
    return u.copied_numel + (u.gathered_numel if u.keeps_gathered else 0)


def _buffers(layouts: Sequence[UnitLayout], d: Dtypes, kept: bool) -> float:
    """Transient bytes: gathered units (param dtype: the gathered chunks and the copied
    rows), their unsharded gradients, the reduce buffers (two reduces in flight, reduce
    dtype). ``kept`` (pipeline stages): every unit stays gathered over the step and keeps
    its unsharded gradients (no-sync)."""
    sizes = [_gathered(u) for u in layouts]
    if not sizes:
        return 0.0
    block = max(sizes[1:], default=0)
    if kept:
        return float(sum(sizes) * (d.gather + d.reduce) + block * (d.gather + 2 * d.reduce))
    return float(sizes[0] * d.gather + 3 * block * d.gather + 2 * block * d.reduce)


@dataclass
class UnitsPart:
    """Some units of a stage, costed once: their layouts, collectives (ours, FSDP2's) and
    model-state parts. A stage is the sum of its parts (:func:`stage_costs`)."""

    layouts: list[UnitLayout]
    comm: list[UnitComm]
    fsdp2: list[UnitComm]
    state: StateParts


def units_part(layouts: Sequence[UnitLayout], mesh: Mesh, mc: MeshCost, d: Dtypes) -> UnitsPart:
    state = StateParts(mesh.shard)
    reds = reduce_layouts(layouts)
    for u, red in zip(layouts, reds):
        state.add(u, red, mesh.tp, d.storage)
    return UnitsPart(list(layouts), [unit_comm(u, red, mesh, mc, d) for u, red in zip(layouts, reds)],
                     [fsdp2_unit_comm(u, mesh, mc, d) for u in layouts], state)


def stage_costs(plan: Plan, parts: Sequence[UnitsPart], mesh: Mesh, d: Dtypes,
                kept: bool, ns: NSLoads) -> StageCosts:
    """A stage's costs from its plan, its units' parts (the root's first) and its NS."""
    T = mesh.tp
    state = parts[0].state
    for p in parts[1:]:
        state = state.merged(p.state)
    state_max, state_mean = state.spread(mesh.replicate, T)
    layouts = [u for p in parts for u in p.layouts]
    even = sum(u.even_numel for u in layouts)
    busiest = max(plan.rank_bytes, default=0) / d.storage - even
    return StageCosts(state_max, state_mean, _buffers(layouts, d, kept), ns.max, ns.bound,
                      ns.total, [c for p in parts for c in p.comm],
                      [c for p in parts for c in p.fsdp2], ns.numel,
                      sum(c.state_bytes for p in parts for c in p.fsdp2),
                      7.0 * even * d.storage, 5.0 * max(busiest, 0) / max(T, 1) * d.storage,
                      ns.seconds, layouts[0].numel if layouts else 0,
                      layouts[1].numel if len(layouts) > 1 else 0,
                      _gathered(layouts[1]) * d.gather if len(layouts) > 1 else 0.0)
