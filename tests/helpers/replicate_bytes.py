"""HSDP's replicate-dim bytes read off a plan's layouts (:mod:`matrixfsdp.layout.units`):
what one step moves across the replicate dim on a world rank (runtime/test_hsdp.py against
the profiler's count; benchmarks/test_bench.py against the bench's report)."""

from __future__ import annotations

from matrixfsdp.layout.traffic import reduce_layouts
from matrixfsdp.layout.units import unit_layouts


def replicate_bytes_from_layout(plan, rank: int) -> dict[str, int]:
    """What one step of ours should move across the replicate dim on world rank ``rank``,
    read off the plan's layouts (matrixfsdp.layout.units): per unit, the all-reduce of
    this shard rank's rows of every even parameter and of one gradient flag per parameter
    (fp32: which ranks had a gradient), the reduce of each Muon matrix stored on this shard
    rank to its owner replica and its broadcast back (in the next forward), each run 16-element
    aligned; ``extra``: what those runs hold beyond the rows and matrices (flags, alignment)."""
    s = rank % plan.shard_size
    out = {"c10d::allreduce_": 0, "c10d::reduce_": 0, "c10d::broadcast_": 0}
    for lay, red in zip(unit_layouts(plan), reduce_layouts(unit_layouts(plan))):
        grad, store = red.segment(s), lay.segment(s)
        out["c10d::allreduce_"] += 4 * grad.shared
        out["c10d::reduce_"] += 4 * sum(n for k, (_, n) in grad.runs.items() if k)
        if lay.has_replica_owned:
            out["c10d::broadcast_"] += 4 * sum(n for k, (_, n) in store.runs.items() if k)
    rows = sum(pl.local_rows(s) * pl.spec.row_numel * pl.spec.itemsize
               for pl in plan.placements.values() if pl.owner is None)
    mats = sum(pl.spec.numel * pl.spec.itemsize for pl in plan.placements.values()
               if pl.owner is not None and pl.owner_shard == s)
    flags = 4 * len(plan.placements)
    assert out["c10d::allreduce_"] == rows + flags
    pieces = sum(1 for pl in plan.placements.values()
                 if pl.owner is not None and pl.owner_shard == s)
    assert mats <= out["c10d::reduce_"] < mats + 4 * 16 * max(pieces, 1)  # alignment only
    # beyond FSDP2 HSDP's, in bytes one rank sends over 2 replicas: the flags (all-reduced:
    # twice) and the matrices' alignment in each run (reduced once, broadcast once)
    bcast = out["c10d::broadcast_"] - (mats if out["c10d::broadcast_"] else 0)
    out["extra"] = (2 * flags + out["c10d::reduce_"] - mats + bcast) / 2
    return out
