"""The layout search behind ``matrixfsdp plan``: every ``(replicate, shard, tp, pp)`` layout
of a world size (tp inside a node, activation checkpointing on and off), each planned by
the planner the runtime uses (per pipeline stage, the planner's own owners), costed
(memory per rank, critical-path bytes against FSDP2's, NS against its bound) and timed
(:mod:`~matrixfsdp.planning.steptime`). The advice is the layout with the lowest modelled
step time among those whose largest rank fits the device; none is chosen that does not fit
while one fits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .layout import layout_of, unit_layouts
from .layout_costs import (
    NSLoads,
    StageCosts,
    UnitsPart,
    lpt_max,
    ns_loads,
    stage_costs,
    step_bytes,
    units_part,
)
from .links import Links, Mesh, MeshCost
from .model_shapes import ModelShapes, Stage, activation_bytes, stages, tp_specs
from .planner import make_plan, with_even_params
from .steptime import Bucket, StepTime, Workload, distmuon, fsdp2_muon, ours, stage_work
from .traffic import Dtypes
from .types import Plan

KEYS = ("replicate", "shard", "tp", "pp", "largest_rank_bytes", "device_memory_bytes", "fits",
        "model_state_max_over_mean", "critical_bytes_vs_fsdp2", "owner_floor",
        "replicate_bytes_vs_fsdp2_hsdp", "ns_vs_bound", "step_seconds", "fsdp2_step_seconds")


@dataclass(frozen=True)
class Layout:
    replicate: int
    shard: int
    tp: int
    pp: int
    checkpointing: bool

    def label(self) -> str:
        ac = ", AC" if self.checkpointing else ""
        return f"{self.replicate} x {self.shard} x tp {self.tp} x pp {self.pp}{ac}"


@dataclass
class Evaluated:
    """One layout's costs: memory of its largest rank, bytes per step (critical path)
    against FSDP2's at the same layout, NS against its bound, step seconds (ours, FSDP2 +
    torch.optim.Muon, DistMuon)."""

    layout: Layout
    micro_batches: int
    state_max: float
    state_mean: float
    buffers: float
    activations: float
    device_memory: float
    critical_bytes: float
    fsdp2_critical_bytes: float
    floor_bytes: float  # the whole-matrix floor's critical bytes at this layout
    replicate_bytes: float
    fsdp2_replicate_bytes: float
    ns_max: float
    ns_bound: float
    step: StepTime
    fsdp2: StepTime
    distmuon: StepTime | None  # None: DistMuon cannot run this layout (tp > 1)
    fsdp2_memory: float = 0.0  # FSDP2 + torch.optim.Muon's largest rank
    distmuon_memory: float = 0.0  # DistMuon's: FSDP2's and the gathered matrices it owns
    launches: int = 0  # process-group calls per step of the slowest stage (data-parallel)
    fsdp2_launches: int = 0
    plan: Plan | None = field(default=None, repr=False)  # stage 0's plan

    @property
    def largest_rank_bytes(self) -> float:
        return self.state_max + self.buffers + self.activations

    @property
    def fits(self) -> bool:
        return self.largest_rank_bytes <= self.device_memory

    @property
    def owner_floor(self) -> float:
        """The least critical-path bytes any placement of whole matrices moves at this
        layout, over FSDP2's: at 1-D ``P/(P-1)`` on the matrices (a rank receives all of a
        unit's matrices, where an FSDP2 rank holds ``1/P``); with tp, each unit's largest
        matrix's ``(T-1)/T`` crosses the tp hop; with replicas, it is reduced to and
        broadcast from its owner replica whole."""
        return self.floor_bytes / self.fsdp2_critical_bytes if self.fsdp2_critical_bytes \
            else 1.0

    @property
    def distmuon_feasible(self) -> bool:
        return self.distmuon is not None

    @property
    def bytes_ratio(self) -> float:
        return self.critical_bytes / self.fsdp2_critical_bytes if self.fsdp2_critical_bytes \
            else 1.0

    def record(self) -> dict:
        """The ``--json`` keys (:data:`KEYS`) and a few more."""
        lay = self.layout
        rep = (self.replicate_bytes / self.fsdp2_replicate_bytes
               if self.fsdp2_replicate_bytes else None)
        out = {"replicate": lay.replicate, "shard": lay.shard, "tp": lay.tp, "pp": lay.pp,
               "largest_rank_bytes": round(self.largest_rank_bytes),
               "device_memory_bytes": round(self.device_memory), "fits": self.fits,
               "model_state_max_over_mean": self.state_max / self.state_mean
               if self.state_mean else 1.0,
               "critical_bytes_vs_fsdp2": self.bytes_ratio, "owner_floor": self.owner_floor,
               "replicate_bytes_vs_fsdp2_hsdp": rep,
               "ns_vs_bound": self.ns_max / self.ns_bound if self.ns_bound else 1.0,
               "step_seconds": self.step.total, "fsdp2_step_seconds": self.fsdp2.total}
        out.update({"activation_checkpointing": lay.checkpointing,
                    "micro_batches": self.micro_batches,
                    "distmuon_step_seconds": self.distmuon.total if self.distmuon else None,
                    "fsdp2_largest_rank_bytes": round(self.fsdp2_memory),
                    "fsdp2_fits": self.fsdp2_memory <= self.device_memory,
                    "distmuon_largest_rank_bytes": round(self.distmuon_memory)
                    if self.distmuon else None,
                    "distmuon_fits": self.distmuon_feasible
                    and self.distmuon_memory <= self.device_memory,
                    "model_state_bytes": round(self.state_max),
                    "buffer_bytes": round(self.buffers),
                    "activation_bytes": round(self.activations),
                    "critical_bytes": round(self.critical_bytes),
                    "fsdp2_critical_bytes": round(self.fsdp2_critical_bytes),
                    "breakdown": self.step.as_dict(), "fsdp2_breakdown": self.fsdp2.as_dict(),
                    "distmuon_breakdown": self.distmuon.as_dict() if self.distmuon else None,
                    "launches_per_step": self.launches, "fsdp2_launches_per_step":
                    self.fsdp2_launches})
        return out


@dataclass
class Search:
    """Every layout searched, the advice (None: no layout), and how long it took."""

    layouts: list[Evaluated]
    recommended: Evaluated | None
    seconds: float
    world_size: int
    global_batch: int

    @property
    def fitting(self) -> list[Evaluated]:
        return [e for e in self.layouts if e.fits]


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


@dataclass
class _StagePlan:
    stage: Stage
    plan: Plan
    costs: StageCosts
    distmuon: tuple[float, int]  # DistMuon's busiest rank: NS FLOPs, bytes of matrices owned
    buckets: list[Bucket]  # DistMuon's: one per block
    ns: NSLoads


def _plan_stages(stage_list: Sequence[Stage], dp: int, S: int, mesh: Mesh, mc: MeshCost,
                 d: Dtypes, ns_steps: int) -> list[_StagePlan]:
    """Every stage planned by the runtime's planner and costed. Stages with the same blocks
    share one plan of those blocks, to which each adds its root's even parameters
    (:func:`~matrixfsdp.planning.planner.with_even_params`: the same owners as planning the
    stage whole); a root holding Muon matrices is planned with its stage."""
    cores: dict[tuple, tuple[Plan, UnitsPart, NSLoads]] = {}
    lpt: dict[int, tuple[float, int]] = {}
    out = []
    for st in stage_list:
        root = [s for s in st.specs if s.unit == 0]
        if any(s.muon for s in root):
            plan = make_plan(st.specs, dp, st.unit_names, ns_steps, S)
            parts = [units_part(unit_layouts(plan, mesh.tp), mesh, mc, d)]
            ns = ns_loads(plan, mesh.tp)
        else:
            key = tuple((s.shape, s.unit, s.muon, s.tp, s.tp_dim) for s in st.specs if s.unit)
            if key not in cores:
                core = make_plan([s for s in st.specs if s.unit], dp, st.unit_names, ns_steps, S)
                cores[key] = (core, units_part(unit_layouts(core, mesh.tp)[1:], mesh, mc, d),
                              ns_loads(core, mesh.tp))
            core, blocks, ns = cores[key]
            plan = with_even_params(core, root)
            head = layout_of([plan.placements[s.name] for s in root], S, mesh.replicate, mesh.tp)
            parts = [units_part([head], mesh, mc, d), blocks]
        costs = stage_costs(plan, parts, mesh, d, mesh.pp > 1, ns)
        if id(ns) not in lpt:
            lpt[id(ns)] = lpt_max(ns.costs, [n * d.storage for n in ns.numel], S * mesh.tp)
        out.append(_StagePlan(st, plan, costs, lpt[id(ns)], _buckets(ns, d.storage), ns))
    return out


def _buckets(ns: NSLoads, storage: int) -> list[Bucket]:
    """DistMuon's buckets as the bench configures it: one per unit holding matrices."""
    by_unit: dict[int, list[int]] = {}
    for i, u in enumerate(ns.units):
        by_unit.setdefault(u, []).append(i)
    return [Bucket(tuple(ns.costs[i] for i in idx), tuple(ns.numel[i] * storage for i in idx))
            for _, idx in sorted(by_unit.items())]


