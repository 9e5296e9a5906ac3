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

from ..layout.assign import DEFAULT_RATES, TPRates, tp_group_owned
from ..layout.planner import make_plan, with_even_params
from ..layout.traffic import Dtypes
from ..layout.types import ParamSpec, Plan
from ..layout.units import layout_of, unit_layouts
from .layout_costs import (
    KEEPS,
    NSLoads,
    StageCosts,
    UnitsPart,
    ns_loads,
    passes_of,
    stage_costs,
    step_bytes,
    units_part,
)
from .links import GroupCost, Links, Mesh, MeshCost
from .model_shapes import (
    ModelShapes,
    Stage,
    activation_bytes,
    fewest_checkpointed,
    stages,
    tp_specs,
)
from .peers import DistMuonBest, distmuon, distmuon_best, dtensor_muon_step, fsdp2_muon
from .steptime import ONE_STAGE, SCHEDULES, PipelineSchedule, StepTime, Workload, ours, stage_work

LLAMA3_TOKENS = 2 ** 24  # Llama 3's global batch at its final stage: 16M tokens per step
H100_BF16_DENSE = 989e12  # H100 SXM's dense bf16 tensor-core peak, FLOP/s (NVIDIA datasheet)

KEYS = ("replicate", "shard", "tp", "pp", "largest_rank_bytes", "device_memory_bytes", "fits",
        "model_state_max_over_mean", "critical_bytes_vs_fsdp2", "owner_floor",
        "replicate_bytes_vs_fsdp2_hsdp", "ns_vs_bound", "step_seconds", "fsdp2_step_seconds",
        "bound", "checkpointed_blocks", "mfu", "vs_compute_floor", "tp_placements",
        "keep")

#: activation checkpointing per layout: none, the fewest blocks that fit (each system its
#: own), every block
AC_MODES = ("off", "fit", "all")
SYSTEMS = ("matrixfsdp", "fsdp2_torch_muon", "distmuon")


def _mode(ac: bool | str) -> str:
    if isinstance(ac, bool):
        return "all" if ac else "off"
    if ac not in AC_MODES:
        raise ValueError(f"activation checkpointing: one of {AC_MODES}, got {ac!r}")
    return ac


@dataclass(frozen=True)
class Layout:
    """A layout searched: ``(replicate, shard, tp, pp)``, its activation checkpointing
    (``"off"``, ``"fit"``: the fewest blocks that fit, ``"all"``) and pipeline schedule."""

    replicate: int
    shard: int
    tp: int
    pp: int
    checkpointing: bool | str = "fit"
    schedule: PipelineSchedule = ONE_STAGE

    def label(self, ac: str = "") -> str:
        sched = f" ({self.schedule.name})" if self.pp > 1 else ""
        return f"{self.replicate} x {self.shard} x tp {self.tp} x pp {self.pp}{sched}{ac}"


def keep_text(keep: str, m: int) -> str:
    """Which units a step keeps gathered, in words (``keep``:
    :data:`~matrixfsdp.advisor.layout_costs.KEEPS`; ``m`` micro-batches)."""
    if keep == "each":
        return "every unit gathered each micro-batch"
    if keep == "root":
        return "root gathered once per step"
    if m == 1:
        return "first and last blocks kept from forward to backward"
    return "root and first block gathered once per step, last block kept"


def ac_text(checkpointed: Sequence[int], blocks: int, keep: str = "each", m: int = 1) -> str:
    """``", AC 34/126 blocks"`` (or ``", AC"`` where every block is checkpointed), and
    which units stay gathered (:func:`keep_text`)."""
    k = sum(checkpointed)
    ac = "" if not k else ", AC" if k == blocks else f", AC {k}/{blocks} blocks"
    return ac + ("" if keep == "each" or (keep == "root" and m == 1) else
                 ", " + keep_text(keep, m))


