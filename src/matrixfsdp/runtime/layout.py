"""Storage layout of one communication unit. Pure data and index arithmetic.

A unit's parameters travel in two ways, and its storage is laid out for both:

* **Row-sharded** ("even") parameters (norms, biases, embeddings, head) are split as
  FSDP2's ``Shard(0)``: chunks of ``ceil(rows / P)`` rows. Every rank stores every chunk
  padded to full size, one after the other: its *even part* of ``even_numel`` elements,
  the same size on every rank. A gather is one even all-gather of the even parts, a
  gradient reduce one reduce-scatter, each rank moving ``(P-1)/P`` of the buffer (ring),
  exactly as FSDP2.
* **Whole** parameters (Muon matrices, expert stacks) are held in *pieces*: a matrix is
  one piece on its owner, an expert stack one piece of whole experts per holding rank. A
  gather broadcasts each piece from its holder, a reduce sums each piece's gradient to its
  holder. NCCL pipelines both, so every rank moves each piece about once: the most loaded
  rank of a unit moves ``(P-1) even_numel + sum of pieces``, at most ``P/(P-1)`` times
  FSDP2's ``(P-1)/P`` of the whole buffer, and no buffer grows with ``P``.

Rank r's storage (its *segment*, ``seg_sizes[r]`` elements): the even part first, then the
pieces it holds, grouped by what happens to them across HSDP replicas: experts (stepped on
every replica), then the matrices stepped by replica 0, 1, ...; each group is one
contiguous run (``replica_runs``), so it crosses the replicate dimension in one collective.
The unsharded whole parameters live in one buffer in the unit's parameter order (each a
view, no copy-out); the unsharded even parameters in a buffer of padded blocks, filled from
the all-gather's output by one batched copy.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, field
from typing import Any

from ..planning.types import Placement, Plan


@dataclass(frozen=True)
class Piece:
    """Rows ``[row_start, row_stop)`` of whole parameter ``index``, held by shard rank
    ``rank`` at ``seg_offset`` in its segment, at ``offset`` in the unsharded whole buffer.

    A tp-split matrix's piece is this tp rank's slice (``numel`` = its elements), travelling
    over the shard group from shard rank ``rank``, which receives it first from the tp rank
    holding the matrix whole (``split``; ``seg_offset`` is -1, the slice lives in no segment)."""

    index: int
    rank: int
    row_start: int
    row_stop: int
    numel: int
    seg_offset: int
    offset: int
    split: bool = False


@dataclass
class UnitLayout:
    """Where each of a unit's parameters lives, sharded and unsharded, over ``P`` ranks."""

    placements: list[Placement]
    P: int
    even: list[int]  # indices of the row-sharded parameters, in unit order
    chunk: dict[int, int]  # even index -> elements of one rank's (padded) chunk
    even_offset: dict[int, int]  # even index -> offset of its chunk in every even part
    even_numel: int  # one rank's even part
    whole_offset: dict[int, int]  # whole index -> offset in the unsharded whole buffer
    whole_numel: int
    pieces: list[Piece]  # in whole-buffer order: the order of the broadcasts and reduces
    seg_sizes: list[int]
    replica_runs: list[list[tuple[int, int]]] | None = None  # HSDP: per rank, see module doc
    # tensor parallelism: tp-split matrices this tp rank holds whole -> offset in the
    # segment of their owner shard rank (see Piece)
    split_seg: dict[int, int] = field(default_factory=dict)
    tp_rank: int = 0
    _subsets: dict[tuple[bool, ...], tuple[UnitLayout, list[int]]] = field(
        default_factory=dict, repr=False)

    @property
    def numel(self) -> int:
        """Elements of the unsharded unit (no padding)."""
        return sum(pl.spec.numel for pl in self.placements)

    @property
    def gathered_numel(self) -> int:
        """Elements a gather writes: the padded even parts of all ranks and the whole buffer."""
        return self.P * self.even_numel + self.whole_numel

    @functools.cached_property
    def held(self) -> list[list[Piece]]:
        """Per rank, the pieces it holds, in segment order."""
        held: list[list[Piece]] = [[] for _ in range(self.P)]
        for pc in sorted(self.pieces, key=lambda pc: pc.seg_offset):
            if not pc.split:
                held[pc.rank].append(pc)
        return held

    @functools.cached_property
    def split_pieces(self) -> list[list[Piece]]:
        """Per shard rank, the slices of tp-split matrices it sends over the shard group."""
        out: list[list[Piece]] = [[] for _ in range(self.P)]
        for pc in self.pieces:
            if pc.split:
                out[pc.rank].append(pc)
        return out

    def shard_offset(self, i: int, rank: int) -> int:
        """Where parameter ``i``'s shard starts in ``rank``'s segment."""
        if i in self.even_offset:
            return self.even_offset[i]
        if i in self.split_seg:
            return self.split_seg[i]
        return next((pc.seg_offset for pc in self.held[rank] if pc.index == i), 0)

    def subset(self, keep: tuple[bool, ...]) -> tuple[UnitLayout, list[int]]:
        """The layout of the parameters ``keep`` selects alone (the gradient reduce's, when
        some are frozen: they do not travel), and their indices in this one. Cached."""
        if all(keep):
            return self, list(range(len(self.placements)))
        if keep not in self._subsets:
            index = [i for i, k in enumerate(keep) if k]
            replicas = len(self.replica_runs[0]) - 1 if self.replica_runs is not None else 1
            self._subsets[keep] = (layout_of([self.placements[i] for i in index], self.P,
                                             replicas, self.tp_rank), index)
        return self._subsets[keep]

    @functools.cached_property
    def digest(self) -> int:
        """A checksum of where every piece lives: equal on two ranks only if they planned
        this unit alike (debug mode compares it before each collective)."""
        where = [(pl.spec.name, pl.spec.shape, pl.owner, pl.tp_owner,
                  pl.row_ranges if pl.spec.tp == 1 else None) for pl in self.placements]
        travel = [(pc.index, pc.rank, pc.numel, pc.offset) for pc in self.pieces]
        return zlib.crc32(repr((self.even_numel, where, travel)).encode())

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


