"""Where each piece of a unit lives, and the collectives that move it: one arithmetic for the
runtime (which lays its storage out and issues these calls) and the planner (which counts
them), pure Python over a plan.

A unit's parameters travel in two ways:

* **Row-sharded** ("even") parameters (norms, biases, embeddings, head) are split as
  FSDP2's ``Shard(0)``: chunks of ``ceil(rows / S)`` rows. Every shard rank stores every
  chunk padded to full size, one after the other: its *even part* of ``E`` elements, the
  same on every rank.
* **Whole** parameters (Muon matrices, expert stacks) travel in *pieces*: a matrix is one
  piece from its owner shard rank, an expert stack one piece of whole experts per holding
  rank, a tp-split matrix one piece per tp rank (its slice), all from the owner shard rank
  (where one tp rank holds it whole, its slices hop there first; where its tp group owns
  it, each tp rank holds its own slice and nothing hops).

Shard rank ``r`` contributes one *chunk* to a gather and receives one in a reduce: its even
part, then (a reduce only) ``F`` gradient flags, then the pieces it holds, each 16-element
aligned, ordered by *kind* (experts; then the matrices replica 0, 1, ... steps) and index.
A *holder* is a shard rank holding pieces; its pieces, back to back, are its *region*.

A unit moves in one even collective plus one per holder: the even parts (and flags) in one
all-gather / reduce-scatter of ``S x head`` elements, each holder's region in one broadcast
from it / reduce to it. Its NCCL ops grow with the unit's holders (a handful of owners),
never with ``S``; where the group coalesces they go out as **one launch per unit and
direction** (FSDP2's count). Where every chunk has one aligned size (:attr:`UnitLayout.even`)
the whole chunks travel in one even all-gather / reduce-scatter instead. The *gathered
buffer* holds what the collectives write: with :attr:`UnitLayout.even` every chunk, back to
back; else the holders' regions alone, back to back and aligned (the even parts land in a
transient ``S x head`` buffer). Each 2-D matrix is a view of it; the even parameters and
expert stacks are copied out.

Rank ``r`` at tp rank ``t`` stores its *segment*: the even part (and, for a reduce's output,
the flags), then the pieces it stores in chunk order (a tp-split matrix whole, on its
``tp_owner`` only). Without tensor parallelism a segment is its chunk. The segment's runs by
kind are what crosses the replicate dimension under HSDP, one run per replica.

:func:`calls` lists the collectives of one unit and phase, and :class:`Call.load` charges
each to a rank as NCCL's algorithms move it (a collective ends when its most loaded rank is
done): the runtime counts what it issues with it, and the planner predicts with it.
"""

from __future__ import annotations

import bisect
import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from .loads import Load, op_load
from .types import Placement, Plan

ALIGN = 16  # elements: whole pieces start 64-byte aligned (fp32): BLAS rounds alike


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def is_whole(pl: Placement) -> bool:
    """Whether a parameter travels in pieces (a Muon matrix or expert stack) rather than rows."""
    return pl.spec.muon and pl.spec.numel > 0


@dataclass(frozen=True)
class Piece:
    """Rows ``[row_start, row_stop)`` of whole parameter ``index``, held by shard rank
    ``rank``; ``numel`` elements travel (a tp-split matrix: one tp rank's slice), at
    ``offset`` in that rank's chunk. ``kind``: 0 for experts (stepped on every replica),
    ``1 + i`` for a matrix replica ``i`` steps. ``tp_owner``: a tp-split matrix's tp rank
    storing it whole."""

    index: int
    rank: int
    row_start: int
    row_stop: int
    numel: int
    kind: int
    offset: int
    tp_owner: int | None = None

    @property
    def split(self) -> bool:
        return self.tp_owner is not None


@dataclass(frozen=True)
class Segment:
    """What one (shard rank, tp rank) stores: ``size`` elements, ``offsets`` of the pieces'
    parameters in it, and its ``runs`` by kind, ``kind -> (start, elements)``: kind 0 (the
    even part, flags and experts, replicated) always, then ``1 + i`` for the matrices replica
    ``i`` steps, where it stores some."""

    size: int
    offsets: dict[int, int]
    runs: dict[int, tuple[int, int]]

    @property
    def shared(self) -> int:
        """Elements of the replicated run (kind 0)."""
        return self.runs[0][1]

    @functools.cached_property
    def replica_runs(self) -> tuple[tuple[int, int, int], ...]:
        """``(replica, start, elements)`` of each non-empty run of matrices, by replica: one
        per replica that steps a matrix stored here, so never more than the segment's
        pieces, whatever the number of replicas."""
        return tuple((kind - 1, a, n) for kind, (a, n) in sorted(self.runs.items()) if kind and n)