@dataclass
class Evaluated:
    """One layout's costs: memory of its largest rank, bytes per step (critical path)
    against FSDP2's at the same layout, NS against its bound, step seconds (ours, FSDP2 +
    torch.optim.Muon, DistMuon), each system with the blocks it checkpoints."""

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
    blocks: int = 0  # the model's blocks
    checkpointed: tuple[int, ...] = ()  # per stage: its first blocks checkpointed (ours)
    fsdp2_checkpointed: tuple[int, ...] = ()
    distmuon_checkpointed: tuple[int, ...] = ()
    keep: str = "each"  # ours: the units kept gathered (layout_costs.KEEPS)
    floor: float = 0.0  # the compute floor (seconds)
    mfu_scale: float = 0.0  # the matmul rate over the GPU's dense peak
    tp_placements: dict[str, int] = field(default_factory=dict)  # "group" / "rank": matrices
    tp_by_name: dict[str, str] = field(default_factory=dict)  # generic name -> placement
    runtime_default_agrees: bool = True  # fully_shard's auto (its default rates) places alike
    ns_comm: float = 0.0  # of the NS seconds: the busiest tp group's all-reduces

    @property
    def largest_rank_bytes(self) -> float:
        return self.state_max + self.buffers + self.activations

    @property
    def fits(self) -> bool:
        return self.largest_rank_bytes <= self.device_memory

    @property
    def owner_floor(self) -> float:
        """The least critical-path bytes this layout's placements can move, over FSDP2's: at
        1-D ``P/(P-1)`` on the matrices (a rank receives all of a unit's matrices, where an
        FSDP2 rank holds ``1/P``); with tp, each unit's largest matrix held whole on one tp
        rank sends ``(T-1)/T`` of it across the tp hop (one its tp group owns: nothing);
        with replicas, it is reduced to and broadcast from its owner replica whole (a slice
        where its tp group owns it)."""
        return self.floor_bytes / self.fsdp2_critical_bytes if self.fsdp2_critical_bytes \
            else 1.0

    @property
    def distmuon_feasible(self) -> bool:
        return self.distmuon is not None

    @property
    def bytes_ratio(self) -> float:
        return self.critical_bytes / self.fsdp2_critical_bytes if self.fsdp2_critical_bytes \
            else 1.0

    def step_of(self, system: str) -> StepTime | None:
        return {"matrixfsdp": self.step, "fsdp2_torch_muon": self.fsdp2,
                "distmuon": self.distmuon}[system]

    def checkpointed_of(self, system: str) -> tuple[int, ...]:
        return {"matrixfsdp": self.checkpointed, "fsdp2_torch_muon": self.fsdp2_checkpointed,
                "distmuon": self.distmuon_checkpointed}[system]

    def label(self, system: str = "matrixfsdp") -> str:
        """The layout, the blocks ``system`` checkpoints, and ours' root once per step."""
        return self.layout.label(ac_text(self.checkpointed_of(system), self.blocks,
                                         self.keep if system == "matrixfsdp" else "each",
                                         self.micro_batches))

    def mfu(self, system: str = "matrixfsdp") -> float | None:
        """Model FLOPs utilisation of ``system``'s step against the GPU's dense peak: the
        step's model FLOPs (3x forward, no recompute) over its seconds on every GPU."""
        st = self.step_of(system)
        return self.floor * self.mfu_scale / st.total if st and st.total else None

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
               "step_seconds": self.step.total, "fsdp2_step_seconds": self.fsdp2.total,
               "bound": self.step.bound, "checkpointed_blocks": sum(self.checkpointed),
               "mfu": self.mfu(), "vs_compute_floor": self.step.total / self.floor
               if self.floor else None, "tp_placements": dict(self.tp_placements),
               "keep": self.keep}
        out.update({"activation_checkpointing": sum(self.checkpointed) > 0,
                    "checkpointing_mode": _mode(lay.checkpointing),
                    "checkpointed_blocks_per_stage": list(self.checkpointed),
                    "blocks": self.blocks, "micro_batches": self.micro_batches,
                    "critical_path": self.step.path,
                    "tp_placement_by_matrix": dict(self.tp_by_name),
                    "tp_ownership_runtime_default_agrees": self.runtime_default_agrees,
                    "ns_tp_all_reduce_seconds": self.ns_comm,
                    "distmuon_step_seconds": self.distmuon.total if self.distmuon else None,
                    "fsdp2_bound": self.fsdp2.bound, "fsdp2_mfu": self.mfu("fsdp2_torch_muon"),
                    "fsdp2_checkpointed_blocks": sum(self.fsdp2_checkpointed),
                    "distmuon_bound": self.distmuon.bound if self.distmuon else None,
                    "distmuon_mfu": self.mfu("distmuon"),
                    "distmuon_checkpointed_blocks": sum(self.distmuon_checkpointed)
                    if self.distmuon else None,
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
    peak: float = H100_BF16_DENSE  # the GPU's dense bf16 FLOP/s, for MFU
    tp_ownership: str = "auto"

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


def tp_rates(w: Workload, d: Dtypes, tp: GroupCost, m: int, pp: int) -> TPRates:
    """The rates ``tp_ownership="auto"`` weighs a tp-split matrix's placements at, from the
    search's own model: the NS rate, the tp group's all-reduce bandwidth (NVLink), bf16 NS,
    the gather and reduce dtypes, and the gathers and reduces a block makes per step at ``m``
    micro-batches (two and one each; one and one with pipeline stages). At the defaults and
    one micro-batch: the runtime's own default rates."""
    gathers, reduces = (1, 1) if pp > 1 else (2 * m, m)
    return TPRates(w.ns_rate, tp.bw["all_reduce"], 2, d.gather, d.reduce, gathers, reduces)


def _plan_stages(stage_list: Sequence[Stage], dp: int, S: int, mesh: Mesh, mc: MeshCost,
                 d: Dtypes, ns_steps: int, w: Workload, tp_ownership: str = "auto",
                 rates: TPRates | None = None) -> list[_StagePlan]:
    """Every stage planned by the runtime's planner and costed. Stages with the same blocks
    share one plan of those blocks, to which each adds its root's even parameters
    (:func:`~matrixfsdp.layout.planner.with_even_params`: the same owners as planning the
    stage whole); a root holding Muon matrices is planned with its stage. ``tp_ownership``
    and ``rates``: who owns a tp-split matrix (the runtime's keyword of ``fully_shard``)."""
    cores: dict[tuple, tuple[Plan, UnitsPart, NSLoads]] = {}
    dm: dict[int, tuple[DistMuonBest | None, float]] = {}
    out = []
    own = {"tp_ownership": tp_ownership, "tp_rates": rates}
    for st in stage_list:
        root = [s for s in st.specs if s.unit == 0]
        if any(s.muon for s in root):
            plan = make_plan(st.specs, dp, st.unit_names, ns_steps, S, **own)
            parts = [units_part(unit_layouts(plan, mesh.tp), mesh, mc, d)]
            ns = ns_loads(plan, mesh.tp, w.ns_rate, mc.tp)
        else:
            key = tuple((s.shape, s.unit, s.muon, s.tp, s.tp_dim) for s in st.specs if s.unit)
            if key not in cores:
                core = make_plan([s for s in st.specs if s.unit], dp, st.unit_names, ns_steps, S,
                                 **own)
                cores[key] = (core, units_part(unit_layouts(core, mesh.tp)[1:], mesh, mc, d),
                              ns_loads(core, mesh.tp, w.ns_rate, mc.tp))
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


def _launches(units, m: int, pp: int, which: str = "launches", keep: str = "each") -> int:
    """Data-parallel launches (or NCCL ops) per step of a stage's units (a busiest rank's)."""
    total = 0
    for i, u in enumerate(units):
        gathers, reduces = passes_of(i, m, pp, keep, len(units))
        g, r, rr, rb = getattr(u, which)
        total += gathers * g + reduces * (r + rr) + rb
    return total


def runtime_default_agrees(specs: Sequence[ParamSpec], ownership: str, rates: TPRates,
                           ns_steps: int = 5) -> bool:
    """Whether ``fully_shard(tp_ownership=ownership)`` at its default rates places every
    tp-split matrix as the search does at ``rates``."""
    seen = set()
    for s in specs:
        key = (s.shape, s.tp, s.tp_dim)
        if not s.muon or len(s.shape) != 2 or s.tp == 1 or key in seen:
            continue
        seen.add(key)
        if tp_group_owned(s.shape, s.tp, s.tp_dim, ownership, ns_steps, rates) != \
                tp_group_owned(s.shape, s.tp, s.tp_dim, ownership, ns_steps, DEFAULT_RATES):
            return False
    return True


@dataclass
class _System:
    """One system's step at a layout: its steps per stage, the blocks each stage
    checkpoints, its largest rank's memory, whether it fits."""

    steps: list[StepTime | None]
    checkpointed: tuple[int, ...]
    memory: float
    fits: bool
    stage: int = 0  # the stage holding the most memory
    activations: float = 0.0  # that stage's

    @property
    def slowest(self) -> StepTime | None:
        if any(s is None for s in self.steps):
            return None
        return max(self.steps, key=lambda s: s.total)


def _evaluate(shapes: ModelShapes, sps: list[_StagePlan], layout: Layout, m: int,
              links: Links, mc: MeshCost, w: Workload, d: Dtypes,
              device_memory: float, floor: float = 0.0, mfu_scale: float = 0.0,
              rates: TPRates | None = None, tp_ownership: str = "auto") -> Evaluated:
    mesh = Mesh(layout.pp, layout.replicate, layout.shard, layout.tp)
    mode = _mode(layout.checkpointing)
    sched = layout.schedule
    tokens = w.micro_batch * w.seq
    in_flight = sched.in_flight(m, layout.pp)
    ranges, block_at = [], 0
    for sp in sps:
        ranges.append(range(block_at, block_at + sp.stage.blocks))
        block_at += sp.stage.blocks
    works: dict[tuple[int, int], object] = {}

    def work(i: int, k: int):
        if (i, k) not in works:
            blocks = ranges[i]
            per_block = [2.0 * shapes.block_matmul[b] + 2.0 * w.seq * shapes.d_model
                         for b in blocks]
            head = 2.0 * shapes.vocab * shapes.d_model if sps[i].stage.last else 0.0
            works[(i, k)] = stage_work(per_block, head, tokens, shapes.d_model, mesh, mc, links,
                                       w, [j < k for j in range(len(blocks))])
        return works[(i, k)]

    def act(i: int, k: int) -> float:
        return activation_bytes(shapes, ranges[i], tokens, layout.tp, k, in_flight,
                                sps[i].stage.last)

    def ks(base: Sequence[float]) -> tuple[int, ...]:
        """Per stage: the blocks it checkpoints, given its memory besides activations."""
        out = []
        for i, b in enumerate(base):
            n = len(ranges[i])
            if mode != "fit":
                out.append(n if mode == "all" else 0)
                continue
            k = fewest_checkpointed(device_memory - b, shapes, ranges[i], tokens, layout.tp,
                                    in_flight, sps[i].stage.last)
            out.append(n if k is None else k)
        return tuple(out)

    def system(base: Sequence[float], step) -> _System:
        k = ks(base)
        mem = [b + act(i, k[i]) for i, b in enumerate(base)]
        top = max(range(len(mem)), key=mem.__getitem__)
        steps = [step(i, work(i, k[i])) for i in range(len(sps))]
        return _System(steps, k, mem[top], mem[top] <= device_memory, top, act(top, k[top]))

    def kept(c: StageCosts, keep: str) -> float:
        """Bytes the units ``keep`` keeps gathered add: their gradients accumulated unreduced
        (reduce dtype) over micro-batches, the first block's buffers over the step."""
        extra = 0.0
        if keep != "each" and m > 1:
            extra += c.root_numel * d.reduce
        if keep == "edges":
            extra += c.first_gathered + (c.first_numel * d.reduce if m > 1 else 0.0)
        return extra

    def mine(keep: str) -> _System:
        return system([sp.costs.state_max + sp.costs.buffers + kept(sp.costs, keep)
                       for sp in sps],
                      lambda i, wk: ours(sps[i].costs, wk, mesh, mc, w, m, sched, keep))

    keeps = ["each"] if layout.pp > 1 else ["each", "edges"] if m == 1 else list(KEEPS)
    variants = [(k, mine(k)) for k in keeps]
    fitting = [v for v in variants if v[1].fits]
    keep, me = min(fitting or variants[:1], key=lambda v: v[1].slowest.total)
    f2_base = [sp.costs.fsdp2_state + sp.costs.buffers for sp in sps]
    f2 = system(f2_base, lambda i, wk: fsdp2_muon(sps[i].costs, wk, mesh, mc, w, m,
                                                   sps[i].torch_muon, sched))
    dmb = sps[0].distmuon
    dmu = system([b + (dmb.buffers if dmb else 0.0) for b in f2_base],
                 lambda i, wk: distmuon(sps[i].costs, wk, mesh, mc, w, m, sps[i].distmuon))
    c_mem = sps[me.stage].costs
    pp = layout.pp
    bytes_rows = [(step_bytes(sp.costs.units, m, pp, keep=keep),
                   step_bytes(sp.costs.fsdp2_units, m, pp),
                   step_bytes(sp.costs.units, m, pp, "floor_", keep=keep))
                  for sp in sps]
    mine_b, theirs_b = (max((r[k] for r in bytes_rows), key=lambda x: x[0]) for k in (0, 1))
    floor_b = max(bytes_rows, key=lambda r: r[0][0])[2][0]
    busiest = max(sps, key=lambda sp: sp.ns.max).ns
    placed: dict[str, int] = {}
    by_name: dict[str, str] = {}
    for sp in sps:
        for kind, n in sp.ns.placements.items():
            placed[kind] = placed.get(kind, 0) + n
        by_name.update(sp.ns.by_name)
    specs = [s for sp in sps for s in sp.stage.specs]
    agrees = runtime_default_agrees(specs, tp_ownership, rates) if rates and layout.tp > 1 \
        else True
    root_extra = kept(c_mem, keep)
    return Evaluated(layout, m, c_mem.state_max, sum(sp.costs.state_mean for sp in sps) / len(sps),
                     c_mem.buffers + root_extra, me.activations, device_memory, mine_b[0],
                     theirs_b[0], floor_b, mine_b[1], theirs_b[1],
                     max(sp.costs.ns_max for sp in sps), max(sp.costs.ns_bound for sp in sps),
                     me.slowest, f2.slowest, dmu.slowest, f2.memory, dmu.memory,
                     max(_launches(sp.costs.units, m, pp, keep=keep) for sp in sps),
                     max(_launches(sp.costs.fsdp2_units, m, pp) for sp in sps),
                     max(_launches(sp.costs.units, m, pp, "ops", keep) for sp in sps),
                     dmb.blocks if dmb else 0, busiest.busiest, plan=sps[0].plan,
                     blocks=shapes.blocks, checkpointed=me.checkpointed,
                     fsdp2_checkpointed=f2.checkpointed, distmuon_checkpointed=dmu.checkpointed,
                     keep=keep, floor=floor, mfu_scale=mfu_scale, tp_placements=placed,
                     tp_by_name=by_name, runtime_default_agrees=agrees,
                     ns_comm=busiest.ns_comm)


def compute_floor(shapes: ModelShapes, seq: int, tokens: int, world_size: int,
                  tflops: float) -> float:
    """Seconds of a step's model FLOPs (forward, and backward twice it; no recompute, no
    communication) spread evenly over every rank at ``tflops``: what no layout beats."""
    blocks, head = shapes.forward_flops_per_token(seq)
    return 3.0 * (blocks + head) * tokens / (world_size * tflops)


def cost_path(shapes: ModelShapes, replicate: int, shard: int, tp: int = 1, pp: int = 1, *,
              dtypes: Dtypes | None = None, links: Links | None = None, ns_steps: int = 5,
              tp_ownership: str = "auto", tp_rates: TPRates | None = None
              ) -> list[tuple[Stage, Plan, StageCosts]]:
    """The search's costs of one layout, stage by stage (each stage's plan and
    :class:`~matrixfsdp.advisor.layout_costs.StageCosts`, its units' collectives with them:
    :func:`~matrixfsdp.advisor.layout_costs.rank_counts` reads them rank by rank).
    ``tp_ownership`` / ``tp_rates``: as ``fully_shard`` is told (default: its own, "auto"
    at its default rates)."""
    specs = tp_specs(shapes, tp)
    if specs is None:
        raise ValueError(f"cost_path: the model does not split over tp {tp}")
    links, dtypes = links or Links(), dtypes or Dtypes()
    mesh = Mesh(pp, replicate, shard, tp)
    sps = _plan_stages(stages(specs, shapes.unit_names, pp), replicate * shard, shard, mesh,
                       mesh.costs(links), dtypes, ns_steps, Workload(), tp_ownership, tp_rates)
    return [(sp.stage, sp.plan, sp.costs) for sp in sps]


def default_global_batch(seq: int, tokens: int = LLAMA3_TOKENS) -> int:
    """Sequences per step for ``tokens`` per step (default Llama 3's 16M), at least one."""
    return max(1, tokens // seq)


def search(shapes: ModelShapes, world_size: int, device_memory: float, *,
           links: Links | None = None, workload: Workload | None = None,
           dtypes: Dtypes | None = None,
           global_batch: int | None = None, tp: Sequence[int] | None = None,
           pp: Sequence[int] | None = None, shard: Sequence[int] | None = None,
           checkpointing: Sequence[bool | str] = ("fit",), ns_steps: int = 5,
           max_pp: int = 16, schedules: Sequence[PipelineSchedule] = SCHEDULES,
           tp_ownership: str = "auto", peak: float = H100_BF16_DENSE,
           replicate: Sequence[int] | None = None) -> Search:
    """Every layout of ``world_size`` ranks (module docstring), evaluated; the advice.

    ``global_batch``: sequences per step (default :func:`default_global_batch`: Llama 3's
    16M tokens), the same for every layout; a layout whose data-parallel size times the
    micro-batch does not divide it (a fraction of a micro-batch per rank) is skipped.
    ``tp`` / ``pp`` / ``shard`` / ``replicate``: restrict the search to these sizes
    (default: tp up to a node, pp powers of two up to ``max_pp`` and the block count, every
    shard size); ``schedules``: the pipeline schedules tried where ``pp > 1`` (each where
    torch runs it); ``checkpointing``: per layout ``"off"``, ``"fit"`` (each system the
    fewest blocks that fit its memory) or ``"all"`` (True / False: all / off);
    ``tp_ownership``: who owns a tp-split matrix (``fully_shard``'s keyword; "auto" at the
    rates of :func:`tp_rates`); ``peak``: the GPU's dense FLOP/s, for MFU."""
    t0 = time.perf_counter()
    links, workload, dtypes = links or Links(), workload or Workload(), dtypes or Dtypes()
    G = global_batch or default_global_batch(workload.seq)
    g = links.gpus_per_node
    tps = tp or [t for t in divisors(g) if world_size % t == 0]
    floor = compute_floor(shapes, workload.seq, G * workload.seq, world_size, workload.tflops)
    scale = workload.tflops / peak
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
                if dp % S or (replicate and dp // S not in replicate):
                    continue
                mesh = Mesh(P, dp // S, S, T)
                mc = mesh.costs(links)
                rates = tp_rates(workload, dtypes, mc.tp, m, P)
                sps = _plan_stages(stage_list, dp, S, mesh, mc, dtypes, ns_steps, workload,
                                   tp_ownership, rates)
                for sc in scheds:
                    for ac in checkpointing:
                        found.append(_evaluate(shapes, sps, Layout(dp // S, S, T, P, _mode(ac), sc),
                                               m, links, mc, workload, dtypes, device_memory,
                                               floor, scale, rates, tp_ownership))
    fitting = [e for e in found if e.fits]
    pool = fitting or found
    best = min(pool, key=lambda e: (e.step.total if fitting else e.largest_rank_bytes,
                                    e.critical_bytes)) if pool else None
    return Search(found, best, time.perf_counter() - t0, world_size, G, floor, peak,
                  tp_ownership)


def at_rate(shapes: ModelShapes, world_size: int, device_memory: float, e: Evaluated,
            tflops: float, **kw) -> Evaluated | None:
    """Layout ``e`` evaluated again with every matmul and Newton-Schulz at ``tflops``
    FLOP/s (the kernel-rate sensitivity): the same search restricted to it, planned anew
    (``tp_ownership="auto"`` weighs the placements at the new rate)."""
    w = replace(kw.pop("workload", None) or Workload(), tflops=tflops, ns_tflops=tflops)
    lay = e.layout
    found = search(shapes, world_size, device_memory, workload=w, tp=[lay.tp], pp=[lay.pp],
                   shard=[lay.shard], checkpointing=[lay.checkpointing],
                   schedules=[lay.schedule], replicate=[lay.replicate], **kw)
    return found.layouts[0] if found.layouts else None


def best_of(s: Search, system: str, device_memory: float) -> Evaluated | None:
    """``system``'s fastest layout that it can run and that fits its own memory (ours: the
    advice)."""
    if system == "matrixfsdp":
        return s.recommended if s.recommended and s.recommended.fits else None
    if system == "fsdp2_torch_muon":
        pool = [e for e in s.layouts if e.fsdp2_memory <= device_memory]
    else:
        pool = [e for e in s.layouts if e.distmuon_feasible and e.distmuon_memory <= device_memory]
    return min(pool, key=lambda e: e.step_of(system).total) if pool else None


@dataclass
class RateRow:
    """The kernel-rate sensitivity at one matmul / NS rate: the compute floor there and each
    system's best layout (found at the search's rate) evaluated again at it."""

    tflops: float
    floor: float
    systems: dict[str, Evaluated | None]

    def record(self, peak: float) -> dict:
        out: dict = {"tflops": self.tflops / 1e12, "compute_floor_seconds": self.floor}
        for k, e in self.systems.items():
            st = e.step_of(k) if e is not None else None
            out[k] = None if st is None else {
                "layout": e.label(k), "step_seconds": st.total,
                "vs_compute_floor": st.total / self.floor,
                "mfu": self.floor * self.tflops / (st.total * peak), "bound": st.bound}
        return out


def sensitivity(shapes: ModelShapes, s: Search, device_memory: float, rates: Sequence[float],
                workload: Workload | None = None, **kw) -> list[RateRow]:
    """Each system's best layout of ``s`` at each kernel rate of ``rates`` (FLOP/s): the
    layout's step again with every matmul and Newton-Schulz at that rate (:func:`at_rate`);
    at the search's own rate, the search's figures."""
    workload = workload or Workload()
    best = {k: best_of(s, k, device_memory) for k in SYSTEMS}
    rows = []
    for r in rates:
        same = r == workload.tflops and workload.ns_rate == r
        fl = s.floor * workload.tflops / r
        systems = {}
        for k, e in best.items():
            systems[k] = e if e is None or same else at_rate(
                shapes, s.world_size, device_memory, e, r, workload=workload,
                global_batch=s.global_batch, tp_ownership=s.tp_ownership, peak=s.peak, **kw)
        rows.append(RateRow(r, fl, systems))
    return rows
