"""One layout of the search planned, costed and timed: each pipeline stage planned by the
planner the runtime uses (stages with the same blocks share one plan), costed
(:mod:`~matrixfsdp.costs.layout_costs`) and timed (:mod:`~matrixfsdp.costs.steptime`)
for this library, FSDP2 + torch.optim.Muon and DistMuon, each checkpointing the blocks its
memory asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..costs.layout_costs import StageCosts, UnitsPart, stage_costs, units_part
from ..costs.links import GroupCost, Links, Mesh, MeshCost
from ..costs.ns_costs import NSLoads, ns_loads
from ..costs.passes import KEEPS, passes_of, step_bytes
from ..costs.steptime import StepTime, Workload, ours, stage_work
from ..layout.assign import DEFAULT_RATES, TPRates, tp_group_owned
from ..layout.planner import make_plan, with_even_params
from ..layout.traffic import Dtypes
from ..layout.types import ParamSpec, Plan
from ..layout.units import layout_of, unit_layouts
from .evaluated import Evaluated, Layout, ac_mode
from .model_shapes import ModelShapes, Stage, activation_bytes, fewest_checkpointed, stages, tp_specs
from .peers import DistMuonBest, distmuon, distmuon_best, dtensor_muon_step, fsdp2_muon


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


def plan_stages(stage_list: Sequence[Stage], dp: int, S: int, mesh: Mesh, mc: MeshCost,
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


def evaluate(shapes: ModelShapes, sps: list[_StagePlan], layout: Layout, m: int,
             links: Links, mc: MeshCost, w: Workload, d: Dtypes,
             device_memory: float, floor: float = 0.0, mfu_scale: float = 0.0,
             rates: TPRates | None = None, tp_ownership: str = "auto") -> Evaluated:
    mesh = Mesh(layout.pp, layout.replicate, layout.shard, layout.tp)
    mode = ac_mode(layout.checkpointing)
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


def cost_path(shapes: ModelShapes, replicate: int, shard: int, tp: int = 1, pp: int = 1, *,
              dtypes: Dtypes | None = None, links: Links | None = None, ns_steps: int = 5,
              tp_ownership: str = "auto", tp_rates: TPRates | None = None
              ) -> list[tuple[Stage, Plan, StageCosts]]:
    """The search's costs of one layout, stage by stage (each stage's plan and
    :class:`~matrixfsdp.costs.layout_costs.StageCosts`, its units' collectives with them:
    :func:`~matrixfsdp.costs.passes.rank_counts` reads them rank by rank).
    ``tp_ownership`` / ``tp_rates``: as ``fully_shard`` is told (default: its own, "auto"
    at its default rates)."""
    specs = tp_specs(shapes, tp)
    if specs is None:
        raise ValueError(f"cost_path: the model does not split over tp {tp}")
    links, dtypes = links or Links(), dtypes or Dtypes()
    mesh = Mesh(pp, replicate, shard, tp)
    sps = plan_stages(stages(specs, shapes.unit_names, pp), replicate * shard, shard, mesh,
                      mesh.costs(links), dtypes, ns_steps, Workload(), tp_ownership, tp_rates)
    return [(sp.stage, sp.plan, sp.costs) for sp in sps]
