"""A plan's Newton-Schulz per GPU: the busiest GPU's FLOPs and seconds against their bound,
every matrix's FLOPs, elements and shape (the peers' inputs), and the all-reduces a tp group
runs for the matrices it owns together.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from ..layout.assign import gram_side, ns_flops
from ..layout.types import Plan
from ..optim.muon import BATCH_NS_NUMEL
from .links import GroupCost


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