def _launches(units, m: int, pp: int) -> int:
    """Data-parallel process-group calls per step of a stage's units (a busiest rank's)."""
    total = 0
    for i, u in enumerate(units):
        gathers, reduces = (1, 1) if pp > 1 else (m * (1 if i == 0 else 2), m)
        g, r, rr, rb = u.launches
        total += gathers * g + reduces * (r + rr) + rb
    return total


def _evaluate(shapes: ModelShapes, sps: list[_StagePlan], layout: Layout, m: int,
              links: Links, mc: MeshCost, w: Workload, d: Dtypes,
              device_memory: float) -> Evaluated:
    mesh = Mesh(layout.pp, layout.replicate, layout.shard, layout.tp)
    w = replace(w, checkpointing=layout.checkpointing)
    tokens = w.micro_batch * w.seq
    in_flight = min(m, layout.pp) if layout.pp > 1 else 1
    block_at = 0
    rows = []  # per stage: (costs, activations, step times, bytes, FSDP2's, floor)
    for sp in sps:
        blocks = range(block_at, block_at + sp.stage.blocks)
        block_at += sp.stage.blocks
        per_block = [2.0 * shapes.block_matmul[b] + 2.0 * w.seq * shapes.d_model for b in blocks]
        head = 2.0 * shapes.vocab * shapes.d_model if sp.stage.last else 0.0
        work = stage_work(per_block, head, tokens, shapes.d_model, mesh, mc, links, w)
        act = activation_bytes(shapes, blocks, tokens, layout.tp, layout.checkpointing,
                               in_flight, sp.stage.last)
        c = sp.costs
        steps = (ours(c, work, mesh, mc, w, m),
                 fsdp2_muon(c, work, mesh, mc, w, m, sp.ns.shapes, sp.plan.ns_steps),
                 distmuon(c, work, mesh, mc, w, m, sp.buckets))
        rows.append((c, act, steps, step_bytes(c.units, m, layout.pp),
                     step_bytes(c.fsdp2_units, m, layout.pp),
                     step_bytes(c.units, m, layout.pp, "floor_")))
    mem = max(rows, key=lambda r: r[0].state_max + r[0].buffers + r[1])
    slow = [None if any(r[2][k] is None for r in rows) else
            max((r[2][k] for r in rows), key=lambda s: s.total) for k in range(3)]
    mine, theirs = (max(rows, key=lambda r: r[k][0])[k] for k in (3, 4))
    floor = max(rows, key=lambda r: r[3][0])[5][0]
    fsdp2 = max(r[0].fsdp2_state + r[0].buffers + r[1] for r in rows)
    owned = max(sp.distmuon[1] for sp in sps)
    launches = max(_launches(sp.costs.units, m, layout.pp) for sp in sps)
    fsdp2_launches = max(_launches(sp.costs.fsdp2_units, m, layout.pp) for sp in sps)
    return Evaluated(layout, m, mem[0].state_max, sum(r[0].state_mean for r in rows) / len(rows),
                     mem[0].buffers, mem[1], device_memory, mine[0], theirs[0], floor, mine[1],
                     theirs[1], max(r[0].ns_max for r in rows), max(r[0].ns_bound for r in rows),
                     *slow, fsdp2, fsdp2 + 2 * owned, launches, fsdp2_launches,
                     plan=sps[0].plan)


