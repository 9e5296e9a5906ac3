"""Where every parameter lives: the Plan.

Pure Python over shapes. Nothing here touches tensor data or ``torch.distributed``, so a
model built on the meta device plans in seconds for any world size.

Two kinds of parameter:

* **Muon matrices** live whole on one owner rank. The owner is chosen over all units at
  once so that the largest per-rank Newton-Schulz cost is as small as possible. A 3-D
  Muon parameter ``(experts, m, n)`` (fused MoE expert weights) is a stack of ``experts``
  Muon matrices: each expert is placed like any matrix, whole on one rank, and since the
  experts of one parameter are interchangeable, rank r gets a contiguous range of them
  (``row_ranges[r]`` along dim 0), as many as the assignment gave it.
* **Even parameters** (everything else: embeddings, head, norms, biases) are split by
  rows (dim 0) over all ranks as FSDP2's ``Shard(0)``: chunks of ``ceil(rows / P)`` rows,
  the last ranks' chunks short or empty. Storage pads every chunk to full size, so each
  rank stores the same bytes of them and the gather is one even all-gather.

A parameter with a zero-size dimension (``(0, n)``, ``(m, 0)``) holds no element: there
is nothing to orthogonalise, gather or reduce. It is never a Muon matrix, even where a
``muon_filter`` selects it (Muon on it would be a no-op, so the choice changes no number):
it is planned as an even parameter whose shards are all empty.

HSDP (``replicas x shard_size`` world ranks, docs/hsdp.md): storage is planned over the
``shard_size`` ranks of a shard group, identically in every replica (``row_ranges`` has
``shard_size`` entries), while each 2-D Muon matrix's ``owner`` is a *world* rank
``replica * shard_size + shard_rank``: it is stored whole on shard rank ``owner %
shard_size`` of every replica, and only replica ``owner // shard_size`` runs its NS. The
owners are balanced over all world ranks, so NS work per rank is ~ total / world size.
Expert stacks are planned over the shard group and run on every replica.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import nn

from .assign import ns_flops, ns_flops_split

MuonFilter = Callable[[str, nn.Parameter], bool]


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one parameter.

    ``name`` is the fully qualified name under the root module, ``unit`` the index of the
    communication unit (one ``fully_shard`` call) that holds it.
    """

    name: str
    shape: tuple[int, ...]
    itemsize: int
    unit: int
    muon: bool
    # Tensor parallelism: a Muon matrix split over ``tp`` ranks along dim ``tp_dim`` of
    # ``shape`` (the whole logical matrix); in forward every tp rank computes with its 1/tp
    # slice. Owned by one tp rank (held whole there) or by its tp group (each tp rank holds
    # its slice): :attr:`Placement.tp_owner` (docs/nd-parallel.md). 1: not split.
    tp: int = 1
    tp_dim: int = 0

    @functools.cached_property  # specs are frozen; planning 16k-rank layouts reads it often
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def rows(self) -> int:
        """Length of dim 0 (a 0-d parameter counts as one row)."""
        return self.shape[0] if self.shape else 1

    @functools.cached_property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def slice_numel(self) -> int:
        """Elements of one tp rank's slice (what travels over the data-parallel ranks)."""
        return self.numel // self.tp

    @property
    def slice_shape(self) -> tuple[int, ...]:
        """The shape of one tp rank's slice (``shape`` itself where ``tp`` is 1)."""
        return tuple(n // self.tp if d == self.tp_dim else n for d, n in enumerate(self.shape))

    @property
    def is_experts(self) -> bool:
        """A 3-D Muon parameter: a stack of ``shape[0]`` expert matrices."""
        return self.muon and len(self.shape) == 3

    @property
    def matrices(self) -> int:
        """How many Muon matrices this parameter holds (0 for an AdamW parameter)."""
        return self.shape[0] if self.is_experts else int(self.muon)

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        """``(m, n)`` of each Muon matrix: the last two dims."""
        return tuple(self.shape[-2:])


@dataclass
class Placement:
    """Where one parameter lives.

    Muon matrices: ``owner`` is the (world) rank running its NS; ``row_ranges[r]`` is the
    whole range on shard rank ``owner % shard_size`` and empty elsewhere (without HSDP the
    world is one shard group, so ``owner`` is simply the rank holding it whole). Expert
    stacks ``(experts, m, n)``: ``owner`` is None and ``row_ranges[r]`` is the contiguous
    range of whole experts shard rank r holds (possibly empty). Even parameters: ``owner``
    is None and ``row_ranges[r] = (start, stop)`` is shard rank r's slice of dim 0.
    """

    spec: ParamSpec
    owner: int | None
    row_ranges: list[tuple[int, int]]
    # a tp-split matrix: the tp rank holding it whole (its tp group's slices travel to and
    # from it), or None: owned by the tp group, each tp rank holding its own slice
    tp_owner: int | None = None
    # a tp rank's slice of a group-owned matrix split along dim 1, in the whole matrix:
    # its columns [a, b) (its rows are row_ranges'); None: every column
    cols: tuple[int, int] | None = None

    @property
    def tp_group(self) -> bool:
        """A tp-split Muon matrix owned by its tp group: each tp rank holds and steps its
        slice, the Newton-Schulz runs over the group (``tp_ownership="group"``)."""
        return self.spec.tp > 1 and self.tp_owner is None

    def local_rows(self, rank: int) -> int:
        start, stop = self.row_ranges[rank]
        return stop - start

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of rank's local tensor: the full shape on the owner, ``(0, *rest)``
        where a rank holds no rows, and ``(rows, *rest)`` for an even shard."""
        if not self.spec.shape:  # 0-d: the one "row" lives on a single rank
            return () if self.local_rows(rank) else (0,)
        if self.cols is not None:
            return (self.local_rows(rank), self.cols[1] - self.cols[0])
        return (self.local_rows(rank), *self.spec.shape[1:])

    @property
    def owner_shard(self) -> int | None:
        """The shard rank that stores this 2-D Muon matrix (None for other parameters)."""
        return None if self.owner is None else self.owner % len(self.row_ranges)

    @property
    def owner_replica(self) -> int | None:
        """The replica whose copy of this 2-D Muon matrix is stepped (HSDP; 0 without)."""
        return None if self.owner is None else self.owner // len(self.row_ranges)

    @property
    def whole_on_one_rank(self) -> bool:
        """Whether the tensor is whole on one rank (a Muon matrix on its owner, or a tensor
        all of whose rows one rank holds): decided from the plan alone, so every rank
        answers alike."""
        if self.owner is not None:
            return not self.tp_group  # a group-owned matrix: a slice on each tp rank
        return sum(stop > start for start, stop in self.row_ranges) <= 1

    def for_tp_rank(self, tp_rank: int) -> Placement:
        """This placement as tp rank ``tp_rank`` sees its own storage: a tp-split matrix
        owned by one tp rank is whole on its owner shard at tp rank ``tp_owner`` only, and
        held nowhere else; one owned by its tp group is, on every tp rank, a matrix of the
        slice's shape on the owner shard (what that tp rank stores, moves and steps)."""
        if self.spec.tp == 1 or self.tp_owner == tp_rank:
            return self
        if self.tp_group:
            spec = replace(self.spec, shape=self.spec.slice_shape, tp=1, tp_dim=0)
            rows = spec.rows
            return Placement(spec, self.owner, [(0, rows) if b > a else (0, 0)
                                                for a, b in self.row_ranges])
        return Placement(self.spec, self.owner, [(0, 0)] * len(self.row_ranges), self.tp_owner)

    def ns_cost(self, ns_steps: int = 5) -> int:
        """NS FLOPs of one of its matrices on each GPU that runs it: the whole NS on its
        owner (one tp rank), or each tp rank's share where its tp group owns it."""
        if self.tp_group:
            return ns_flops_split(self.spec.matrix_shape, self.spec.tp, self.spec.tp_dim, ns_steps)
        return ns_flops(self.spec.matrix_shape, ns_steps)

    def matrices_on(self, rank: int) -> int:
        """How many whole Muon matrices shard rank ``rank`` holds of this parameter."""
        if self.spec.is_experts:
            return self.local_rows(rank)
        return int(self.spec.muon and self.owner_shard == rank)


@dataclass
class Plan:
    """The single source of truth on where parameters live, for one world size.

    ``world_size`` counts all ranks (``replicas x shard_size`` under HSDP); ``rank_cost``
    and ``rank_bytes`` are per world rank (NS FLOPs it runs, bytes it holds).
    """

    world_size: int
    unit_names: list[str]
    placements: dict[str, Placement]  # in unit order, then module order
    ns_steps: int = 5
    rank_cost: list[int] = field(default_factory=list)
    rank_bytes: list[int] = field(default_factory=list)
    replicas: int = 1

    @property
    def shard_size(self) -> int:
        """Ranks per shard group: the ranks a unit's flat buffer is split over."""
        return self.world_size // self.replicas

    def unit_params(self, unit: int) -> list[Placement]:
        return [pl for pl in self.placements.values() if pl.spec.unit == unit]

    @property
    def muon_costs(self) -> list[int]:
        """NS cost of every Muon matrix on the GPU that runs it (on each of them, for a
        matrix its tp group owns), each expert of an expert stack counted once."""
        return [pl.ns_cost(self.ns_steps) for pl in self.placements.values()
                for _ in range(pl.spec.matrices)]

    @property
    def lower_bound(self) -> float:
        """No assignment of whole matrices can beat ``max(largest matrix, total / P)``
        (under HSDP, expert NS runs on every replica: counted ``replicas`` times)."""
        costs = self.muon_costs
        if not costs:
            return 0.0
        work = sum(pl.ns_cost(self.ns_steps) * pl.spec.matrices
                   * (self.replicas if pl.spec.is_experts else 1)
                   for pl in self.placements.values() if pl.spec.muon)
        return max(max(costs), work / self.world_size)

    @property
    def imbalance(self) -> float:
        """Largest per-rank NS cost over the mean (1.0 is perfect)."""
        total = sum(self.rank_cost)
        return max(self.rank_cost) * self.world_size / total if total else 1.0

    @property
    def imbalance_bound(self) -> float:
        """The best imbalance any whole-matrix assignment could reach."""
        total = sum(self.rank_cost)
        return self.lower_bound * self.world_size / total if total else 1.0
