"""One pipeline stage of one layout, costed from its plan: model state per rank, gather and
reduce buffers, NS per rank, and every unit's collectives (bytes on the critical path and
seconds on the links), this library's and FSDP2's.

Model state per rank is :func:`~matrixfsdp.layout.traffic.rank_held`'s (segments, the
gradient buffers the shards' ``.grad`` keep alive, Muon momentum and AdamW moments), computed
for all ranks at once from difference arrays over the shard ranks plus the ranks that hold
pieces, so a 16384-rank plan costs milliseconds. The collectives are the ops the runtime
issues (:func:`~matrixfsdp.layout.units.calls`: per unit and direction one even
collective and one broadcast / reduce per holder over the shard group, one launch where the
group coalesces; the tp hop's all-to-all; over the replicate group each shard rank's own
all-reduce and per-replica reduces / broadcasts), each charged its own latency at its
group's size (:mod:`~matrixfsdp.advisor.links`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..layout.assign import gram_side, ns_flops
from ..layout.loads import op_load
from ..layout.traffic import Dtypes, reduce_layouts
from ..layout.types import Plan
from ..layout.units import Segment, UnitLayout, calls
from ..optim.muon import BATCH_NS_NUMEL
from .links import GroupCost, Mesh, MeshCost, Op
from .state_costs import StateParts


@dataclass(frozen=True)
class RepLoad:
    """One shard rank's collectives across the replicas for one unit: a pass's reduce
    (the replicated run all-reduced, the matrices reduced to their replicas) and a step's
    broadcast, in seconds and bytes on the most loaded rank."""

    reduce: float = 0.0
    bcast: float = 0.0
    reduce_bytes: float = 0.0
    bcast_bytes: float = 0.0
    reduce_ops: int = 0
    bcast_ops: int = 0
    reduce_launches: int = 0
    bcast_launches: int = 0


@dataclass
class UnitComm:
    """One unit's collectives per pass: seconds on the links and critical-path bytes.
    ``gather``/``reduce``: over the shard group (the tp hop included), the same for every
    rank; ``rep``: across replicas, per (shard rank, tp rank) holding pieces (``bare``: every
    other rank); ``rep_*``: the most loaded shard rank's. ``launches``: process-group
    launches of a gather, a reduce and the replicate dim's reduce and broadcast (the most
    loaded rank's); ``ops``: the NCCL ops they hold. ``floor_*``: the bytes no whole-matrix
    placement goes below at this layout (each unit's largest matrix crosses the tp hop and
    the replicate dim whole)."""

    gather: float = 0.0
    reduce: float = 0.0
    gather_bytes: float = 0.0
    reduce_bytes: float = 0.0
    launches: tuple[int, int, int, int] = (0, 0, 0, 0)  # gather, reduce, replicate's both
    ops: tuple[int, int, int, int] = (0, 0, 0, 0)  # the NCCL ops those launches hold
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
    # the shard group's part alone (every rank alike): launches, ops, bytes per direction
    shard: tuple[tuple[int, int, float], tuple[int, int, float]] = ((0, 0, 0.0), (0, 0, 0.0))
    hop: dict[int, tuple[float, float]] = field(default_factory=dict)  # shard rank -> bytes

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
    adamw_bytes: float  # bytes AdamW's element-wise update touches per step (7 per element)
    muon_bytes: float  # bytes Muon's momentum and update touch on the busiest rank (5 each)
    ns_seconds: float | None = None  # the busiest GPU's NS, its tp group's all-reduces in
    root_numel: int = 0  # elements of the root unit unsharded (its gradients kept unreduced)
    first_numel: int = 0  # the first block's, unsharded
    first_gathered: float = 0.0  # bytes of the first block's gather buffers


def hop_elements(u: UnitLayout, T: int) -> dict[int, int]:
    """The tp hop of each shard rank holding tp-split pieces: its tp group's busiest rank's
    elements in the one all-to-all (each tp rank holding matrices whole sends their slices
    to the ``T - 1`` others and receives theirs)."""
    if T == 1:
        return {}
    rows: dict[int, list[int]] = defaultdict(lambda: [0] * T)
    for pc in u.pieces:
        if pc.split:
            rows[pc.rank][pc.tp_owner] += pc.numel
    return {r: max(max((T - 1) * h, sum(held) - h) for h in held) for r, held in rows.items()}


def shard_ops(lay: UnitLayout, reduce: bool, itemsize: int) -> list[Op]:
    """The NCCL ops of one gather (``reduce`` False) or reduce of ``lay`` over its shard
    group, as the runtime issues them (:func:`~matrixfsdp.layout.units.calls`), each
    with its most loaded rank's bytes (:meth:`~matrixfsdp.layout.units.Call.load`)."""
    return [(c.kind, float(c.load(lay, 0, itemsize).critical)) for c in calls(lay, reduce)]


