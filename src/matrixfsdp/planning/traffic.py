"""What the runtime moves and holds, rank by rank, predicted from a plan alone.

The runtime lays each unit out as :mod:`matrixfsdp.runtime.layout` says (an even part of
``E`` padded elements per shard rank, then each whole piece 16-element aligned, grouped in
runs by the replica that steps them) and counts every collective in a ``CommStats``
(:mod:`matrixfsdp.runtime.collectives`: ``ring_load`` for all-gather / reduce-scatter /
all-reduce, ``pipeline_load`` for broadcast / reduce). This module redoes that arithmetic
over the plan (planning may not import the runtime), so that ``matrixfsdp plan`` and
:func:`matrixfsdp.plan_costs` predict, to the byte, per rank and per collective kind,
what one training step issues, and the bytes each rank holds; ``tests/test_plan_model.py``
runs 8 gloo ranks and compares. A change of the runtime that moves bytes shows there.

One steady training step with ``micro_batches`` forward/backward passes (each reducing, the
runtime's default), the root unit kept gathered from forward to backward (its default
``reshard_after_forward``), then ``optimizer.step()``:

* per pass and unit with parameters: a forward gather, a backward gather (not the root's),
  a gradient reduce; per pass: one ``grad_flags`` all-reduce (one byte per parameter of
  the units that reduced) over the whole mesh;
* HSDP, per pass: after each unit's reduce, an all-reduce of its replicated run and a reduce
  of each replica's run of matrices over the replicate group; per step (at the next
  forward): a broadcast of each replica's run of every unit that holds replica-owned
  matrices.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .types import Placement, Plan

ALIGN = 16  # elements: runtime/layout.py's alignment of whole pieces
KINDS = ("all_gather", "broadcast", "reduce_scatter", "reduce", "replicate_allreduce",
         "replicate_reduce", "replicate_broadcast", "grad_flags")
COUNTERS = ("calls", "payload_bytes", "sent_bytes", "received_bytes", "critical_bytes",
            "mean_bytes")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _is_whole(pl: Placement) -> bool:
    return pl.spec.muon and pl.spec.numel > 0


class Piece(NamedTuple):
    """A whole piece as it travels: ``numel`` elements (a tp slice for a tp-split matrix)
    from / to shard rank ``rank``; ``kind`` 0 for experts, ``1 + replica`` for a matrix
    stepped by one replica; ``tp_owner`` the tp rank storing a tp-split matrix whole."""

    index: int
    rank: int
    numel: int
    kind: int
    stored: int  # elements it occupies in the holder's segment (the whole matrix)
    tp_owner: int | None = None


@dataclass
class UnitShape:
    """One unit over ``S`` shard ranks, ``R`` replicas, ``T`` tp ranks: its even part, its
    pieces in the order the runtime broadcasts and reduces them, and per (shard rank, tp
    rank) holding pieces, the segment size and the replicate runs (every other rank: the
    even part alone)."""

    placements: list[Placement]
    S: int
    R: int
    T: int
    even_numel: int
    whole_numel: int  # the unsharded whole buffer (a tp rank's slices, aligned)
    pieces: list[Piece]
    seg: dict[tuple[int, int], int] = field(default_factory=dict)
    runs: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return sum(pl.spec.numel for pl in self.placements)

    @property
    def gathered_numel(self) -> int:
        return self.S * self.even_numel + self.whole_numel

    def seg_of(self, r: int, t: int = 0) -> int:
        return self.seg.get((r, t), self.even_numel)

    def runs_of(self, r: int, t: int = 0) -> dict[int, int]:
        """Shard rank ``r``'s replicate runs (elements): kind 0 (its even part and experts,
        all-reduced) and ``1 + i`` (matrices replica ``i`` steps), the empty ones left out."""
        return self.runs.get((r, t)) or {0: self.even_numel}

    @property
    def has_replica_owned(self) -> bool:
        return self.R > 1 and any(p.kind > 0 for p in self.pieces)


def unit_shape(placements: Sequence[Placement], S: int, R: int = 1, T: int = 1) -> UnitShape:
    """The layout arithmetic of ``runtime/layout.py`` (``layout_of``) for every tp rank."""
    placements = list(placements)
    even_numel, whole_numel = 0, 0
    pieces: list[Piece] = []
    held: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for i, pl in enumerate(placements):
        spec = pl.spec
        numel = spec.numel
        if not (spec.muon and numel):
            even_numel += -(-spec.rows // S) * spec.row_numel
            continue
        whole_numel = _aligned(whole_numel) + numel // spec.tp
        if pl.owner is not None:  # a 2-D matrix (or its tp slices) from its owner shard rank
            split = spec.tp > 1
            r = pl.owner % S
            pc = Piece(i, r, numel // spec.tp, 1 + pl.owner // S, numel,
                       pl.tp_owner if split else None)
            pieces.append(pc)
            for t in ((pl.tp_owner,) if split else range(T)):
                held[(r, t)].append(pc)
            continue
        rn = spec.row_numel
        for r, (start, stop) in enumerate(pl.row_ranges):  # an expert stack's holders
            if stop > start:
                pc = Piece(i, r, (stop - start) * rn, 0, (stop - start) * rn)
                pieces.append(pc)
                for t in range(T):
                    held[(r, t)].append(pc)
    shape = UnitShape(placements, S, R, T, even_numel, whole_numel, pieces)
    for key, mine in held.items():
        runs: dict[int, int] = {0: even_numel}
        offset = even_numel
        for pc in (sorted(mine, key=lambda pc: (pc.kind, pc.index)) if len(mine) > 1 else mine):
            at = -(-offset // ALIGN) * ALIGN
            runs[pc.kind] = runs.get(pc.kind, 0) + at + pc.stored - offset
            offset = at + pc.stored
        shape.seg[key], shape.runs[key] = offset, {k: n for k, n in runs.items() if n}
    return shape


def unit_shapes(plan: Plan, tp: int = 1) -> list[UnitShape]:
    units: list[list[Placement]] = [[] for _ in plan.unit_names]
    for pl in plan.placements.values():
        units[pl.spec.unit].append(pl)
    return [unit_shape(pls, plan.shard_size, plan.replicas, tp) for pls in units]


# ---- the runtime's counters ------------------------------------------------------------
def _ring(n: int, P: int, factor: int = 1) -> tuple[int, int, int, int]:
    b = factor * n * (P - 1) // P
    return b, b, b, b


def _pipeline(n: int, P: int, rank: int, root: int, toward_root: bool
              ) -> tuple[int, int, int, int]:
    end = (root - 1) % P if not toward_root else (root + 1) % P
    first, last = (root, end) if not toward_root else (end, root)
    return (0 if rank == last else n, 0 if rank == first else n, n, n * (P - 1) // P)


class _Counts:
    def __init__(self):
        self.by_kind: dict[str, list[int]] = {}

    def add(self, kind: str, payload: int, load: tuple[int, int, int, int], times: int = 1):
        c = self.by_kind.setdefault(kind, [0] * len(COUNTERS))
        for k, v in enumerate((1, payload, *load)):
            c[k] += v * times

    def summary(self) -> dict[str, dict[str, int]]:
        return {k: dict(zip(COUNTERS, self.by_kind[k])) for k in sorted(self.by_kind)}


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element: ``storage`` (the parameters', their shards, gradients and
    optimizer state), ``gather`` (the policy's ``param_dtype``), ``reduce`` (its
    ``reduce_dtype``)."""

    storage: int = 4
    gather: int = 4
    reduce: int = 4


