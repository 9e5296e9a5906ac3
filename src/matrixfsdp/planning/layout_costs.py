"""One pipeline stage of one layout, costed from its plan: model state per rank, gather and
reduce buffers, NS per rank, and every unit's collectives (bytes on the critical path and
seconds on the links), this library's and FSDP2's.

Model state per rank is :func:`~matrixfsdp.planning.traffic.rank_held`'s (segments, the
gradient buffers the shards' ``.grad`` keep alive, Muon momentum and AdamW moments), computed
for all ranks at once from difference arrays over the shard ranks plus the ranks that hold
pieces, so a 16384-rank plan costs milliseconds. The collectives are the runtime's on
NCCL (:func:`~matrixfsdp.planning.layout.calls` with uneven collectives: one call per unit
and direction over the shard group, the tp hop, and over the replicate group each shard
rank's own runs), their seconds :mod:`~matrixfsdp.planning.links`'.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .assign import ns_flops
from .layout import Segment, UnitLayout, calls
from .links import GroupCost, Mesh, MeshCost
from .traffic import Dtypes, reduce_layouts
from .types import Plan


@dataclass(frozen=True)
class RepLoad:
    """One shard rank's collectives across the replicas for one unit: a pass's reduce
    (the replicated run all-reduced, the matrices reduced to their replicas) and a step's
    broadcast, in seconds and bytes on the most loaded rank."""

    reduce: float = 0.0
    bcast: float = 0.0
    reduce_bytes: float = 0.0
    bcast_bytes: float = 0.0


@dataclass
class UnitComm:
    """One unit's collectives per pass: seconds on the links and critical-path bytes.
    ``gather``/``reduce``: over the shard group (the tp hop included), the same for every
    rank; ``rep``: across replicas, per (shard rank, tp rank) holding pieces (``bare``: every
    other rank); ``rep_*``: the most loaded shard rank's. ``launches``: process-group calls
    of a gather and of a reduce. ``floor_*``: the bytes no whole-matrix placement goes below
    at this layout (each unit's largest matrix crosses the tp hop and the replicate dim
    whole)."""

    gather: float = 0.0
    reduce: float = 0.0
    gather_bytes: float = 0.0
    reduce_bytes: float = 0.0
    launches: tuple[int, int, int, int] = (0, 0, 0, 0)  # gather, reduce, replicate's both
    rep: dict[tuple[int, int], RepLoad] = field(default_factory=dict)
    bare: RepLoad = RepLoad()
    rep_reduce: float = 0.0
    rep_bcast: float = 0.0
    rep_reduce_bytes: float = 0.0
    rep_bcast_bytes: float = 0.0
    floor_gather_bytes: float = 0.0
    floor_reduce_bytes: float = 0.0
    floor_rep_reduce_bytes: float = 0.0
    floor_rep_bcast_bytes: float = 0.0
    state_bytes: float = 0.0  # FSDP2's units: a rank's shards, gradients, optimizer state

    def rep_at(self, key: tuple[int, int]) -> RepLoad:
        return self.rep.get(key, self.bare)


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
    elementwise: float  # bytes of optimizer state touched per step by the busiest rank


def _diff_add(diff: list[int], start: int, stop: int, v: int) -> None:
    if stop > start and v:
        diff[start] += v
        diff[stop] -= v


def _even_chunks(rows: int, S: int) -> tuple[int, int, int]:
    """FSDP2's chunks: ``c`` rows on ranks ``< q``, ``rem`` on rank ``q``, none after."""
    c = -(-rows // S)
    q = rows // c if c else 0
    return c, q, rows - q * c


@dataclass
class StateParts:
    """:func:`traffic.rank_held`'s totals of some units over ``S`` shard ranks, kept
    additive (difference arrays over the shard ranks for the even parts, sparse extras at the
    ranks holding pieces), so units planned once serve several stages."""

    S: int
    storage: int = 0
    grads: list[int] = field(default_factory=list)
    optim: list[int] = field(default_factory=list)
    default: dict[tuple[int, int], int] = field(default_factory=dict)
    specific: dict[tuple[int, int, int], int] = field(default_factory=dict)

    def __post_init__(self):
        self.grads = self.grads or [0] * (self.S + 1)
        self.optim = self.optim or [0] * (self.S + 1)

    def add(self, u: UnitLayout, red: UnitLayout, T: int, s: int) -> None:
        """Unit ``u`` (its storage layout; ``red``: its reduce layout, whose segments the
        gradients keep alive) over ``T`` tp ranks, ``s`` bytes per element."""
        S, E, H = self.S, u.even_numel, red.head
        self.storage += E * s
        reach = 0
        for pl in u.placements:
            if pl.spec.muon and pl.spec.numel:
                continue
            c, q, rem = _even_chunks(pl.spec.rows, S)
            rn = pl.spec.row_numel
            _diff_add(self.optim, 0, q, 2 * c * rn * s)
            _diff_add(self.optim, q, q + 1, 2 * rem * rn * s)
            if rn:
                reach = max(reach, q + (rem > 0))
        _diff_add(self.grads, 0, min(reach, S), H * s)
        held: dict[tuple[int, int], dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for pc in u.pieces:
            n = u.placements[pc.index].spec.numel if pc.split else pc.numel
            for t in ((pc.tp_owner,) if pc.split else range(T)):
                held[(pc.rank, t)][pc.kind] += n
        for (r, t), kinds in held.items():
            seg, grad_seg = u.segment(r, t).size, red.segment(r, t).size
            even_stepped = r < reach
            everywhere = kinds.get(0, 0)  # experts: stepped on every replica

            def grads(stepped: int, grad_seg: int = grad_seg, even_stepped: bool = even_stepped
                      ) -> int:  # beyond the even part's, counted already
                if even_stepped:
                    return (grad_seg - H) * s
                return grad_seg * s if stepped else 0
            base = grads(everywhere)
            self.default[(r, t)] = self.default.get((r, t), 0) + (seg - E) * s + base + \
                everywhere * s
            for k, n in kinds.items():
                if k:
                    key3 = (k - 1, r, t)
                    extra = grads(everywhere + n) - base + n * s
                    self.specific[key3] = self.specific.get(key3, 0) + extra

    def merged(self, other: StateParts) -> StateParts:
        out = StateParts(self.S, self.storage + other.storage,
                         [a + b for a, b in zip(self.grads, other.grads)],
                         [a + b for a, b in zip(self.optim, other.optim)],
                         dict(self.default), dict(self.specific))
        for k, v in other.default.items():
            out.default[k] = out.default.get(k, 0) + v
        for k, v in other.specific.items():
            out.specific[k] = out.specific.get(k, 0) + v
        return out

    def spread(self, R: int, T: int) -> tuple[float, float]:
        """(max, mean) of the total over the ``R x S x T`` ranks."""
        S = self.S
        grads, optim = list(self.grads), list(self.optim)
        for arr in (grads, optim):
            for r in range(1, S + 1):
                arr[r] += arr[r - 1]
        base_r = [self.storage + grads[r] + optim[r] for r in range(S)]
        top: dict[tuple[int, int], int] = defaultdict(int)
        for (_, r, t), v in self.specific.items():
            top[(r, t)] = max(top[(r, t)], v)
        best = max([max(base_r)] + [base_r[r] + v + top[(r, t)]
                                    for (r, t), v in self.default.items()])
        total = (R * T * sum(base_r) + R * sum(self.default.values())
                 + sum(self.specific.values()))
        return float(best), total / (R * S * T)


def state_spread(layouts: Sequence[UnitLayout], R: int, S: int, T: int, s: int
                 ) -> tuple[float, float]:
    """(max, mean) over the ``R x S x T`` ranks of :func:`traffic.rank_held`'s total."""
    parts = StateParts(S)
    for u, red in zip(layouts, reduce_layouts(layouts)):
        parts.add(u, red, T, s)
    return parts.spread(R, T)


def _a2a_elements(u: UnitLayout, T: int) -> int:
    """The tp hop's busiest rank (elements): per owner row, each holder sends its matrices'
    slices to the ``T - 1`` others and receives theirs."""
    if T == 1:
        return 0
    rows: dict[int, list[int]] = defaultdict(lambda: [0] * T)
    for pc in u.pieces:
        if pc.split:
            rows[pc.rank][pc.tp_owner] += pc.numel
    return max((max(max((T - 1) * h, sum(held) - h) for h in held) for held in rows.values()),
               default=0)


def _grouped(seg: Segment, R: int, itemsize: int) -> float:
    """Bytes the most loaded replica moves in the uneven all-gather / reduce-scatter of
    ``seg``'s replica runs (:func:`~matrixfsdp.planning.layout.grouped_load`: all of them
    but the smallest)."""
    sizes = [n for k, (_, n) in seg.runs.items() if k]
    if not any(sizes):
        return 0.0
    return (sum(sizes) - (min(sizes) if len(sizes) == R else 0)) * itemsize


def _rep_load(seg: Segment, grad_seg: Segment, R: int, owned: bool, g: GroupCost,
              d: Dtypes) -> RepLoad:
    """One shard rank's replicate-dim collectives of a unit: its reduce segment's
    (``grad_seg``) and its storage segment's (``seg``), over ``R`` replicas."""
    shared = grad_seg.shared * d.reduce
    mats = _grouped(grad_seg, R, d.reduce)
    red = RepLoad(g.all_reduce(shared) + g.grouped(mats), 0.0, 2 * (R - 1) / R * shared + mats)
    bmats = _grouped(seg, R, d.storage) if owned else 0.0
    if not bmats:
        return red
    return RepLoad(red.reduce, g.grouped(bmats), red.reduce_bytes, bmats)


def unit_comm(u: UnitLayout, red: UnitLayout, mesh: Mesh, mc: MeshCost, d: Dtypes) -> UnitComm:
    """This library's collectives of one unit on NCCL (``u``: its layout, ``red``: its
    reduce layout): per direction one call over the shard group, the tp hop, and per shard
    rank its replicate-dim calls."""
    S, T, R = mesh.shard, mesh.tp, mesh.replicate
    c = UnitComm()
    if not u.numel:
        return c
    hop = _a2a_elements(u, T)
    whole = [pl.spec.numel for pl in u.placements if pl.spec.muon and pl.owner is not None]
    largest, total = max(whole, default=0), sum(whole)
    hop_floor = (T - 1) * largest / T if T > 1 else 0.0
    pieces = sum(pc.numel for pc in u.pieces) if S > 1 else 0
    launches = []
    for lay, isz, attr in ((u, d.gather, "gather"), (red, d.reduce, "reduce")):
        shard_calls = calls(lay, attr == "reduce")
        crit = sum(call.load(lay, 0, isz).critical for call in shard_calls)  # any rank's
        setattr(c, attr, mc.shard.grouped(crit) + mc.tp.all_to_all(hop * isz))
        setattr(c, attr + "_bytes", float(crit + hop * isz))
        setattr(c, "floor_" + attr + "_bytes",  # a reduce's flags: on every placement
                ((S - 1) * lay.head + pieces + hop_floor) * isz)
        launches.append(len(shard_calls) + (1 if hop else 0))
    c.launches = (launches[0], launches[1], 0, 0)
    if R > 1:
        g = mc.replicate
        owned = u.has_replica_owned
        keys = {(pc.rank, t) for pc in u.pieces
                for t in ((pc.tp_owner,) if pc.split else range(T))}
        c.rep = {k: _rep_load(u.segment(*k), red.segment(*k), R, owned, g, d) for k in keys}
        bare = -1  # a shard rank holding no piece: its even part (and flags) alone
        c.bare = _rep_load(u.segment(bare), red.segment(bare), R, owned, g, d)
        loads = [*c.rep.values(), c.bare]
        c.rep_reduce, c.rep_bcast = max(x.reduce for x in loads), max(x.bcast for x in loads)
        c.rep_reduce_bytes = max(x.reduce_bytes for x in loads)
        c.rep_bcast_bytes = max(x.bcast_bytes for x in loads)
        held = max(largest, total / (S * T))
        shared = max([u.even_numel] + [u.segment(*k).shared for k in keys])
        c.floor_rep_reduce_bytes = (2 * (R - 1) / R * shared + held) * d.reduce
        c.floor_rep_bcast_bytes = held * d.storage if owned else 0.0
        mats = any(len(red.segment(*k).runs) > 1 for k in keys)
        c.launches = (*c.launches[:2], 1 + int(mats), int(owned and mats))
    return c


def fsdp2_unit_comm(u: UnitLayout, mesh: Mesh, mc: MeshCost, d: Dtypes) -> UnitComm:
    """FSDP2's (with TP: FSDP2 + TP's) collectives of the same unit: every parameter's tp-local
    tensor padded to ``ceil(rows / S)`` rows, one all-gather / reduce-scatter; HSDP: the
    padded shard all-reduced across replicas after each reduce-scatter."""
    S, R = mesh.shard, mesh.replicate
    shard = state = 0
    for pl in u.placements:
        spec = pl.spec
        rows, rn = spec.rows, spec.row_numel
        if spec.tp > 1:
            rows, rn = (rows // spec.tp, rn) if spec.tp_dim == 0 else (rows, rn // spec.tp)
        n = -(-rows // S) * rn
        shard += n
        state += n * (3 if spec.muon else 4)  # shard, gradient, momentum or AdamW's two
    c = UnitComm(state_bytes=float(state * d.storage),
                 launches=(int(S > 1), int(S > 1), int(R > 1), 0))
    for isz, attr in ((d.gather, "gather"), (d.reduce, "reduce")):
        setattr(c, attr, mc.shard.ring(S * shard * isz))
        setattr(c, attr + "_bytes", float((S - 1) * shard * isz))
    if R > 1:
        c.bare = RepLoad(mc.replicate.all_reduce(shard * d.reduce), 0.0,
                         2 * (R - 1) / R * shard * d.reduce, 0.0)
        c.rep_reduce, c.rep_reduce_bytes = c.bare.reduce, c.bare.reduce_bytes
    return c


def step_bytes(units: Sequence[UnitComm], m: int, pp: int = 1, prefix: str = ""
               ) -> tuple[float, float]:
    """(critical-path bytes per step, of which across replicas) of a stage's units (the
    root's first): ``m`` micro-batches, each a forward gather, a backward gather (not the
    root's), a reduce and the replicate dim's reduce, then the replicate dim's broadcast
    once; ``pp > 1``: every unit gathered and reduced once per step. ``prefix``
    ``"floor_"``: the whole-matrix floor's."""
    total = rep = 0.0
    for i, u in enumerate(units):
        gathers, reduces = (1, 1) if pp > 1 else (m * (1 if i == 0 else 2), m)
        r = (reduces * getattr(u, prefix + "rep_reduce_bytes")
             + getattr(u, prefix + "rep_bcast_bytes"))
        total += (gathers * getattr(u, prefix + "gather_bytes")
                  + reduces * getattr(u, prefix + "reduce_bytes") + r)
        rep += r
    return total, rep


@dataclass
class NSLoads:
    """A plan's Newton-Schulz: the busiest rank's FLOPs, the bound ``max(largest, total /
    ranks)``, every matrix once, and per matrix (each expert counted) its FLOPs, elements,
    shape and unit."""

    max: float
    bound: float
    total: float
    costs: list[float]
    numel: list[int]
    shapes: list[tuple[int, int]] = field(default_factory=list)
    units: list[int] = field(default_factory=list)


def ns_loads(plan: Plan, T: int) -> NSLoads:
    """:class:`NSLoads` of a plan whose matrices may be tp-split (held by ``tp_owner``)."""
    load: dict[tuple[int, int], int] = defaultdict(int)
    costs, numel, shapes, units = [], [], [], []
    work = 0
    for pl in plan.placements.values():
        if not pl.spec.muon:
            continue
        f = ns_flops(pl.spec.matrix_shape, plan.ns_steps)
        n = pl.spec.matrices
        costs += [float(f)] * n
        numel += [math.prod(pl.spec.matrix_shape)] * n
        shapes += [tuple(pl.spec.matrix_shape)] * n
        units += [pl.spec.unit] * n
        work += f * n * (plan.replicas if pl.spec.is_experts else 1)
        if T > 1:
            load[(pl.owner, pl.tp_owner)] += f
    busiest = max(load.values(), default=0) if T > 1 else max(plan.rank_cost, default=0)
    bound = max(max(costs, default=0.0), work / (plan.world_size * T))
    return NSLoads(float(busiest), float(bound), float(sum(costs)), costs, numel, shapes, units)


def _buffers(layouts: Sequence[UnitLayout], d: Dtypes, kept: bool) -> float:
    """Transient bytes: gathered units (param dtype: the gathered chunks and the copied
    rows), their unsharded gradients, the reduce buffers (two reduces in flight, reduce
    dtype). ``kept`` (pipeline stages): every unit stays gathered over the step and keeps
    its unsharded gradients (no-sync)."""
    sizes = [u.copied_numel + (u.gathered_numel if u.keeps_gathered else 0) for u in layouts]
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
    elementwise = (7 * even + 5 * max(busiest, 0) / max(T, 1)) * d.storage
    return StageCosts(state_max, state_mean, _buffers(layouts, d, kept), ns.max, ns.bound,
                      ns.total, [c for p in parts for c in p.comm],
                      [c for p in parts for c in p.fsdp2], ns.numel,
                      sum(c.state_bytes for p in parts for c in p.fsdp2), elementwise)


def lpt_max(costs: Sequence[float], sizes: Sequence[int], ranks: int) -> tuple[float, int]:
    """Longest-processing-time owners over ``ranks``: (largest load, largest bytes owned)."""
    if not costs:
        return 0.0, 0
    if ranks >= len(costs):
        return float(max(costs)), max(sizes)
    heap = [(0.0, 0, r) for r in range(ranks)]
    for c, b in sorted(zip(costs, sizes), reverse=True):
        load, held, r = heapq.heappop(heap)
        heapq.heappush(heap, (load + c, held + b, r))
    return max(h[0] for h in heap), max(h[1] for h in heap)
