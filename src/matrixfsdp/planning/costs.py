"""What a plan costs per rank: memory, bytes per training step against FSDP2's, NS FLOPs.

Pure arithmetic over a :class:`~matrixfsdp.planning.types.Plan` (no tensors, no
``torch.distributed``), so a 405B model plans and is costed for 16384 ranks in seconds.

**Communication model** (NCCL's algorithms; the runtime's counters charge the same, through
:func:`unit_traffic` and :func:`replica_traffic`). Bytes are per direction: under these
algorithms a rank sends about what it receives, and a collective is charged
``max(sent, received)`` of its most loaded rank (it ends when that rank is done).

* Shard dim, one *phase* (a unit's gather, or its gradient reduce) over a shard group of
  ``P`` ranks: the replicated part (even parameters and expert stacks, split by rows) is one
  ring all-gather / reduce-scatter of ``P x E`` elements, ``E`` the largest rank's part
  (the others padded to it): every rank moves ``(P-1) E``. Each owner ``o``'s whole
  matrices (``m_o`` elements) are one pipelined broadcast from ``o`` / reduce to ``o``:
  every rank moves about ``m_o``. The most loaded rank: ``(P-1) E + sum_o m_o``.
  FSDP2 pads every parameter to ``ceil(rows / P)`` rows: ``(P-1) x sum ceil(rows_i/P) x
  row_numel_i``.
* Replicate dim (HSDP, ``R`` replicas, once per step, after the gradient reduce): the
  replicated part is all-reduced (ring: ``2 (R-1)/R e_r`` on shard rank r), each matrix is
  reduced to its owner replica and, after the step, broadcast from it (``m_r`` each,
  pipelined). FSDP2's HSDP all-reduces its padded shard: ``2 (R-1)/R`` of it.
* A training step: forward gather, backward gather (every unit but the root, which keeps
  its parameters from forward to backward), gradient reduce, per unit; plus the replicate
  dim. Gathers and reduces in the parameters' dtype (the report says which).

**Memory** per world rank (the parameters' dtype): parameters (its shard rank's rows and
whole matrices), gradients (rows, experts, and the 2-D matrices it owns: under HSDP only
the owner replica gets a matrix's gradient), optimizer state (Muon momentum on owned
matrices and on its experts, AdamW ``exp_avg`` + ``exp_avg_sq`` on its rows). Transient
gather buffers: the root unit (gathered from forward to backward) plus two of the largest
other unit (the one computing and the one prefetched); activations are not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .types import Placement, Plan


def _replicated_elements(placements: Sequence[Placement], P: int,
                         memo: dict[int, list[tuple[int, int]]] | None = None) -> list[int]:
    """Per shard rank: elements of the row-split parameters (even ones, expert stacks).

    ``memo`` (id of a ``row_ranges`` list -> its ranks off the even split) saves the scan
    of the P ranks for the parameters that share one list (all norms of a model)."""
    memo = {} if memo is None else memo
    base, delta = 0, [0] * P
    for pl in placements:
        if pl.owner is not None:
            continue
        rn, b = pl.spec.row_numel, pl.spec.rows // P
        base += b * rn
        key = id(pl.row_ranges)
        if key not in memo:
            memo[key] = [(r, hi - lo - b) for r, (lo, hi) in enumerate(pl.row_ranges)
                         if hi - lo != b]
        for r, d in memo[key]:
            delta[r] += d * rn
    return [base + d for d in delta]


def _matrix_elements(placements: Sequence[Placement], P: int) -> list[int]:
    """Per shard rank: elements of the whole 2-D matrices it stores."""
    held = [0] * P
    for pl in placements:
        if pl.owner is not None:
            held[pl.owner_shard] += pl.spec.numel
    return held


def _itemsize(placements: Sequence[Placement], itemsize: int | None) -> int:
    return itemsize or (placements[0].spec.itemsize if placements else 4)


def _phase(placements: Sequence[Placement], P: int, memo: dict | None = None
           ) -> tuple[int, float]:
    """(most loaded rank, mean rank) elements of one gather or reduce of a unit."""
    if P <= 1 or not placements:
        return 0, 0.0
    E = max(_replicated_elements(placements, P, memo))
    M = sum(_matrix_elements(placements, P))
    return (P - 1) * E + M, (P - 1) * E + (P - 1) / P * M


def _replica(placements: Sequence[Placement], S: int, R: int, memo: dict | None = None
             ) -> tuple[float, float]:
    """(most loaded rank, mean rank) elements a unit moves across the replicas per step."""
    if R <= 1 or not placements:
        return 0, 0.0
    even = _replicated_elements(placements, S, memo)
    mats = _matrix_elements(placements, S)
    ring = 2 * (R - 1) / R
    return ring * max(even) + 2 * max(mats), (ring * sum(even) + ring * sum(mats)) / S


def unit_traffic(placements: Sequence[Placement], shard_size: int,
                 itemsize: int | None = None) -> int:
    """Bytes the most loaded rank of a shard group moves (per direction) in one gather or
    gradient reduce of a unit: ``(P-1) E + sum_o m_o`` elements (module docstring).

    ``itemsize``: bytes per element on the wire (default: the parameters'; pass the
    mixed-precision dtype's for a gather in ``param_dtype``)."""
    return _phase(placements, shard_size)[0] * _itemsize(placements, itemsize)


def fsdp2_unit_traffic(placements: Sequence[Placement], shard_size: int,
                       itemsize: int | None = None) -> int:
    """FSDP2's bytes per rank for the same unit's all-gather or reduce-scatter: every
    parameter padded to ``ceil(rows / P)`` rows, ring algorithm, ``(P-1)`` shards."""
    P = shard_size
    shard = sum(-(-pl.spec.rows // P) * pl.spec.row_numel for pl in placements)
    return (P - 1) * shard * _itemsize(placements, itemsize)


def replica_traffic(placements: Sequence[Placement], shard_size: int, replicas: int,
                    itemsize: int | None = None) -> int:
    """HSDP: bytes the most loaded rank moves across replicas per step for one unit: the
    all-reduce of the replicated part, the reduce of the matrices to their owner replica
    and their broadcast back (each charged at its own most loaded rank)."""
    return round(_replica(placements, shard_size, replicas)[0] * _itemsize(placements, itemsize))


def fsdp2_replica_traffic(placements: Sequence[Placement], shard_size: int, replicas: int,
                          itemsize: int | None = None) -> int:
    """FSDP2's HSDP: the ring all-reduce of its padded shard across the replicas."""
    R = replicas
    if R <= 1:
        return 0
    shard = sum(-(-pl.spec.rows // shard_size) * pl.spec.row_numel for pl in placements)
    return round(2 * (R - 1) / R * shard * _itemsize(placements, itemsize))


@dataclass(frozen=True)
class Spread:
    """A per-rank quantity: its largest value and its mean over the world ranks."""

    max: float
    mean: float

    @property
    def ratio(self) -> float:
        return self.max / self.mean if self.mean else 1.0

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(max(values), sum(values) / len(values))


@dataclass
class StepBytes:
    """Bytes per training step (per direction): MatrixFSDP's on the critical path (each
    collective's most loaded rank, summed) and its mean rank's; FSDP2's (every rank alike);
    the replicate dim's share of each (HSDP)."""

    ours: int
    ours_mean: float
    fsdp2: int
    ours_replicate: int = 0
    fsdp2_replicate: int = 0
    # the busiest shard rank's own replicate-dim bytes summed over the step: what those
    # collectives would cost issued for all units at once (each unit's alone waits on the
    # rank holding its largest matrix)
    replicate_busiest: int = 0

    @property
    def ratio(self) -> float:
        return self.ours / self.fsdp2 if self.fsdp2 else 1.0


@dataclass
class PlanCosts:
    """Per world rank: memory (bytes), NS FLOPs; per step: bytes on the critical path."""

    world_size: int
    shard_size: int
    params: Spread
    grads: Spread
    optim: Spread
    state: Spread  # params + grads + optimizer state, summed per rank
    buffers: int  # transient gather buffers (module docstring)
    ns: Spread
    ns_bound: float  # max(largest matrix, total / world): what no assignment beats
    step: StepBytes
    bare_shard_ranks: int  # shard ranks that hold no Muon matrix

    @property
    def peak(self) -> float:
        """The largest rank's model state plus the gather buffers (no activations)."""
        return self.state.max + self.buffers

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size


def _units(plan: Plan) -> list[list[Placement]]:
    units: list[list[Placement]] = [[] for _ in plan.unit_names]
    for pl in plan.placements.values():
        units[pl.spec.unit].append(pl)
    return units


def step_bytes(plan: Plan, gather_itemsize: int | None = None) -> StepBytes:
    """Bytes per training step, this plan's and FSDP2's: per unit a forward gather, a
    backward gather (not the root's: it keeps its parameters), a gradient reduce, and
    under HSDP the replicate dim. ``gather_itemsize``: the gathers' bytes per element
    (mixed precision's ``param_dtype``; default the parameters'); the rest moves in the
    parameters' dtype."""
    S, R = plan.shard_size, plan.replicas
    step, memo = StepBytes(0, 0.0, 0), {}
    per_rank = [0.0] * S  # replicate-dim bytes of each shard rank, summed over units
    for ui, pls in enumerate(_units(plan)):
        if not pls:
            continue
        isz, gsz = pls[0].spec.itemsize, gather_itemsize or pls[0].spec.itemsize
        gathers = 1 if ui == 0 else 2
        (n, n_mean), (rep, rep_mean) = _phase(pls, S, memo), _replica(pls, S, R, memo)
        rep, rep_mean = round(rep * isz), rep_mean * isz
        fsdp2_rep = fsdp2_replica_traffic(pls, S, R)
        step.ours += n * (gathers * gsz + isz) + rep
        step.ours_mean += n_mean * (gathers * gsz + isz) + rep_mean
        step.fsdp2 += (gathers * fsdp2_unit_traffic(pls, S, gsz) + fsdp2_unit_traffic(pls, S)
                       + fsdp2_rep)
        step.ours_replicate += rep
        step.fsdp2_replicate += fsdp2_rep
        if R > 1:
            for r, (e, m) in enumerate(zip(_replicated_elements(pls, S, memo),
                                           _matrix_elements(pls, S))):
                per_rank[r] += (2 * (R - 1) / R * e + 2 * m) * isz
    step.replicate_busiest = round(max(per_rank))
    return step


def _gather_buffers(plan: Plan, gather_itemsize: int | None) -> int:
    full = [0] * len(plan.unit_names)
    for pl in plan.placements.values():
        full[pl.spec.unit] += pl.spec.numel * (gather_itemsize or pl.spec.itemsize)
    return full[0] + 2 * max(full[1:], default=0)


def _memory(plan: Plan) -> tuple[list[int], list[int], list[int], int]:
    """Per world rank: parameter, gradient and optimizer-state bytes; and how many shard
    ranks store no Muon matrix."""
    N, S = plan.world_size, plan.shard_size
    stored, experts, owned = [0] * S, [0] * S, [0] * N
    for pl in plan.placements.values():
        if pl.owner is not None:
            stored[pl.owner_shard] += pl.spec.nbytes
            owned[pl.owner] += pl.spec.nbytes
        elif pl.spec.is_experts:
            row_bytes = pl.spec.row_numel * pl.spec.itemsize
            for r in range(S):
                experts[r] += pl.local_rows(r) * row_bytes
    even = [plan.rank_bytes[r] - stored[r] - experts[r] for r in range(S)]
    grads = [even[w % S] + experts[w % S] + owned[w] for w in range(N)]
    optim = [owned[w] + experts[w % S] + 2 * even[w % S] for w in range(N)]
    bare = sum(1 for r in range(S) if not stored[r] and not experts[r])
    return plan.rank_bytes, grads, optim, bare


def plan_costs(plan: Plan, gather_itemsize: int | None = None) -> PlanCosts:
    """Memory, NS FLOPs and bytes per step of ``plan`` (the module docstring's model);
    ``gather_itemsize`` as in :func:`step_bytes`."""
    params, grads, optim, bare = _memory(plan)
    state = [p + g + o for p, g, o in zip(params, grads, optim)]
    return PlanCosts(plan.world_size, plan.shard_size, Spread.of(params), Spread.of(grads),
                     Spread.of(optim), Spread.of(state), _gather_buffers(plan, gather_itemsize),
                     Spread.of(plan.rank_cost), plan.lower_bound,
                     step_bytes(plan, gather_itemsize), bare)