def _phase(c: _Counts, u: UnitShape, r: int, itemsize: int, reduce: bool, times: int) -> None:
    S = u.S
    if S == 1:
        return
    if u.even_numel:
        n = S * u.even_numel * itemsize
        c.add("reduce_scatter" if reduce else "all_gather", n, _ring(n, S), times)
    for pc in u.pieces:
        n = pc.numel * itemsize
        c.add("reduce" if reduce else "broadcast", n, _pipeline(n, S, r, pc.rank, reduce), times)


def predict_comm(plan: Plan, dtypes: Dtypes = Dtypes(), micro_batches: int = 1
                 ) -> list[dict[str, dict[str, int]]]:
    """Per world rank, what its ``CommStats.summary()`` reads after one steady training
    step (module docstring): per collective kind, calls and payload / sent / received /
    critical / mean bytes. 1-D and HSDP plans (no tensor parallelism)."""
    if any(pl.spec.tp > 1 for pl in plan.placements.values()):
        raise NotImplementedError("predict_comm: tensor-parallel plans are costed by the "
                                  "layout search (matrixfsdp.planning.search), not per rank")
    S, R, W = plan.shard_size, plan.replicas, plan.world_size
    shapes = unit_shapes(plan)
    flags = sum(len(u.placements) for u in shapes if u.numel)
    out = []
    for w in range(W):
        r, replica = w % S, w // S
        c = _Counts()
        for ui, u in enumerate(shapes):
            if not u.numel:
                continue
            _phase(c, u, r, dtypes.gather, False, micro_batches * (1 if ui == 0 else 2))
            _phase(c, u, r, dtypes.reduce, True, micro_batches)
            if R == 1:
                continue
            runs = u.runs_of(r)
            if runs.get(0):
                n = runs[0] * dtypes.reduce
                c.add("replicate_allreduce", n, _ring(n, R, 2), micro_batches)
            mats = sorted((k - 1, n) for k, n in runs.items() if k)
            for i, k in mats:
                n = k * dtypes.reduce
                c.add("replicate_reduce", n, _pipeline(n, R, replica, i, True), micro_batches)
            if u.has_replica_owned:
                for i, k in mats:
                    n = k * dtypes.storage
                    c.add("replicate_broadcast", n, _pipeline(n, R, replica, i, False))
        if W > 1 and flags:
            c.add("grad_flags", flags, _ring(flags, W, 2), micro_batches)
        out.append(c.summary())
    return out


