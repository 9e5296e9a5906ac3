"""A step's passes over a stage's units: which units it keeps gathered (:data:`KEEPS`), how
often it gathers and reduces each (:func:`passes_of`), and what those passes add up to:
critical-path bytes per step (:func:`step_bytes`) and, rank by rank, the launches, NCCL ops
and bytes its ``CommStats`` reads (:func:`rank_counts`; the optimizer step's:
:func:`step_counts`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..layout.loads import op_load
from ..layout.types import Plan
from .comm_costs import RepLoad, UnitComm
from .ns_costs import split_ns_ops, split_slices

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


def step_counts(plan: Plan, owner: int, T: int, tp_rank: int = 0) -> dict[str, dict[str, float]]:
    """What a rank of ``owner``'s tp group (``T`` ranks) issues in the optimizer step, as its
    ``CommStats`` reads it (phase ``step``: the split Newton-Schulz's all-reduces): launches,
    ops and critical bytes; empty where its tp group owns no matrix."""
    ops = split_ns_ops(split_slices(plan, owner), plan.ns_steps)
    if not ops or T == 1:
        return {}
    crit = sum(op_load("all_reduce", b, T, tp_rank).critical for b in ops)
    return {"step": {"launches": len(ops), "calls": len(ops), "critical_bytes": float(crit)}}
