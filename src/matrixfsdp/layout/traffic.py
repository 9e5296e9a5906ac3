"""What the runtime moves and holds, rank by rank, predicted from a plan alone.

The runtime lays each unit out with :mod:`matrixfsdp.layout.units` and issues the ops
:func:`~matrixfsdp.layout.units.calls` lists, counting each in a ``CommStats`` from the
tensors it hands to the collective (``runtime/collectives.py``, independently of this
package). This module walks the same layouts and ops over a plan, charging each by the
planner's own load functions (:meth:`~matrixfsdp.layout.units.Call.load`), so that
``matrixfsdp plan`` and :func:`matrixfsdp.plan_costs` predict, to the byte, the op and the
launch, per rank and per collective kind, what one training step issues, and the bytes each
rank holds; ``tests/advisor/test_plan_model.py`` runs 8 ranks on gloo and on NCCL's coalesced path
(grouped_gloo) and compares.

One steady training step with ``micro_batches`` forward/backward passes (each reducing, the
runtime's default), the root unit kept gathered from forward to backward (its default
``reshard_after_forward``), then ``optimizer.step()``:

* per pass and unit with parameters: a forward gather, a backward gather (not the root's),
  a gradient reduce (its chunks carry one flag per parameter: which ranks had a gradient);
* HSDP, per pass: after each unit's reduce, an all-reduce of its replicated run and one
  reduce of each replica's run of matrices to it over the replicate group; per step (at
  the next forward): a broadcast of each replica's run from it, for the units holding
  replica-owned matrices.

``coalesced``: the process groups run a unit's ops of one direction as one launch (NCCL);
else each op is a launch (gloo). The ops and bytes are the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .loads import op_load
from .types import Placement, Plan
from .units import Segment, UnitLayout, calls, unit_layouts

# What a ``CommStats`` (runtime/collectives.py) counts per collective kind, and this module
# predicts: one list for both.
COUNTERS = ("calls", "payload_bytes", "sent_bytes", "received_bytes", "critical_bytes",
            "mean_bytes")


class _Counts:
    def __init__(self):
        self.by_kind: dict[str, list[int]] = {}
        self.launches: dict[str, int] = {}

    def launch(self, phase: str, ops: int, coalesced: bool, times: int) -> None:
        n = (1 if ops else 0) if coalesced else ops
        if n:
            self.launches[phase] = self.launches.get(phase, 0) + n * times

    def add(self, kind: str, payload: int, load, times: int = 1) -> None:
        c = self.by_kind.setdefault(kind, [0] * len(COUNTERS))
        for k, v in enumerate((1, payload, load.sent, load.received, load.critical, load.mean)):
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


def reduce_layouts(layouts: Sequence[UnitLayout]) -> list[UnitLayout]:
    """Each unit's gradient reduce layout, every parameter trainable."""
    return [lay.reduce_layout((True,) * len(lay.placements))[0] for lay in layouts]


def _shard_calls(c: _Counts, lay: UnitLayout, r: int, itemsize: int, reduce: bool,
                 coalesced: bool, times: int) -> None:
    ops = calls(lay, reduce)
    for call in ops:
        c.add(call.kind, call.numel * itemsize, call.load(lay, r, itemsize), times)
    c.launch("reduce" if reduce else "gather", len(ops), coalesced, times)


def _replicate(c: _Counts, seg: Segment, R: int, replica: int, itemsize: int, reduce: bool,
               coalesced: bool, times: int) -> None:
    """The replicate dim's ops of one segment: a reduce's (the replicated run's all-reduce,
    then one reduce of each replica's run of matrices to it) or a broadcast's (each
    replica's non-empty run from it), one launch where the group coalesces."""
    ops = 0
    if reduce and seg.shared:
        n = seg.shared * itemsize
        c.add("replicate_allreduce", n, op_load("all_reduce", n, R, replica), times)
        ops += 1
    for i, _, n in seg.replica_runs:
        n *= itemsize
        c.add("replicate_reduce" if reduce else "replicate_broadcast", n,
              op_load("reduce" if reduce else "broadcast", n, R, replica, i), times)
        ops += 1
    c.launch("replicate", ops, coalesced, times)