# ---- memory ------------------------------------------------------------------------------
@dataclass
class Held:
    """Bytes one world rank holds between steps: ``storage`` (its segments: the parameters'
    shards with the even part's padding and the pieces' alignment), ``params`` (the shards
    ``model.parameters()`` shows, no padding), ``grads`` (the reduce outputs its ``.grad``
    views keep alive: whole segments), ``optim`` (Muon momentum on the matrices it steps,
    AdamW ``exp_avg`` + ``exp_avg_sq`` on its even rows)."""

    storage: int = 0
    params: int = 0
    grads: int = 0
    optim: int = 0

    @property
    def total(self) -> int:
        return self.storage + self.grads + self.optim


def _steps_here(pl: Placement, replica: int) -> bool:
    return pl.owner is None or pl.owner_replica == replica


def _local_numel(pl: Placement, r: int, t: int) -> int:
    """Elements of ``pl``'s shard on shard rank ``r``, tp rank ``t``."""
    if pl.spec.tp > 1:
        return pl.spec.numel if (pl.owner_shard == r and pl.tp_owner == t) else 0
    start, stop = pl.row_ranges[r]
    return (stop - start) * pl.spec.row_numel


def rank_held(shapes: Sequence[UnitShape], w: int, t: int = 0, dtypes: Dtypes = Dtypes(),
              adamw_states: int = 2) -> Held:
    """What world rank ``w`` (tp rank ``t``) holds after an optimizer step."""
    h = Held()
    for u in shapes:
        S = u.S
        r, replica = w % S, w // S
        seg = u.seg_of(r, t)
        h.storage += seg * dtypes.storage
        stepped = False
        for pl in u.placements:
            n = _local_numel(pl, r, t)
            h.params += n * dtypes.storage
            if n and _steps_here(pl, replica):
                stepped = True
                states = 1 if pl.spec.muon else adamw_states  # a matrix or an expert stack
                h.optim += states * n * dtypes.storage
        h.grads += seg * dtypes.storage if stepped else 0
    return h


def ranks_to_check(shapes: Sequence[UnitShape], W: int) -> list[int]:
    """World ranks whose holdings can differ from the rest: those whose shard rank holds a
    piece (every other rank holds the even parts alone), and one rank that holds none."""
    S = shapes[0].S if shapes else 1
    pieces = {pc.rank for u in shapes for pc in u.pieces}
    ranks = {replica * S + r for r in pieces for replica in range(W // S)}
    bare = next((w for w in range(W) if w % S not in pieces), None)
    return sorted(ranks | ({bare} if bare is not None else set()))