def search(shapes: ModelShapes, world_size: int, device_memory: float, *,
           links: Links | None = None, workload: Workload | None = None,
           dtypes: Dtypes | None = None,
           global_batch: int | None = None, tp: Sequence[int] | None = None,
           pp: Sequence[int] | None = None, shard: Sequence[int] | None = None,
           checkpointing: Sequence[bool] = (False, True), ns_steps: int = 5,
           max_pp: int = 16) -> Search:
    """Every layout of ``world_size`` ranks (module docstring), evaluated; the advice.

    ``global_batch``: sequences per step (default ``world_size x workload.micro_batch``: one
    micro-batch per rank without tp and pp), so every layout trains the same tokens per step;
    a layout whose data-parallel size does not divide it is skipped. ``tp`` / ``pp`` /
    ``shard``: restrict the search to these sizes (default: tp up to a node, pp powers of two
    up to ``max_pp`` and the block count, every shard size)."""
    t0 = time.perf_counter()
    links, workload, dtypes = links or Links(), workload or Workload(), dtypes or Dtypes()
    G = global_batch or world_size * workload.micro_batch
    g = links.gpus_per_node
    tps = tp or [t for t in divisors(g) if world_size % t == 0]
    found: list[Evaluated] = []
    for T in tps:
        specs = tp_specs(shapes, T)
        if specs is None or world_size % T:
            continue
        pps = pp or [p for p in divisors(world_size // T)
                     if p <= min(max_pp, shapes.blocks) and p & (p - 1) == 0]
        for P in pps:
            if (world_size // T) % P or P > shapes.blocks:
                continue
            dp = world_size // (T * P)
            if G % (dp * workload.micro_batch):
                continue
            m = G // (dp * workload.micro_batch)
            stage_list = stages(specs, shapes.unit_names, P)
            for S in (shard or divisors(dp)):
                if dp % S:
                    continue
                mesh = Mesh(P, dp // S, S, T)
                mc = mesh.costs(links)
                sps = _plan_stages(stage_list, dp, S, mesh, mc, dtypes, ns_steps)
                for ac in checkpointing:
                    found.append(_evaluate(shapes, sps, Layout(dp // S, S, T, P, ac), m, links,
                                           mc, workload, dtypes, device_memory))
    fitting = [e for e in found if e.fits]
    pool = fitting or found
    best = min(pool, key=lambda e: (e.step.total if fitting else e.largest_rank_bytes,
                                    e.critical_bytes)) if pool else None
    return Search(found, best, time.perf_counter() - t0, world_size, G)
