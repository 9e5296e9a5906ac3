"""Flat-buffer layout of one communication unit. Pure data and index arithmetic.

A unit's unsharded parameters live in one flat buffer, **rank-major**: rank 0's segment,
then rank 1's, and so on. Rank r's segment holds, in the unit's parameter order, the
rows of each parameter that r holds (whole Muon matrices on their owner, a row slice of
every even parameter). So:

* a gather-v writes each rank's segment straight into its place (no padding, no copy-in);
* a whole Muon matrix is one contiguous run of the buffer, so its unsharded tensor is a
  view (no copy-out);
* an even parameter is P row slices spread over the segments, copied out into a tensor
  of its own (these are the small ones: norms, biases; and the root's embeddings/head).
* an expert stack ``(experts, m, n)`` is, like an even parameter, one contiguous range of
  whole experts per rank (dim-0 rows), so it is copied out the same way; where one rank
  holds all of its experts it is a view, like a 2-D matrix.

Under HSDP the buffer is split over the shard group's ranks, and within each segment the
pieces are grouped by what happens to them across replicas: first the *replicated* pieces
(even parameters, experts: all-reduced across replicas), then the 2-D matrices stepped by
replica 0, then those of replica 1, ...: each group is one contiguous run
(``replica_runs``), so it crosses the replicate dimension in one collective.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, field
from typing import Any

from .plan import Placement, Plan


@dataclass(frozen=True)
class Piece:
    """Rows ``[row_start, row_stop)`` of one parameter, at ``offset`` in the flat buffer."""

    rank: int
    offset: int
    numel: int
    row_start: int
    row_stop: int


@dataclass
class UnitLayout:
    """Segments of one unit: ``seg_sizes[r]`` elements of rank r at ``seg_offsets[r]``."""

    names: list[str]
    placements: list[Placement]
    seg_sizes: list[int]
    seg_offsets: list[int]
    pieces: list[list[Piece]]  # per parameter, the non-empty pieces in rank order
    # HSDP only: per shard rank, ``replicas + 1`` runs ``(start, numel)`` relative to its
    # segment: the replicated pieces, then the matrices stepped by replica 0, 1, ...
    replica_runs: list[list[tuple[int, int]]] | None = None
    _local: dict[int, list[tuple[int, Piece]]] = field(default_factory=dict, repr=False)
    _subsets: dict[tuple[bool, ...], tuple[UnitLayout, list[int]]] = field(
        default_factory=dict, repr=False)

    @property
    def numel(self) -> int:
        return sum(self.seg_sizes)

    def whole_on_one_rank(self, i: int) -> bool:
        return len(self.pieces[i]) == 1 and self.pieces[i][0].numel == self.placements[i].spec.numel

    def local_pieces(self, rank: int) -> list[tuple[int, Piece]]:
        """(parameter index, piece) for the pieces rank holds, in segment order (computed
        once per rank: every gradient reduce walks it)."""
        if rank not in self._local:
            self._local[rank] = sorted(
                ((i, p) for i, ps in enumerate(self.pieces) for p in ps if p.rank == rank),
                key=lambda ip: ip[1].offset)
        return self._local[rank]

    def subset(self, keep: tuple[bool, ...]) -> tuple[UnitLayout, list[int]]:
        """The layout of the parameters ``keep`` selects alone (the gradient reduce's, when
        some are frozen: they do not travel), and their indices in this one. Cached."""
        if all(keep):
            return self, list(range(len(self.placements)))
        if keep not in self._subsets:
            index = [i for i, k in enumerate(keep) if k]
            replicas = len(self.replica_runs[0]) - 1 if self.replica_runs is not None else 1
            self._subsets[keep] = (layout_of([self.placements[i] for i in index],
                                             len(self.seg_sizes), replicas), index)
        return self._subsets[keep]

    @functools.cached_property
    def digest(self) -> int:
        """A checksum of where every piece lives: equal on two ranks only if they planned
        this unit alike (debug mode compares it before each collective)."""
        where = [(pl.spec.name, pl.spec.shape, pl.row_ranges) for pl in self.placements]
        return zlib.crc32(repr((self.seg_sizes, where, self.replica_runs)).encode())

    @property
    def has_replica_owned(self) -> bool:
        """HSDP: some rank of the shard group holds a matrix stepped by one replica only."""
        return self.replica_runs is not None and any(
            n for runs in self.replica_runs for _, n in runs[1:])


def local_rows(full: Any, placement: Placement, rank: int) -> Any:
    """Rank's piece of the full tensor ``full`` (a view, shaped ``placement.local_shape``):
    the rows of dim 0 it holds (a 0-d tensor counts as one row)."""
    start, stop = placement.row_ranges[rank]
    return full.reshape(placement.spec.rows, placement.spec.row_numel)[start:stop].view(
        placement.local_shape(rank))


def unit_layout(plan: Plan, unit: int) -> UnitLayout:
    return layout_of(plan.unit_params(unit), plan.shard_size, plan.replicas)


def layout_of(placements: list[Placement], P: int, R: int) -> UnitLayout:
    """The rank-major layout of ``placements`` over ``P`` shard ranks (``R`` replicas)."""
    pieces: list[list[Piece]] = [[] for _ in placements]
    seg_sizes, seg_offsets = [], []
    runs: list[list[tuple[int, int]]] = []
    offset = 0
    # Without replicas: parameter order. With: grouped by run (replicated, then replica i).
    kind = [0 if pl.owner is None else 1 + pl.owner_replica for pl in placements]
    order = sorted(range(len(placements)), key=lambda i: kind[i]) if R > 1 else \
        range(len(placements))
    for r in range(P):
        seg_offsets.append(offset)
        run_sizes = [0] * (R + 1)
        for i in order:
            pl = placements[i]
            start, stop = pl.row_ranges[r]
            n = (stop - start) * pl.spec.row_numel
            if n:
                pieces[i].append(Piece(r, offset, n, start, stop))
                offset += n
                run_sizes[kind[i]] += n
        seg_sizes.append(offset - seg_offsets[r])
        starts = [sum(run_sizes[:k]) for k in range(R + 1)]
        runs.append(list(zip(starts, run_sizes)))
    return UnitLayout([pl.spec.name for pl in placements], placements, seg_sizes,
                      seg_offsets, pieces, runs if R > 1 else None)