@dataclass
class UnitLayout:
    """Where each of a unit's parameters lives and travels over ``S`` shard ranks, ``R``
    replicas and ``T`` tp ranks (module docstring). ``flags``: gradient-flag slots after
    the even part (a reduce's layout; 0 for storage and gathers)."""

    placements: list[Placement]
    S: int
    R: int
    T: int
    flags: int
    rows: list[int]  # indices of the row-sharded parameters, in unit order
    chunk: dict[int, int]  # even index -> elements of one rank's (padded) chunk
    even_offset: dict[int, int]  # even index -> offset of its chunk in every even part
    even_numel: int
    pieces: list[Piece]  # by (rank, kind, index): the order they travel in
    holder_sizes: dict[int, int]  # shard rank holding pieces -> its chunk's elements
    _subsets: dict = field(default_factory=dict, repr=False)
    _segments: dict = field(default_factory=dict, repr=False)

    # ---- sizes ------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Elements of the unsharded unit (no padding)."""
        return sum(pl.spec.numel for pl in self.placements)

    @property
    def head(self) -> int:
        """Elements before the pieces in every chunk: the even part and the flags."""
        return self.even_numel + self.flags

    def chunk_size(self, r: int) -> int:
        """Elements shard rank ``r`` contributes to a gather (receives in a reduce)."""
        return self.holder_sizes.get(r, self.head)

    @functools.cached_property
    def holders(self) -> list[int]:
        return sorted(self.holder_sizes)

    @functools.cached_property
    def chunk_total(self) -> int:
        """Elements of all chunks (what one collective of the unit carries)."""
        return (self.S - len(self.holder_sizes)) * self.head + sum(self.holder_sizes.values())

    @functools.cached_property
    def smallest_chunk(self) -> int:
        sizes = [self.chunk_size(r) for r in self.holders]
        return min(sizes + ([self.head] if len(sizes) < self.S else []))

    @functools.cached_property
    def even(self) -> bool:
        """Whether every chunk has one size that keeps the pieces aligned back to back, so
        one even all-gather / reduce-scatter of ``S x chunk`` carries the unit."""
        size = self.smallest_chunk
        return all(self.chunk_size(r) == size for r in self.holders) and \
            (not self.holders or size % ALIGN == 0)

    @functools.cached_property
    def _bases(self) -> dict[int, int]:
        """Holder -> where its chunk's offset 0 lies in the gathered buffer (its pieces at
        ``base + piece.offset``): chunks back to back when :attr:`even`, else the regions
        back to back, each starting aligned."""
        out, at = {}, 0
        for h in self.holders:
            if self.even:
                out[h] = h * self.chunk_size(h)
                continue
            first = self.pieces_at(h)[0].offset
            at = aligned(at)
            out[h] = at - first
            at += self.chunk_size(h) - first
        return out

    def base(self, r: int) -> int:
        """Where shard rank ``r``'s chunk offsets count from in the gathered buffer (a
        holder's; with :attr:`even`, any rank's: its chunk starts there)."""
        return self._bases[r] if r in self._bases else r * self.chunk_size(r)

    def region(self, h: int) -> tuple[int, int]:
        """Holder ``h``'s region: ``(offset in its chunk, elements)``, its pieces back to back
        with their alignment gaps (what one broadcast from it / reduce to it moves)."""
        first = self.pieces_at(h)[0].offset
        return first, self.chunk_size(h) - first

    @functools.cached_property
    def gathered_numel(self) -> int:
        """Elements of the gathered buffer (module docstring)."""
        if self.even:
            return self.S * self.smallest_chunk
        if not self.holders:
            return 0
        h = self.holders[-1]
        return self._bases[h] + self.chunk_size(h)

    @property
    def keeps_gathered(self) -> bool:
        """Whether the gathered buffer lives while the unit is unsharded (its 2-D matrices
        are views of it); else it is dropped once the copy-out is done."""
        return any(self.placements[pc.index].owner is not None for pc in self.pieces)

    @functools.cached_property
    def _copied(self) -> tuple[dict[int, int], int]:
        out = {i: self.S * self.even_offset[i] for i in self.rows}
        at = self.S * self.even_numel
        for i, pl in enumerate(self.placements):
            if is_whole(pl) and pl.owner is None:
                out[i] = at = aligned(at)
                at += pl.spec.numel
        return out, at

    @property
    def copied(self) -> dict[int, int]:
        """Parameter index -> offset in the copied buffer: the even parameters' padded blocks
        (``S x chunk`` each, in even-part order) and the expert stacks (aligned), which a
        gather copies out of the gathered buffer."""
        return self._copied[0]

    @property
    def copied_numel(self) -> int:
        return self._copied[1]

    def whole_offset(self, i: int) -> int:
        """Where a 2-D matrix (this tp rank's slice of a tp-split one) lies in the gathered
        buffer: in its owner's chunk."""
        pc = self.pieces_of(i)[0]
        return self.base(pc.rank) + pc.offset

    @functools.cached_property
    def _by_index(self) -> dict[int, list[Piece]]:
        out: dict[int, list[Piece]] = {}
        for pc in self.pieces:
            out.setdefault(pc.index, []).append(pc)
        return out

    def pieces_of(self, i: int) -> list[Piece]:
        return self._by_index.get(i, [])

    @functools.cached_property
    def _by_rank(self) -> dict[int, list[Piece]]:
        out: dict[int, list[Piece]] = {}
        for pc in self.pieces:
            out.setdefault(pc.rank, []).append(pc)
        return out

    def pieces_at(self, r: int) -> list[Piece]:
        """The pieces shard rank ``r`` holds, in chunk order."""
        return self._by_rank.get(r, [])

    # ---- segments ---------------------------------------------------------------------
    def segment(self, r: int, t: int = 0) -> Segment:
        """What shard rank ``r`` at tp rank ``t`` stores (see :class:`Segment`). Cached; one
        object for every tp rank of a shard rank holding no piece one tp rank holds whole
        (their segments are equal)."""
        seg = self._segments.get((r, t))
        if seg is None:
            if t and self.chunk_is_segment(r):
                seg = self._segments[(r, t)] = self.segment(r, 0)
            else:
                seg = self._segments[(r, t)] = self._segment(r, t)
        return seg

    def _segment(self, r: int, t: int) -> Segment:
        runs: dict[int, tuple[int, int]] = {0: (0, self.head)}
        offsets: dict[int, int] = {}
        at = self.head
        for pc in self.pieces_at(r):  # in kind order: each kind's run is contiguous
            if pc.split and pc.tp_owner != t:
                continue
            start = aligned(at)
            offsets[pc.index] = start
            n = self.placements[pc.index].spec.numel if pc.split else pc.numel
            first, length = runs.get(pc.kind, (at, 0))
            runs[pc.kind] = (first, length + start + n - at)
            at = start + n
        return Segment(at, offsets, runs)

    def shard_offset(self, i: int, r: int, t: int = 0) -> int:
        """Where parameter ``i``'s shard starts in the segment of ``(r, t)`` (0 where it
        holds none of a whole parameter)."""
        if i in self.even_offset:
            return self.even_offset[i]
        return self.segment(r, t).offsets.get(i, 0)

    def chunk_is_segment(self, r: int) -> bool:
        """Whether shard rank ``r``'s chunk is its segment (no tp-split piece there)."""
        return r not in self._split_ranks

    @functools.cached_property
    def _split_ranks(self) -> frozenset[int]:
        """Shard ranks holding a piece one tp rank holds whole."""
        return frozenset(pc.rank for pc in self.pieces if pc.split)

    @property
    def has_replica_owned(self) -> bool:
        """HSDP: some shard rank holds a matrix stepped by one replica only."""
        return self.R > 1 and any(pc.kind > 0 for pc in self.pieces)

    def replicas_stepping(self) -> list[int]:
        return sorted({pc.kind - 1 for pc in self.pieces if pc.kind > 0})

    # ---- derived layouts --------------------------------------------------------------
    def reduce_layout(self, keep: tuple[bool, ...]) -> tuple[UnitLayout, list[int]]:
        """The layout of a gradient reduce: the parameters ``keep`` selects (frozen ones do
        not travel), with one flag slot per parameter, and their indices here. Cached."""
        if keep not in self._subsets:
            index = [i for i, k in enumerate(keep) if k]
            self._subsets[keep] = (layout_of([self.placements[i] for i in index], self.S,
                                             self.R, self.T, flags=len(index)), index)
        return self._subsets[keep]

    @functools.cached_property
    def digest(self) -> int:
        """A checksum of where every piece lives: equal on two ranks only if they planned
        this unit alike (debug mode compares it before each collective)."""
        where = [(pl.spec.name, pl.spec.shape, pl.owner, pl.tp_owner,
                  pl.row_ranges if pl.spec.tp == 1 else None) for pl in self.placements]
        travel = [(pc.index, pc.rank, pc.numel, pc.offset) for pc in self.pieces]
        return zlib.crc32(repr((self.even_numel, self.flags, where, travel)).encode())