def replicate_ops(seg: Segment, R: int, itemsize: int, reduce: bool) -> list[Op]:
    """The replicate dim's ops of one shard rank's segment, as the runtime issues them: a
    reduce's (one all-reduce of the replicated run, then one reduce of each replica's run of
    matrices to that replica) or a broadcast's (one broadcast of each replica's non-empty
    run from it); each pipelined op's most loaded rank moves its run once."""
    ops: list[Op] = []
    if reduce and seg.shared:
        ops.append(("all_reduce", float(op_load("all_reduce", seg.shared * itemsize, R, 0).critical)))
    kind = "reduce" if reduce else "broadcast"
    return ops + [(kind, float(n * itemsize)) for _, _, n in seg.replica_runs]


def _rep_load(seg: Segment, grad_seg: Segment, R: int, owned: bool, g: GroupCost,
              d: Dtypes) -> RepLoad:
    """One shard rank's replicate-dim collectives of a unit: its reduce segment's
    (``grad_seg``) and its storage segment's (``seg``), over ``R`` replicas."""
    red = replicate_ops(grad_seg, R, d.reduce, True)
    bc = replicate_ops(seg, R, d.storage, False) if owned else []
    return RepLoad(g.ops(red), g.ops(bc), sum(b for _, b in red), sum(b for _, b in bc),
                   len(red), len(bc), g.launches(len(red)), g.launches(len(bc)))