def _walk(plan: Plan, dtypes: Dtypes, micro_batches: int, coalesced: bool) -> list[_Counts]:
    if any(pl.spec.tp > 1 for pl in plan.placements.values()):
        raise NotImplementedError("predict_comm: tensor-parallel plans are costed by the "
                                  "layout search (matrixfsdp.costs.layout_costs)")
    S, R, W = plan.shard_size, plan.replicas, plan.world_size
    layouts = unit_layouts(plan)
    reduces = reduce_layouts(layouts)
    out = []
    for w in range(W):
        r, replica = w % S, w // S
        c = _Counts()
        for ui, (lay, red) in enumerate(zip(layouts, reduces)):
            if not lay.numel:
                continue
            _shard_calls(c, lay, r, dtypes.gather, False, coalesced,
                         micro_batches * (1 if ui == 0 else 2))
            _shard_calls(c, red, r, dtypes.reduce, True, coalesced, micro_batches)
            if R == 1:
                continue
            _replicate(c, red.segment(r), R, replica, dtypes.reduce, True, coalesced,
                       micro_batches)
            if lay.has_replica_owned:
                _replicate(c, lay.segment(r), R, replica, dtypes.storage, False, coalesced, 1)
        out.append(c)
    return out


def predict_comm(plan: Plan, dtypes: Dtypes = Dtypes(), micro_batches: int = 1,
                 coalesced: bool = True) -> list[dict[str, dict[str, int]]]:
    """Per world rank, what its ``CommStats.summary()`` reads after one steady training
    step (module docstring): per collective kind, calls (NCCL ops) and payload / sent /
    received / critical / mean bytes. 1-D and HSDP plans (no tensor parallelism)."""
    return [c.summary() for c in _walk(plan, dtypes, micro_batches, coalesced)]


def predict_launches(plan: Plan, dtypes: Dtypes = Dtypes(), micro_batches: int = 1,
                     coalesced: bool = True) -> list[dict[str, int]]:
    """Per world rank, its ``CommStats.launches`` after one steady training step: launches
    per phase (``gather``, ``reduce``, ``replicate``): one per unit and direction where the
    groups coalesce (``coalesced``: NCCL), else one per op (gloo)."""
    return [dict(c.launches) for c in _walk(plan, dtypes, micro_batches, coalesced)]


# ---- memory ------------------------------------------------------------------------------
@dataclass
class Held:
    """Bytes one world rank holds between steps: ``storage`` (its segments: the parameters'
    shards with the even part's padding and the pieces' alignment), ``params`` (the shards
    ``model.parameters()`` shows, no padding), ``grads`` (the reduce outputs its ``.grad``
    views keep alive: whole reduce segments, flags included), ``optim`` (Muon momentum on the
    matrices it steps, AdamW ``exp_avg`` + ``exp_avg_sq`` on its even rows)."""

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
    if pl.tp_group:
        return pl.spec.slice_numel if pl.owner_shard == r else 0
    if pl.spec.tp > 1:
        return pl.spec.numel if (pl.owner_shard == r and pl.tp_owner == t) else 0
    start, stop = pl.row_ranges[r]
    return (stop - start) * pl.spec.row_numel


def rank_held(layouts: Sequence[UnitLayout], w: int, t: int = 0, dtypes: Dtypes = Dtypes(),
              adamw_states: int = 2) -> Held:
    """What world rank ``w`` (tp rank ``t``) holds after an optimizer step."""
    h = Held()
    for lay, red in zip(layouts, reduce_layouts(layouts)):
        S = lay.S
        r, replica = w % S, w // S
        h.storage += lay.segment(r, t).size * dtypes.storage
        stepped = False
        for pl in lay.placements:
            n = _local_numel(pl, r, t)
            h.params += n * dtypes.storage
            if n and _steps_here(pl, replica):
                stepped = True
                states = 1 if pl.spec.muon else adamw_states  # a matrix or an expert stack
                h.optim += states * n * dtypes.storage
        h.grads += red.segment(r, t).size * dtypes.storage if stepped else 0
    return h


def ranks_to_check(layouts: Sequence[UnitLayout], W: int) -> list[int]:
    """World ranks whose holdings can differ from the rest: those whose shard rank holds a
    piece (every other rank holds the even parts alone), and one rank that holds none."""
    S = layouts[0].S if layouts else 1
    pieces = {pc.rank for lay in layouts for pc in lay.pieces}
    ranks = {replica * S + r for r in pieces for replica in range(W // S)}
    bare = next((w for w in range(W) if w % S not in pieces), None)
    return sorted(ranks | ({bare} if bare is not None else set()))