def layout_of(placements: Sequence[Placement], S: int, R: int = 1, T: int = 1,
              flags: int = 0) -> UnitLayout:
    """The layout of ``placements`` over ``S`` shard ranks, ``R`` replicas and ``T`` tp ranks,
    with ``flags`` gradient-flag slots (a reduce's). Costs the pieces, not the ranks: a unit
    of a 16384-rank plan lays out in microseconds."""
    placements = list(placements)
    rows = [i for i, pl in enumerate(placements) if not is_whole(pl)]
    chunk, even_offset, E = {}, {}, 0
    for i in rows:
        spec = placements[i].spec
        even_offset[i] = E
        chunk[i] = -(-spec.rows // S) * spec.row_numel
        E += chunk[i]
    held: dict[int, list[tuple[int, int, int, int, int | None]]] = {}
    for i, pl in enumerate(placements):
        if not is_whole(pl):
            continue
        spec = pl.spec
        if pl.owner is not None:  # a 2-D matrix (a tp-split one: a slice per tp rank)
            held.setdefault(pl.owner_shard, []).append(
                (1 + pl.owner_replica, i, 0, spec.rows, pl.tp_owner if spec.tp > 1 else None))
        else:  # an expert stack: whole experts on each holding rank
            for r in _holding(pl.row_ranges):
                start, stop = pl.row_ranges[r]
                held.setdefault(r, []).append((0, i, start, stop, None))
    pieces, sizes = [], {}
    head = E + flags
    for r in sorted(held):
        at = head
        for kind, i, start, stop, tp_owner in sorted(held[r], key=lambda h: (h[0], h[1])):
            spec = placements[i].spec
            n = spec.slice_numel if spec.tp > 1 else (stop - start) * spec.row_numel
            at = aligned(at)
            pieces.append(Piece(i, r, start, stop, n, kind, at, tp_owner))
            at += n
        sizes[r] = at
    return UnitLayout(placements, S, R, T, flags, rows, chunk, even_offset, E, pieces, sizes)


def _holding(row_ranges: list[tuple[int, int]]) -> list[int]:
    """The ranks holding rows of ``row_ranges`` (contiguous ascending ranges: bisect)."""
    if len(row_ranges) < 64:
        return [r for r, (a, b) in enumerate(row_ranges) if b > a]
    stops = [b for _, b in row_ranges]
    first = bisect.bisect_right(stops, row_ranges[0][0])
    return [r for r in range(first, len(row_ranges)) if row_ranges[r][1] > row_ranges[r][0]]


def unit_layout(plan: Plan, unit: int, T: int = 1, tp_rank: int | None = None) -> UnitLayout:
    """The storage and gather layout of unit ``unit`` of ``plan`` (``T`` tp ranks). With
    ``tp_rank``, its placements as that tp rank stores them
    (:meth:`~matrixfsdp.layout.types.Placement.for_tp_rank`: a tp-split matrix held on
    its ``tp_owner`` only); the pieces, chunks and segments are the same either way."""
    pls = plan.unit_params(unit)
    if tp_rank is not None:
        pls = [pl.for_tp_rank(tp_rank) for pl in pls]
    return layout_of(pls, plan.shard_size, plan.replicas, T)


def unit_layouts(plan: Plan, T: int = 1) -> list[UnitLayout]:
    """Every unit's layout, in unit order."""
    units: list[list[Placement]] = [[] for _ in plan.unit_names]
    for pl in plan.placements.values():
        units[pl.spec.unit].append(pl)
    return [layout_of(pls, plan.shard_size, plan.replicas, T) for pls in units]


# ---- the collectives of a unit ---------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One collective op of a unit: ``kind`` (``all_gather`` / ``reduce_scatter``: the even
    parts, or whole chunks of one size, ring; ``broadcast`` / ``reduce``: one holder's
    region from / to it, pipelined), the elements it hands over (``numel``: the gathered or
    reduced buffer, or the region), and for a region, its holder ``root``."""

    kind: str
    numel: int
    root: int | None = None

    def load(self, lay: UnitLayout, rank: int, itemsize: int) -> Load:
        """What this op moves for shard rank ``rank`` (bytes of ``itemsize``)."""
        return op_load(self.kind, self.numel * itemsize, lay.S, rank, self.root)


def calls(lay: UnitLayout, reduce: bool) -> list[Call]:
    """The ops of one gather (``reduce`` False) or gradient reduce of ``lay`` over its shard
    group, in the order they are issued (one launch where the group coalesces): an even
    all-gather / reduce-scatter of the even parts, then one broadcast / reduce per holder's
    region; whole chunks of one aligned size in one even call instead."""
    if lay.S == 1 or not lay.chunk_total:
        return []
    if lay.even:
        return [Call("reduce_scatter" if reduce else "all_gather", lay.chunk_total)]
    out = [Call("reduce_scatter" if reduce else "all_gather", lay.S * lay.head)] if lay.head else []
    return out + [Call("reduce" if reduce else "broadcast", lay.region(h)[1], h) for h in lay.holders]
