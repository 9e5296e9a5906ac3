"""The layout search behind ``matrixfsdp plan``: every ``(replicate, shard, tp, pp)`` layout
of a world size (tp inside a node, activation checkpointing on and off), each planned by
the planner the runtime uses (per pipeline stage, the planner's own owners), costed
(memory per rank, critical-path bytes against FSDP2's, NS against its bound) and timed
(:mod:`~matrixfsdp.advisor.steptime`). The advice is the layout with the lowest modelled
step time among those whose largest rank fits the device; none is chosen that does not fit
while one fits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..layout.planner import make_plan, with_even_params
from ..layout.traffic import Dtypes
from ..layout.types import Plan
from ..layout.units import layout_of, unit_layouts
from .layout_costs import (
    NSLoads,
    StageCosts,
    UnitsPart,
    ns_loads,
    stage_costs,
    step_bytes,
    units_part,
)
from .links import Links, Mesh, MeshCost
from .model_shapes import ModelShapes, Stage, activation_bytes, stages, tp_specs
from .peers import DistMuonBest, distmuon, distmuon_best, dtensor_muon_step, fsdp2_muon
from .steptime import ONE_STAGE, SCHEDULES, PipelineSchedule, StepTime, Workload, ours, stage_work

LLAMA3_TOKENS = 2 ** 24  # Llama 3's global batch at its final stage: 16M tokens per step

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
    schedule: PipelineSchedule = ONE_STAGE

    def label(self) -> str:
        ac = ", AC" if self.checkpointing else ""
        sched = f" ({self.schedule.name})" if self.pp > 1 else ""
        return f"{self.replicate} x {self.shard} x tp {self.tp} x pp {self.pp}{sched}{ac}"


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
    distmuon: StepTime | None  # None: DistMuon refuses this layout (tp > 1, pp > 1)
    fsdp2_memory: float = 0.0  # FSDP2 + torch.optim.Muon's largest rank
    distmuon_memory: float = 0.0  # DistMuon's: FSDP2's and its two bucket slots' buffers
    launches: int = 0  # process-group launches per step of the slowest stage (data-parallel)
    fsdp2_launches: int = 0
    ops: int = 0  # the NCCL ops those launches hold
    distmuon_blocks: int = 0  # DistMuon's fastest bucket size (blocks per bucket)
    busiest_matrix: tuple[str, tuple[int, int], float] = ("", (0, 0), 0.0)  # NS FLOPs
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
               "schedule": lay.schedule.name if lay.pp > 1 else None,
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
                    self.fsdp2_launches, "ops_per_step": self.ops,
                    "distmuon_blocks_per_bucket": self.distmuon_blocks or None,
                    "busiest_matrix": {"name": self.busiest_matrix[0],
                                       "shape": list(self.busiest_matrix[1]),
                                       "ns_flops": self.busiest_matrix[2]}})
        return out


@dataclass
class Search:
    """Every layout searched, the advice (None: no layout), and how long it took."""

    layouts: list[Evaluated]
    recommended: Evaluated | None
    seconds: float
    world_size: int
    global_batch: int
    floor: float = 0.0  # the compute floor: the step's model FLOPs over every rank's rate

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
    ns: NSLoads
    distmuon: DistMuonBest | None = None
    torch_muon: float = 0.0  # FSDP2 + torch.optim.Muon's optimizer seconds at this mesh


def _plan_stages(stage_list: Sequence[Stage], dp: int, S: int, mesh: Mesh, mc: MeshCost,
                 d: Dtypes, ns_steps: int, w: Workload) -> list[_StagePlan]:
    """Every stage planned by the runtime's planner and costed. Stages with the same blocks
    share one plan of those blocks, to which each adds its root's even parameters
    (:func:`~matrixfsdp.layout.planner.with_even_params`: the same owners as planning the
    stage whole); a root holding Muon matrices is planned with its stage."""
    cores: dict[tuple, tuple[Plan, UnitsPart, NSLoads]] = {}
    dm: dict[int, tuple[DistMuonBest | None, float]] = {}
    out = []
    for st in stage_list:
        root = [s for s in st.specs if s.unit == 0]
        if any(s.muon for s in root):
            plan = make_plan(st.specs, dp, st.unit_names, ns_steps, S, tp_ownership="rank")
            parts = [units_part(unit_layouts(plan, mesh.tp), mesh, mc, d)]
            ns = ns_loads(plan, mesh.tp)
        else:
            key = tuple((s.shape, s.unit, s.muon, s.tp, s.tp_dim) for s in st.specs if s.unit)
            if key not in cores:
                core = make_plan([s for s in st.specs if s.unit], dp, st.unit_names, ns_steps, S,
                                 tp_ownership="rank")
                cores[key] = (core, units_part(unit_layouts(core, mesh.tp)[1:], mesh, mc, d),
                              ns_loads(core, mesh.tp))
            core, blocks, ns = cores[key]
            plan = with_even_params(core, root)
            head = layout_of([plan.placements[s.name] for s in root], S, mesh.replicate, mesh.tp)
            parts = [units_part([head], mesh, mc, d), blocks]
        costs = stage_costs(plan, parts, mesh, d, mesh.pp > 1, ns)
        if id(ns) not in dm:
            dm[id(ns)] = (distmuon_best(ns, d.storage, mesh, mc, w),
                          dtensor_muon_step(ns, ns_steps, mesh, mc, w))
        out.append(_StagePlan(st, plan, costs, ns, *dm[id(ns)]))
    return out


def _launches(units, m: int, pp: int, which: str = "launches") -> int:
    """Data-parallel launches (or NCCL ops) per step of a stage's units (a busiest rank's)."""
    total = 0
    for i, u in enumerate(units):
        gathers, reduces = (1, 1) if pp > 1 else (m * (1 if i == 0 else 2), m)
        g, r, rr, rb = getattr(u, which)
        total += gathers * g + reduces * (r + rr) + rb
    return total


def _evaluate(shapes: ModelShapes, sps: list[_StagePlan], layout: Layout, m: int,
              links: Links, mc: MeshCost, w: Workload, d: Dtypes,
              device_memory: float) -> Evaluated:
    mesh = Mesh(layout.pp, layout.replicate, layout.shard, layout.tp)
    w = replace(w, checkpointing=layout.checkpointing)
    sched = layout.schedule
    tokens = w.micro_batch * w.seq
    in_flight = sched.in_flight(m, layout.pp)
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
        steps = (ours(c, work, mesh, mc, w, m, sched),
                 fsdp2_muon(c, work, mesh, mc, w, m, sp.torch_muon, sched),
                 distmuon(c, work, mesh, mc, w, m, sp.distmuon))
        rows.append((c, act, steps, step_bytes(c.units, m, layout.pp),
                     step_bytes(c.fsdp2_units, m, layout.pp),
                     step_bytes(c.units, m, layout.pp, "floor_")))
    mem = max(rows, key=lambda r: r[0].state_max + r[0].buffers + r[1])
    slow = [None if any(r[2][k] is None for r in rows) else
            max((r[2][k] for r in rows), key=lambda s: s.total) for k in range(3)]
    mine, theirs = (max(rows, key=lambda r: r[k][0])[k] for k in (3, 4))
    floor = max(rows, key=lambda r: r[3][0])[5][0]
    fsdp2 = max(r[0].fsdp2_state + r[0].buffers + r[1] for r in rows)
    dm = sps[0].distmuon
    busiest = max(sps, key=lambda sp: sp.ns.max).ns
    return Evaluated(layout, m, mem[0].state_max, sum(r[0].state_mean for r in rows) / len(rows),
                     mem[0].buffers, mem[1], device_memory, mine[0], theirs[0], floor, mine[1],
                     theirs[1], max(r[0].ns_max for r in rows), max(r[0].ns_bound for r in rows),
                     *slow, fsdp2, fsdp2 + (dm.buffers if dm else 0.0),
                     max(_launches(sp.costs.units, m, layout.pp) for sp in sps),
                     max(_launches(sp.costs.fsdp2_units, m, layout.pp) for sp in sps),
                     max(_launches(sp.costs.units, m, layout.pp, "ops") for sp in sps),
                     dm.blocks if dm else 0, busiest.busiest, plan=sps[0].plan)


def compute_floor(shapes: ModelShapes, seq: int, tokens: int, world_size: int,
                  tflops: float) -> float:
    """Seconds of a step's model FLOPs (forward, and backward twice it; no recompute, no
    communication) spread evenly over every rank at ``tflops``: what no layout beats."""
    blocks, head = shapes.forward_flops_per_token(seq)
    return 3.0 * (blocks + head) * tokens / (world_size * tflops)


def cost_path(shapes: ModelShapes, replicate: int, shard: int, tp: int = 1, pp: int = 1, *,
              dtypes: Dtypes | None = None, links: Links | None = None, ns_steps: int = 5
              ) -> list[tuple[Stage, Plan, StageCosts]]:
    """The search's costs of one layout, stage by stage (each stage's plan and
    :class:`~matrixfsdp.advisor.layout_costs.StageCosts`, its units' collectives with them:
    :func:`~matrixfsdp.advisor.layout_costs.rank_counts` reads them rank by rank)."""
    specs = tp_specs(shapes, tp)
    if specs is None:
        raise ValueError(f"cost_path: the model does not split over tp {tp}")
    links, dtypes = links or Links(), dtypes or Dtypes()
    mesh = Mesh(pp, replicate, shard, tp)
    sps = _plan_stages(stages(specs, shapes.unit_names, pp), replicate * shard, shard, mesh,
                       mesh.costs(links), dtypes, ns_steps, Workload())
    return [(sp.stage, sp.plan, sp.costs) for sp in sps]


def default_global_batch(seq: int, tokens: int = LLAMA3_TOKENS) -> int:
    """Sequences per step for ``tokens`` per step (default Llama 3's 16M), at least one."""
    return max(1, tokens // seq)


def search(shapes: ModelShapes, world_size: int, device_memory: float, *,
           links: Links | None = None, workload: Workload | None = None,
           dtypes: Dtypes | None = None,
           global_batch: int | None = None, tp: Sequence[int] | None = None,
           pp: Sequence[int] | None = None, shard: Sequence[int] | None = None,
           checkpointing: Sequence[bool] = (False, True), ns_steps: int = 5,
           max_pp: int = 16, schedules: Sequence[PipelineSchedule] = SCHEDULES) -> Search:
    """Every layout of ``world_size`` ranks (module docstring), evaluated; the advice.

    ``global_batch``: sequences per step (default :func:`default_global_batch`: Llama 3's
    16M tokens), the same for every layout; a layout whose data-parallel size times the
    micro-batch does not divide it (a fraction of a micro-batch per rank) is skipped.
    ``tp`` / ``pp`` / ``shard``: restrict the search to these sizes (default: tp up to a
    node, pp powers of two up to ``max_pp`` and the block count, every shard size);
    ``schedules``: the pipeline schedules tried where ``pp > 1`` (each where torch runs
    it)."""
    t0 = time.perf_counter()
    links, workload, dtypes = links or Links(), workload or Workload(), dtypes or Dtypes()
    G = global_batch or default_global_batch(workload.seq)
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
            scheds = [sc for sc in schedules if sc.allows(m, P, shapes.blocks)] if P > 1 \
                else [ONE_STAGE]
            if not scheds:
                continue
            stage_list = stages(specs, shapes.unit_names, P)
            for S in (shard or divisors(dp)):
                if dp % S:
                    continue
                mesh = Mesh(P, dp // S, S, T)
                mc = mesh.costs(links)
                sps = _plan_stages(stage_list, dp, S, mesh, mc, dtypes, ns_steps, workload)
                for sc in scheds:
                    for ac in checkpointing:
                        found.append(_evaluate(shapes, sps, Layout(dp // S, S, T, P, ac, sc), m,
                                               links, mc, workload, dtypes, device_memory))
    fitting = [e for e in found if e.fits]
    pool = fitting or found
    best = min(pool, key=lambda e: (e.step.total if fitting else e.largest_rank_bytes,
                                    e.critical_bytes)) if pool else None
    floor = compute_floor(shapes, workload.seq, G * workload.seq, world_size, workload.tflops)
    return Search(found, best, time.perf_counter() - t0, world_size, G, floor)
