"""One pipeline stage of one layout, costed from its plan: model state per rank, gather and
reduce buffers, NS per rank, and every unit's collectives (bytes on the critical path and
seconds on the links), this library's and FSDP2's.

Model state per rank is :func:`~matrixfsdp.planning.traffic.rank_held`'s (segments, the
gradient buffers the shards' ``.grad`` keep alive, Muon momentum and AdamW moments), computed
for all ranks at once from difference arrays over the shard ranks plus the ranks that hold
pieces, so a 16384-rank plan costs milliseconds. Bytes per collective are the runtime's
(:mod:`~matrixfsdp.planning.traffic`); seconds are :mod:`~matrixfsdp.planning.links`'.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .assign import ns_flops
from .links import Mesh, MeshCost
from .traffic import Dtypes, UnitShape
from .types import Plan


@dataclass
class UnitComm:
    """One unit's collectives per pass: seconds on the links and critical-path bytes.
    ``gather``/``reduce``: over the shard group (tp hop included); ``rep_reduce`` (per
    pass) and ``rep_bcast`` (per step): across replicas, at the unit's slowest shard rank.
    ``floor_*``: the bytes no whole-matrix placement goes below at this layout (each
    unit's largest matrix crosses the tp hop and the replicate dim whole)."""

    gather: float = 0.0
    reduce: float = 0.0
    rep_reduce: float = 0.0
    rep_bcast: float = 0.0
    gather_bytes: float = 0.0
    reduce_bytes: float = 0.0
    rep_reduce_bytes: float = 0.0
    rep_bcast_bytes: float = 0.0
    floor_gather_bytes: float = 0.0
    floor_reduce_bytes: float = 0.0
    floor_rep_reduce_bytes: float = 0.0
    floor_rep_bcast_bytes: float = 0.0
    state_bytes: float = 0.0  # FSDP2's units: a rank's shards, gradients, optimizer state


@dataclass
class StageCosts:
    """A stage's costs per rank: model state (max, mean), buffers, NS, each unit's comm
    (ours and FSDP2's), and the matrices' NS for the baselines."""

    state_max: float
    state_mean: float
    buffers: float
    ns_max: float
    ns_bound: float
    ns_total: float  # every matrix once (FSDP2 + torch.optim.Muon runs all on every rank)
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


def _extra_grads(seg: int, E: int, s: int, even_stepped: bool, stepped: int) -> int:
    """Gradient bytes a segment adds beyond its even part's: the whole reduce output stays
    alive once any shard of it is stepped here (the even part's, counted already, or a
    piece's)."""
    if even_stepped:
        return (seg - E) * s
    return seg * s if stepped else 0


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

    def add(self, u: UnitShape, T: int, s: int) -> None:
        S, E = self.S, u.even_numel
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
        _diff_add(self.grads, 0, min(reach, S), E * s)
        held: dict[tuple[int, int], dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for pc in u.pieces:
            for t in ((pc.tp_owner,) if pc.tp_owner is not None else range(T)):
                held[(pc.rank, t)][pc.kind] += pc.stored
        for (r, t), kinds in held.items():
            seg = u.seg_of(r, t)
            everywhere = kinds.get(0, 0)  # experts: stepped on every replica
            base = _extra_grads(seg, E, s, r < reach, everywhere)
            key = (r, t)
            self.default[key] = self.default.get(key, 0) + (seg - E) * s + base + everywhere * s
            for k, n in kinds.items():
                if k:
                    key3 = (k - 1, r, t)
                    extra = _extra_grads(seg, E, s, r < reach, everywhere + n) - base + n * s
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


def state_spread(shapes: Sequence[UnitShape], R: int, S: int, T: int, s: int
                 ) -> tuple[float, float]:
    """(max, mean) over the ``R x S x T`` ranks of :func:`traffic.rank_held`'s total."""
    parts = StateParts(S)
    for u in shapes:
        parts.add(u, T, s)
    return parts.spread(R, T)


def _a2a_elements(u: UnitShape, T: int) -> int:
    """The tp hop's busiest rank (elements): per owner row, each holder sends its matrices'
    slices to the ``T - 1`` others and receives theirs."""
    if T == 1:
        return 0
    rows: dict[int, list[int]] = defaultdict(lambda: [0] * T)
    for pc in u.pieces:
        if pc.tp_owner is not None:
            rows[pc.rank][pc.tp_owner] += pc.numel
    return max((max(max((T - 1) * h, sum(held) - h) for h in held) for held in rows.values()),
               default=0)


def _replicate(u: UnitShape, R: int, mc: MeshCost, d: Dtypes) -> tuple[float, ...]:
    """(reduce seconds, broadcast seconds, reduce bytes, broadcast bytes) across replicas,
    at the unit's slowest shard rank."""
    if R == 1 or not u.numel:
        return 0.0, 0.0, 0.0, 0.0
    rep = mc.replicate
    out = [0.0, 0.0, 0.0, 0.0]
    owned = u.has_replica_owned
    bare = {0: u.even_numel}  # a shard rank holding no piece: its even part alone
    for runs in [*u.runs.values(), bare]:
        mats = [n for k, n in runs.items() if k]
        m = sum(mats)
        red = rep.all_reduce(runs.get(0, 0) * d.reduce) + rep.pipeline(m * d.reduce, len(mats))
        bc = rep.pipeline(m * d.storage, len(mats)) if owned else 0.0
        red_b = 2 * (R - 1) / R * runs.get(0, 0) * d.reduce + m * d.reduce
        bc_b = m * d.storage if owned else 0.0
        out = [max(a, b) for a, b in zip(out, (red, bc, red_b, bc_b))]
    return tuple(out)


def unit_comm(u: UnitShape, mesh: Mesh, mc: MeshCost, d: Dtypes) -> UnitComm:
    """This library's collectives of one unit (the runtime's: traffic.py)."""
    S, T, R = mesh.shard, mesh.tp, mesh.replicate
    c = UnitComm()
    if not u.numel:
        return c
    hop = _a2a_elements(u, T)
    pieces = sum(pc.numel for pc in u.pieces) if S > 1 else 0
    count = len(u.pieces)
    whole = [pl.spec.numel for pl in u.placements if pl.spec.muon and pl.owner is not None]
    largest, total = max(whole, default=0), sum(whole)
    hop_floor = (T - 1) * largest / T if T > 1 else 0.0
    for isz, attr in ((d.gather, "gather"), (d.reduce, "reduce")):
        t = (mc.shard.ring(S * u.even_numel * isz) + mc.tp.all_to_all(hop * isz)
             + mc.shard.pipeline(pieces * isz, count))
        setattr(c, attr, t)
        setattr(c, attr + "_bytes", float(((S - 1) * u.even_numel + pieces + hop) * isz))
        setattr(c, "floor_" + attr + "_bytes",
                ((S - 1) * u.even_numel + pieces + hop_floor) * isz)
    c.rep_reduce, c.rep_bcast, c.rep_reduce_bytes, c.rep_bcast_bytes = _replicate(u, R, mc, d)
    if R > 1:
        held = max(largest, total / (S * T))
        shared = max([u.even_numel] + [r.get(0, 0) for r in u.runs.values()])  # rows, experts
        c.floor_rep_reduce_bytes = (2 * (R - 1) / R * shared + held) * d.reduce
        c.floor_rep_bcast_bytes = held * d.storage if u.has_replica_owned else 0.0
    return c


def fsdp2_unit_comm(u: UnitShape, mesh: Mesh, mc: MeshCost, d: Dtypes) -> UnitComm:
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
    c = UnitComm(state_bytes=float(state * d.storage))
    for isz, attr in ((d.gather, "gather"), (d.reduce, "reduce")):
        setattr(c, attr, mc.shard.ring(S * shard * isz))
        setattr(c, attr + "_bytes", float((S - 1) * shard * isz))
    if R > 1:
        c.rep_reduce = mc.replicate.all_reduce(shard * d.reduce)
        c.rep_reduce_bytes = 2 * (R - 1) / R * shard * d.reduce
    return c


@dataclass
class NSLoads:
    """A plan's Newton-Schulz: the busiest rank's FLOPs, the bound ``max(largest, total /
    ranks)``, every matrix once (what FSDP2 + torch.optim.Muon runs on each rank), and per
    matrix (each expert counted) its FLOPs and elements."""

    max: float
    bound: float
    total: float
    costs: list[float]
    numel: list[int]


def ns_loads(plan: Plan, T: int) -> NSLoads:
    """:class:`NSLoads` of a plan whose matrices may be tp-split (held by ``tp_owner``)."""
    load: dict[tuple[int, int], int] = defaultdict(int)
    costs, numel = [], []
    work = 0
    for pl in plan.placements.values():
        if not pl.spec.muon:
            continue
        f = ns_flops(pl.spec.matrix_shape, plan.ns_steps)
        n = pl.spec.matrices
        costs += [float(f)] * n
        numel += [math.prod(pl.spec.matrix_shape)] * n
        work += f * n * (plan.replicas if pl.spec.is_experts else 1)
        if T > 1:
            load[(pl.owner, pl.tp_owner)] += f
    busiest = max(load.values(), default=0) if T > 1 else max(plan.rank_cost, default=0)
    bound = max(max(costs, default=0.0), work / (plan.world_size * T))
    return NSLoads(float(busiest), float(bound), float(sum(costs)), costs, numel)


def _buffers(shapes: Sequence[UnitShape], d: Dtypes, kept: bool) -> float:
    """Transient bytes: gathered units (param dtype), their unsharded gradients, the reduce
    buffers (two reduces in flight, reduce dtype). ``kept`` (pipeline stages): every unit
    stays gathered over the step and keeps its unsharded gradients (no-sync)."""
    sizes = [u.gathered_numel for u in shapes]
    if not sizes:
        return 0.0
    block = max(sizes[1:], default=0)
    if kept:
        return float(sum(sizes) * (d.gather + d.reduce) + block * (d.gather + 2 * d.reduce))
    return float(sizes[0] * d.gather + 3 * block * d.gather + 2 * block * d.reduce)


@dataclass
class UnitsPart:
    """Some units of a stage, costed once: their shapes, collectives (ours, FSDP2's) and
    model-state parts. A stage is the sum of its parts (:func:`stage_costs`)."""

    shapes: list[UnitShape]
    comm: list[UnitComm]
    fsdp2: list[UnitComm]
    state: StateParts


def units_part(shapes: Sequence[UnitShape], mesh: Mesh, mc: MeshCost, d: Dtypes) -> UnitsPart:
    state = StateParts(mesh.shard)
    for u in shapes:
        state.add(u, mesh.tp, d.storage)
    return UnitsPart(list(shapes), [unit_comm(u, mesh, mc, d) for u in shapes],
                     [fsdp2_unit_comm(u, mesh, mc, d) for u in shapes], state)


def stage_costs(plan: Plan, parts: Sequence[UnitsPart], mesh: Mesh, d: Dtypes,
                kept: bool, ns: NSLoads) -> StageCosts:
    """A stage's costs from its plan, its units' parts (the root's first) and its NS."""
    T = mesh.tp
    state = parts[0].state
    for p in parts[1:]:
        state = state.merged(p.state)
    state_max, state_mean = state.spread(mesh.replicate, T)
    shapes = [u for p in parts for u in p.shapes]
    even = sum(u.even_numel for u in shapes)
    busiest = max(plan.rank_bytes, default=0) / d.storage - even
    elementwise = (7 * even + 5 * max(busiest, 0) / max(T, 1)) * d.storage
    return StageCosts(state_max, state_mean, _buffers(shapes, d, kept), ns.max, ns.bound,
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
