"""One unit's collectives per pass, this library's and FSDP2's: seconds on the links and bytes
on the critical path, over the shard group, the tp hop and the replicate group.

The collectives are the ops the runtime issues (:func:`~matrixfsdp.layout.units.calls`: per
unit and direction one even collective and one broadcast / reduce per holder over the shard
group, one launch where the group coalesces; the tp hop's all-to-all; over the replicate
group each shard rank's own all-reduce and per-replica reduces / broadcasts), each charged
its own latency at its group's size (:mod:`~matrixfsdp.costs.links`). A stage holds its
units' (:mod:`~matrixfsdp.costs.layout_costs`); a step's passes count them
(:mod:`~matrixfsdp.costs.passes`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..layout.loads import op_load
from ..layout.traffic import Dtypes
from ..layout.units import Segment, UnitLayout, calls
from .links import GroupCost, Mesh, MeshCost, Op


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