def unit_comm(u: UnitLayout, red: UnitLayout, mesh: Mesh, mc: MeshCost, d: Dtypes) -> UnitComm:
    """This library's collectives of one unit (``u``: its layout, ``red``: its reduce
    layout): per direction the shard group's ops (one even collective and one per holder,
    one launch where the group coalesces), the tp hop (one all-to-all), and per shard rank
    its replicate-dim ops; each op charged at its own latency."""
    S, T, R = mesh.shard, mesh.tp, mesh.replicate
    c = UnitComm()
    if not u.numel:
        return c
    hops = hop_elements(u, T)
    hop = max(hops.values(), default=0)
    c.hop = {r: (n * d.gather, n * d.reduce) for r, n in hops.items()}
    mats = [pl for pl in u.placements if pl.spec.muon and pl.owner is not None]
    # what one GPU holds of each matrix (a slice where its tp group owns it), and the
    # matrices whose slices hop to one tp rank (held whole there)
    per_gpu = [pl.spec.numel // pl.spec.tp if pl.tp_group else pl.spec.numel for pl in mats]
    hopping = [pl.spec.numel for pl in mats if pl.spec.tp > 1 and not pl.tp_group]
    largest, total = max(per_gpu, default=0), sum(pl.spec.numel for pl in mats)
    hop_floor = (T - 1) * max(hopping, default=0) / T if T > 1 else 0.0
    pieces = sum(pc.numel for pc in u.pieces) if S > 1 else 0
    launches, ops, shard = [], [], []
    for lay, isz, attr in ((u, d.gather, "gather"), (red, d.reduce, "reduce")):
        mine = shard_ops(lay, attr == "reduce", isz) if S > 1 else []
        crit = sum(b for _, b in mine)
        setattr(c, attr, mc.shard.ops(mine) + mc.tp.all_to_all(hop * isz))
        setattr(c, attr + "_bytes", float(crit + hop * isz))
        setattr(c, "floor_" + attr + "_bytes",  # a reduce's flags: on every placement
                ((S - 1) * lay.head + pieces + hop_floor) * isz)
        shard.append((mc.shard.launches(len(mine)), len(mine), float(crit)))
        launches.append(shard[-1][0] + (1 if hop else 0))
        ops.append(len(mine) + (1 if hop else 0))
    c.shard = (shard[0], shard[1])
    c.launches = (launches[0], launches[1], 0, 0)
    c.ops = (ops[0], ops[1], 0, 0)
    if R > 1:
        g = mc.replicate
        owned = u.has_replica_owned
        keys = {(pc.rank, t) for pc in u.pieces
                for t in ((pc.tp_owner,) if pc.split else range(T))}
        seen: dict[tuple, RepLoad] = {}  # ranks whose segments have one shape share a load

        def load(k: tuple[int, int]) -> RepLoad:
            seg, gseg = u.segment(*k), red.segment(*k)
            shape = (seg.shared, gseg.shared, tuple((i, n) for i, _, n in seg.replica_runs),
                     tuple((i, n) for i, _, n in gseg.replica_runs))
            if shape not in seen:
                seen[shape] = _rep_load(seg, gseg, R, owned, g, d)
            return seen[shape]
        c.rep = {k: load(k) for k in keys}
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
        rr, rb = max(x.reduce_ops for x in loads), max(x.bcast_ops for x in loads)
        c.launches = (*c.launches[:2], g.launches(rr), g.launches(rb))
        c.ops = (*c.ops[:2], rr, rb)
    return c


def rank_counts(units: Sequence[UnitComm], shard_rank: int, tp_rank: int, m: int, pp: int = 1,
                keep: str = "each") -> dict[str, dict[str, float]]:
    """What one rank (``shard_rank``, ``tp_rank``) issues over a step of a stage's units (the
    root's first; ``m`` micro-batches, as :func:`step_bytes` counts them), per phase as its
    ``CommStats`` reads it (``gather``: the shard group's gathers and the tp hop; ``reduce``:
    the reduces and the gradients' tp hop; ``replicate``): launches, NCCL ops (``calls``) and
    critical bytes. The search's cost path, rank by rank."""
    out = {ph: {"launches": 0, "calls": 0, "critical_bytes": 0.0}
           for ph in ("gather", "reduce", "replicate")}

    def add(ph: str, times: int, launches: int, ops: int, nbytes: float) -> None:
        if times and ops:
            out[ph]["launches"] += times * launches
            out[ph]["calls"] += times * ops
            out[ph]["critical_bytes"] += times * nbytes
    for i, u in enumerate(units):
        gathers, reduces = passes_of(i, m, pp, keep, len(units))
        hop = u.hop.get(shard_rank)
        for ph, times, (launches, ops, nbytes), k in (("gather", gathers, u.shard[0], 0),
                                                      ("reduce", reduces, u.shard[1], 1)):
            add(ph, times, launches, ops, nbytes)
            if hop:
                add(ph, times, 1, 1, hop[k])
        r = u.rep_at((shard_rank, tp_rank)) if u.rep or u.bare != RepLoad() else RepLoad()
        add("replicate", reduces, r.reduce_launches, r.reduce_ops, r.reduce_bytes)
        add("replicate", 1, r.bcast_launches, r.bcast_ops, r.bcast_bytes)
    return {ph: v for ph, v in out.items() if v["calls"]}


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
    one = (int(S > 1), int(S > 1), int(R > 1), 0)
    c = UnitComm(state_bytes=float(state * d.storage), launches=one, ops=one)
    for isz, attr in ((d.gather, "gather"), (d.reduce, "reduce")):
        setattr(c, attr, mc.shard.ring(S * shard * isz))
        setattr(c, attr + "_bytes", float((S - 1) * shard * isz))
    if R > 1:
        c.bare = RepLoad(mc.replicate.all_reduce(shard * d.reduce), 0.0,
                         2 * (R - 1) / R * shard * d.reduce, 0.0, 1, 0)
        c.rep_reduce, c.rep_reduce_bytes = c.bare.reduce, c.bare.reduce_bytes
    return c


#: Which units a step of several micro-batches keeps gathered (``fully_shard``'s FSDP2
#: methods, docs/plan.md): ``"each"``: none, every unit gathered and reduced per micro-batch
#: (the runtime's default); ``"root"``: the root gathered once and reduced once per step;
#: ``"edges"``: the root and the first block so, and the last block kept gathered from its
#: forward to its backward (no regather).
KEEPS = ("each", "root", "edges")


def passes_of(i: int, m: int, pp: int = 1, keep: str = "each", n: int = 0) -> tuple[int, int]:
    """(gathers, reduces) of unit ``i`` of ``n`` (0: the root) per step of ``m``
    micro-batches: each micro-batch a forward gather, a backward gather (not the root's,
    kept to its backward) and a reduce; ``pp > 1`` one of each per step; ``keep``
    (:data:`KEEPS`): the units kept gathered, gathered and reduced fewer times."""
    if pp > 1:
        return 1, 1
    if i == 0:
        return (m, m) if keep == "each" else (1, 1)
    if keep == "edges":
        if i == 1:
            return 1, 1
        if i == n - 1:
            return m, m
    return 2 * m, m


def step_bytes(units: Sequence[UnitComm], m: int, pp: int = 1, prefix: str = "",
               keep: str = "each") -> tuple[float, float]:
    """(critical-path bytes per step, of which across replicas) of a stage's units (the
    root's first): ``m`` micro-batches, each a forward gather, a backward gather (not the
    root's), a reduce and the replicate dim's reduce, then the replicate dim's broadcast
    once; ``pp > 1``: every unit gathered and reduced once per step; ``keep``: units kept
    gathered (:func:`passes_of`).
    ``prefix`` ``"floor_"``: the whole-matrix floor's."""
    total = rep = 0.0
    for i, u in enumerate(units):
        gathers, reduces = passes_of(i, m, pp, keep, len(units))
        r = (reduces * getattr(u, prefix + "rep_reduce_bytes")
             + getattr(u, prefix + "rep_bcast_bytes"))
        total += (gathers * getattr(u, prefix + "gather_bytes")
                  + reduces * getattr(u, prefix + "reduce_bytes") + r)
        rep += r
    return total, rep


@dataclass
class NSLoads:
    """A plan's Newton-Schulz: the busiest GPU's FLOPs (where a tp group owns matrices: the
    busiest tp group's, whose ranks wait for each other at every Gram all-reduce), the bound
    ``max(largest, total / GPUs)`` (each matrix at its placement's FLOPs per GPU), every
    matrix once (whole), and per matrix (each expert counted) its whole NS FLOPs, elements,
    shape, unit and tp split (0: rows, 1: columns, None: not split): the peers' inputs.
    ``busiest``: the busiest GPU's largest matrix (name, shape) and its FLOPs on that GPU.
    ``seconds``: the busiest GPU's NS in seconds (its FLOPs at the NS rate, plus the Gram and
    norm all-reduces of matrices its tp group owns), where :func:`ns_loads` was given a rate.
    ``placements``: how many tp-split matrices each placement got (``"group"``: owned by a
    tp group, ``"rank"``: whole on one tp rank), and per matrix name (block index as ``*``)
    its placement."""

    max: float
    bound: float
    total: float
    costs: list[float]
    numel: list[int]
    shapes: list[tuple[int, int]] = field(default_factory=list)
    units: list[int] = field(default_factory=list)
    tp_dims: list[int | None] = field(default_factory=list)
    busiest: tuple[str, tuple[int, int], float] = ("", (0, 0), 0.0)
    seconds: float | None = None
    ns_comm: float = 0.0  # of ``seconds``: the busiest tp group's all-reduces
    placements: dict[str, int] = field(default_factory=dict)
    by_name: dict[str, str] = field(default_factory=dict)


def generic_name(name: str) -> str:
    """A parameter's name with its block indices as ``*`` (``layers.*.mlp.fc.weight``)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


SplitKey = tuple[tuple[int, ...], tuple[int, int], int]  # (slice shape, whole shape, dim)


def split_ns_ops(slices: dict[SplitKey, int], ns_steps: int, gram_itemsize: int = 4
                 ) -> list[int]:
    """The bytes of each all-reduce one tp group runs for the matrices it owns, as ``Muon``
    steps them (``Muon._split_step``, :func:`~matrixfsdp.optim.newton_schulz.newton_schulz_split_`):
    same-shaped slices batched (``BATCH_NS_NUMEL`` elements a batch), per batch one
    all-reduce of the squares' sums (a float32 per matrix), then ``ns_steps`` of the
    batch's ``g x g`` Grams (:func:`~matrixfsdp.layout.assign.gram_side`), summed in
    float32 (``gram_itemsize``) whatever the NS dtype; each op a launch of its own."""
    out: list[int] = []
    for (sl, shape, dim), count in slices.items():
        per = max(1, BATCH_NS_NUMEL // math.prod(sl))
        g = gram_side(shape, dim)
        for at in range(0, count, per):
            k = min(per, count - at)
            out += [4 * k] + [k * g * g * gram_itemsize] * ns_steps
    return out


def split_slices(plan: Plan, owner: int) -> dict[SplitKey, int]:
    """The matrices ``owner``'s tp group owns, by :data:`SplitKey`: how many of each."""
    out: dict[SplitKey, int] = defaultdict(int)
    for pl in plan.placements.values():
        if pl.spec.muon and pl.owner == owner and pl.tp_group:
            out[(pl.spec.slice_shape, tuple(pl.spec.shape), pl.spec.tp_dim)] += 1
    return out


def step_counts(plan: Plan, owner: int, T: int, tp_rank: int = 0) -> dict[str, dict[str, float]]:
    """What a rank of ``owner``'s tp group (``T`` ranks) issues in the optimizer step, as its
    ``CommStats`` reads it (phase ``step``: the split Newton-Schulz's all-reduces): launches,
    ops and critical bytes; empty where its tp group owns no matrix."""
    ops = split_ns_ops(split_slices(plan, owner), plan.ns_steps)
    if not ops or T == 1:
        return {}
    crit = sum(op_load("all_reduce", b, T, tp_rank).critical for b in ops)
    return {"step": {"launches": len(ops), "calls": len(ops), "critical_bytes": float(crit)}}


def ns_loads(plan: Plan, T: int, rate: float | None = None, tp: GroupCost | None = None
             ) -> NSLoads:
    """:class:`NSLoads` of a plan whose matrices may be tp-split: held whole by one tp rank
    (``tp_owner``) or by the owner's tp group (each tp rank its slice,
    :func:`~matrixfsdp.layout.assign.ns_flops_split` on each). ``rate`` (FLOP/s) and ``tp``
    (the tp group's costs): also the busiest GPU's seconds. A tp group steps the matrices its
    ranks own whole first, then the ones it owns together (``Muon._muon_step``'s order),
    whose all-reduces wait for every rank of the group: so a tp group's NS is its most
    loaded rank's whole matrices, then the shared part and its all-reduces."""
    whole: dict[tuple[int, int], float] = defaultdict(float)  # (owner, tp rank): FLOPs
    shared: dict[int, float] = defaultdict(float)  # owner: FLOPs of its group-owned share
    slices: dict[int, dict[SplitKey, int]] = defaultdict(lambda: defaultdict(int))
    top: dict[int, tuple[float, str, tuple[int, int]]] = {}
    costs, numel, shapes, units, dims = [], [], [], [], []
    placed: dict[str, int] = defaultdict(int)
    by_name: dict[str, str] = {}
    work = 0.0  # FLOPs summed over every GPU that runs them
    largest = 0.0
    for pl in plan.placements.values():
        if not pl.spec.muon:
            continue
        f = ns_flops(pl.spec.matrix_shape, plan.ns_steps)
        n = pl.spec.matrices
        shape = tuple(pl.spec.matrix_shape)
        costs += [float(f)] * n
        numel += [math.prod(pl.spec.matrix_shape)] * n
        shapes += [shape] * n
        units += [pl.spec.unit] * n
        dims += [pl.spec.tp_dim if pl.spec.tp > 1 else None] * n
        here = pl.ns_cost(plan.ns_steps)  # on each GPU that runs it
        gpus = pl.spec.tp if pl.tp_group else 1
        work += here * gpus * n * (plan.replicas if pl.spec.is_experts else 1)
        largest = max(largest, here)
        if pl.spec.tp > 1 and pl.owner is not None:
            kind = "group" if pl.tp_group else "rank"
            placed[kind] += 1
            by_name[generic_name(pl.spec.name)] = kind
        if pl.owner is None:
            continue
        if pl.tp_group:
            shared[pl.owner] += here
            slices[pl.owner][(pl.spec.slice_shape, shape, pl.spec.tp_dim)] += 1
        else:
            whole[(pl.owner, pl.tp_owner or 0)] += here
        if here > top.get(pl.owner, (-1.0,))[0]:
            top[pl.owner] = (float(here), pl.spec.name, shape)
    # per owner (a data-parallel rank and its tp group): its busiest tp rank's whole
    # matrices, then the group's share; T == 1: the plan's own per-rank cost (experts too)
    first: dict[int, float] = defaultdict(float)
    for (w, _), f in whole.items():
        first[w] = max(first[w], f)
    if T > 1:
        flops = {w: first[w] + shared[w] for w in set(first) | set(shared)}
    else:
        flops = dict(enumerate(plan.rank_cost))
    comm = {w: sum(tp.all_reduce(float(b)) for b in split_ns_ops(slices[w], plan.ns_steps))
            if tp is not None else 0.0 for w in slices}

    def seconds(w: int) -> float:
        return flops.get(w, 0.0) / rate + comm.get(w, 0.0) if rate else flops.get(w, 0.0)
    key = max(flops, key=lambda w: (seconds(w), flops[w], -w), default=None)
    busiest = flops[key] if key is not None else 0.0
    named = ("", (0, 0), 0.0) if key not in top else (top[key][1], top[key][2], top[key][0])
    bound = max(largest, work / (plan.world_size * T))
    return NSLoads(float(busiest), float(bound), float(sum(costs)), costs, numel, shapes, units,
                   dims, named, seconds(key) if rate and key is not None else None,
                   comm.get(key, 0.0) if key is not None else 0.0, dict(placed), by_name)


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