def unit_layout(plan: Plan, unit: int, tp_rank: int = 0) -> UnitLayout:
    return layout_of([pl.for_tp_rank(tp_rank) for pl in plan.unit_params(unit)],
                     plan.shard_size, plan.replicas, tp_rank)


ALIGN = 16  # elements: whole pieces start 64-byte aligned (fp32), in storage and unsharded


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _is_whole(pl: Placement) -> bool:
    return pl.spec.muon and pl.spec.numel > 0


def layout_of(placements: list[Placement], P: int, R: int, tp_rank: int = 0) -> UnitLayout:
    """The layout of ``placements`` (as tp rank ``tp_rank`` sees them,
    :meth:`Placement.for_tp_rank`) over ``P`` shard ranks (``R`` replicas)."""
    even = [i for i, pl in enumerate(placements) if not _is_whole(pl)]
    chunk, even_offset, even_numel = {}, {}, 0
    for i in even:
        spec = placements[i].spec
        even_offset[i] = even_numel
        chunk[i] = -(-spec.rows // P) * spec.row_numel
        even_numel += chunk[i]
    whole_offset, whole_numel = {}, 0
    for i, pl in enumerate(placements):
        if _is_whole(pl):
            whole_offset[i] = _aligned(whole_numel)
            whole_numel = whole_offset[i] + pl.spec.slice_numel
    # Segment order: even part, then experts (kind 0), matrices of replica 0, 1, ...
    kind = {i: 0 if placements[i].owner is None else 1 + placements[i].owner_replica
            for i in whole_offset}
    pieces, seg_sizes, runs, split_seg = [], [], [], {}
    for r in range(P):
        run_sizes = [0] * (R + 1)
        offset = even_numel
        for i in sorted(whole_offset, key=lambda i: (kind[i], i)):
            pl = placements[i]
            start, stop = pl.row_ranges[r]
            if pl.spec.tp > 1:
                if pl.owner_shard != r:
                    continue
                at = _aligned(offset) if stop > start else -1  # held whole on this tp rank
                pieces.append(Piece(i, r, 0, pl.spec.rows, pl.spec.slice_numel, at,
                                    whole_offset[i], split=True))
                if stop > start:
                    split_seg[i] = at
                    run_sizes[kind[i]] += at + pl.spec.numel - offset
                    offset = at + pl.spec.numel
            elif stop > start:
                n = (stop - start) * pl.spec.row_numel
                at = _aligned(offset)  # whole matrices 64-byte aligned: BLAS rounds alike
                pieces.append(Piece(i, r, start, stop, n, at,
                                    whole_offset[i] + start * pl.spec.row_numel))
                run_sizes[kind[i]] += at + n - offset
                offset = at + n
        seg_sizes.append(offset)
        run_sizes[0] += even_numel
        runs.append(list(zip([sum(run_sizes[:k]) for k in range(R + 1)], run_sizes)))
    pieces.sort(key=lambda pc: pc.offset)
    return UnitLayout(placements, P, even, chunk, even_offset, even_numel, whole_offset,
                      whole_numel, pieces, seg_sizes, runs if R > 1 else None, split_seg,
                      tp_rank)
