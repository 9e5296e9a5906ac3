"""The peers' optimizer steps as their code runs, for ``matrixfsdp plan``'s comparison:
FSDP2 + ``torch.optim.Muon`` on DTensor gradients, and torchtitan's DistMuon with its
bucket size searched, its buffers counted and its refusals kept.

**torch.optim.Muon on DTensor** (torch 2.13, ``torch/optim/_muon.py``'s
``_zeropower_via_newtonschulz``: ``X = G.bfloat16()``, transposed when tall, normalised,
then per iteration ``A = X @ X.T``, ``B = addmm(A, A, A)``, ``X = addmm(X, B, X)``), one
matrix after the other, each op a collective of its own that DTensor's sharding
propagation issues (traced under torch's fake process group, ``tests/advisor/test_plan_peers.py``
holds these lists against it). ``a = min(rows, cols)``, ``b = max``, over ``S`` shard and
``T`` tp ranks (FSDP2 + TP places a colwise matrix ``(_StridedShard(0), Shard(0))``, a
rowwise one ``(Shard(0), Shard(1))``; HSDP's replicate dim is ``Replicate``, so every
replica repeats it):

* 1-D, wide: per iteration all-gathers of ``X^T``, ``A`` and ``X`` (``ab/S``, ``a^2/S``,
  ``ab/S`` elements in); the FLOPs split ``S`` ways;
* 1-D, tall: per iteration two all-reduces of the ``a x a`` Gram (the contraction is
  sharded); ``4a^2b/S`` split, ``2a^3`` on every rank;
* colwise, wide: ``X`` is all-gathered whole, four times over the two mesh dims, then NS
  runs whole on every rank;
* colwise, tall: per iteration two Gram all-reduces over each mesh dim; ``2a^3`` on every
  rank;
* rowwise: per iteration three all-gathers and two all-reduces of a shard of the Gram
  (sizes in :func:`dtensor_ns_ops`); ``2a^3`` split over one mesh dim only;
* and one (1-D) or two (2-D) scalar all-reduces for the norm.

**DistMuon** (torchtitan 0.3.0, ``torchtitan/distributed/flex_shard/dist_muon.py``,
``_optimizer_reshard_runtime.py``): matrices in buckets of ``k`` blocks (searched: 1, 2,
4, ... blocks, torchtitan's configs use 1-2 layers); per bucket an all-to-all gathers each
matrix to an owner (longest processing time within the bucket, ties to the least loaded so
far: ``_balance_loads_across_partitions``), the owner runs NS on its compute stream, an
all-to-all scatters the update back; two buffer slots (``_BucketedRedistributionRuntime``),
so bucket ``k + 2``'s gather waits for bucket ``k``'s scatter, which waits for every owner
of bucket ``k``; every replica repeats it. Its memory beyond FSDP2's: the two slots' buffers
(each: the storage exchange of a rank's shards of the bucket, the compute exchange of the
matrices it owns in it, one matrix's shard and one whole matrix of scratch). It refuses
tensor parallelism (``_StridedShard`` storage) and pipeline parallelism (stage-local
parameter groups): torchtitan's ``_KimiTrainerConfig`` raises for either, so it has no time
at ``tp > 1`` or ``pp > 1``.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from ..costs.layout_costs import StageCosts
from ..costs.links import GroupCost, Mesh, MeshCost
from ..costs.ns_costs import NSLoads
from ..costs.steptime import ONE_STAGE, PipelineSchedule, StageWork, StepTime, Workload, assemble

BF16 = 2  # torch's NS runs in bf16

# ---- torch.optim.Muon on DTensor -----------------------------------------------------------
NSOp = tuple[str, str, int]  # (all_gather | all_reduce, "dp" | "tp", elements handed in)


def dtensor_ns_ops(rows: int, cols: int, S: int, T: int, tp_dim: int | None, steps: int
                   ) -> tuple[list[NSOp], float]:
    """The collectives DTensor issues for one ``rows x cols`` matrix's Newton-Schulz over
    ``S`` shard ranks (``"dp"``) and ``T`` tp ranks (``tp_dim``: 0 colwise, 1 rowwise, None
    not split), each with the elements this rank hands in, and the FLOPs one rank runs
    (module docstring)."""
    a, b = min(rows, cols), max(rows, cols)
    tall = rows > cols
    gram, mm = 2.0 * a ** 3, 4.0 * a * a * b  # per iteration: A @ A, and X X^T + B X
    if T == 1 or tp_dim is None:
        if S == 1:
            return [], steps * (mm + gram)
        norm = [("all_reduce", "dp", 1)]
        if tall:
            return norm + [("all_reduce", "dp", a * a)] * 2 * steps, steps * (mm / S + gram)
        it = [("all_gather", "dp", a * b // S), ("all_gather", "dp", a * a // S),
              ("all_gather", "dp", a * b // S)]
        return norm + it * steps, steps * (mm + gram) / S
    norm = [("all_reduce", "dp", 1), ("all_reduce", "tp", 1)]
    P = S * T
    if tp_dim == 0 and not tall:  # gathered whole, then NS on every rank
        whole = [("all_gather", "dp", a * b // P), ("all_gather", "tp", a * b // T)] * 4
        return norm + whole, steps * (mm + gram)
    if tp_dim == 0:
        it = [("all_reduce", "dp", a * a), ("all_reduce", "tp", a * a)] * 2
        return norm + it * steps, steps * (mm / P + gram)
    if not tall:  # rowwise, wide: X's rows over dp, its columns over tp
        it = [("all_gather", "dp", a * b // P), ("all_reduce", "tp", a * a // S),
              ("all_gather", "dp", a * a // S), ("all_reduce", "tp", a * a // S),
              ("all_gather", "dp", a * b // P)]
        return norm + it * steps, steps * (mm / P + gram / S)
    it = [("all_gather", "tp", a * b // P), ("all_reduce", "dp", a * a // T),
          ("all_gather", "tp", a * a // T), ("all_reduce", "dp", a * a // T),
          ("all_gather", "tp", a * b // P)]
    return norm + it * steps, steps * (mm / P + gram / T)


def _op_seconds(ops: Sequence[NSOp], groups: dict[str, GroupCost]) -> float:
    total = 0.0
    for kind, where, n in ops:
        g = groups[where]
        P = g.size
        busiest = n * BF16 * ((P - 1) if kind == "all_gather" else 2 * (P - 1) / P)
        total += g.single(kind, busiest)
    return total


def dtensor_muon_step(ns: NSLoads, ns_steps: int, mesh: Mesh, mc: MeshCost,
                      w: Workload) -> float:
    """FSDP2 + ``torch.optim.Muon``'s Newton-Schulz over a stage's matrices, one after the
    other (module docstring)."""
    groups = {"dp": mc.shard, "tp": mc.tp}
    count: dict[tuple, int] = {}
    for shape, dim in zip(ns.shapes, ns.tp_dims or [None] * len(ns.shapes)):
        key = (shape, dim)
        count[key] = count.get(key, 0) + 1
    total = 0.0
    for ((rows, cols), dim), n in count.items():
        ops, flops = _dtensor_ns(rows, cols, mesh.shard, mesh.tp, dim, ns_steps)
        total += n * (_op_seconds(ops, groups) + flops / w.ns_rate)
    return total


@functools.lru_cache(maxsize=4096)
def _dtensor_ns(rows: int, cols: int, S: int, T: int, dim: int | None, steps: int):
    ops, flops = dtensor_ns_ops(rows, cols, S, T, dim, steps)
    return tuple(ops), flops


def fsdp2_muon(st: StageCosts, work: StageWork, mesh: Mesh, mc: MeshCost, w: Workload,
               m: int, opt: float, schedule: PipelineSchedule = ONE_STAGE) -> StepTime:
    """FSDP2 + torch.optim.Muon's step: FSDP2's collectives, ``opt`` seconds of
    :func:`dtensor_muon_step`."""
    return assemble(st.fsdp2_units, work, mesh, mc, m, opt, w.elementwise(st), schedule)


# ---- torchtitan's DistMuon ----------------------------------------------------------------
@dataclass(frozen=True)
class Bucket:
    """One of DistMuon's buckets (some blocks' matrices): per matrix its NS FLOPs and bytes."""

    flops: tuple[float, ...]
    nbytes: tuple[int, ...]


def buckets_of(ns: NSLoads, storage: int, blocks: int) -> list[Bucket]:
    """DistMuon's buckets of ``blocks`` consecutive units holding matrices each."""
    by_unit: dict[int, list[int]] = {}
    for i, u in enumerate(ns.units):
        by_unit.setdefault(u, []).append(i)
    units = [idx for _, idx in sorted(by_unit.items())]
    out = []
    for k in range(0, len(units), blocks):
        idx = [i for group in units[k:k + blocks] for i in group]
        out.append(Bucket(tuple(ns.costs[i] for i in idx),
                          tuple(ns.numel[i] * storage for i in idx)))
    return out


def bucket_sizes(units: int) -> list[int]:
    """The bucket sizes searched (blocks per bucket): 1, 2, 4, ... and all of them."""
    out, k = [], 1
    while k < units:
        out.append(k)
        k *= 2
    return out + [max(units, 1)]


def _bucket_owners(b: Bucket, ranks: int, cumulative: dict[int, float],
                   fresh: list[int]) -> list[int]:
    """torchtitan's owners of a bucket's matrices: longest processing time over the ranks,
    ties to the least cumulative load (``_balance_loads_across_partitions``)."""
    order = sorted(range(len(b.flops)), key=lambda i: (-b.flops[i], -b.nbytes[i], i))
    owners = [0] * len(order)
    if ranks >= len(order):  # each matrix on its own rank: the least loaded so far
        used = sorted(cumulative, key=lambda r: (cumulative[r], r))
        free = [r for r in range(fresh[0], min(ranks, fresh[0] + len(order)))]
        pick = sorted(free + used[:len(order)], key=lambda r: (cumulative.get(r, 0.0), r))
        for i, r in zip(order, pick):
            owners[i] = r
    else:
        heap = [(0.0, 0, cumulative.get(r, 0.0), r) for r in range(ranks)]
        heapq.heapify(heap)
        for i in order:
            load, held, cum, r = heapq.heappop(heap)
            owners[i] = r
            heapq.heappush(heap, (load + b.flops[i], held + b.nbytes[i], cum + b.flops[i], r))
    for i, r in enumerate(owners):
        cumulative[r] = cumulative.get(r, 0.0) + b.flops[i]
        if r >= fresh[0]:
            fresh[0] = r + 1
    return owners


def distmuon_step(buckets: Sequence[Bucket], mesh: Mesh, mc: MeshCost, w: Workload
                  ) -> tuple[float, float]:
    """torchtitan's DistMuon step over ``buckets`` (module docstring): (seconds, bytes of its
    two buffer slots on the busiest rank)."""
    P = mesh.shard
    transfer, gathered, cfree = 0.0, {}, {}
    cumulative: dict[int, float] = {}
    fresh = [0]
    moves, slots = [], [0.0, 0.0]
    for k, b in enumerate(buckets):
        owners = _bucket_owners(b, P, cumulative, fresh)
        got: dict[int, float] = {}
        for r, n in zip(owners, b.nbytes):
            got[r] = got.get(r, 0.0) + n
        total = sum(b.nbytes)
        busiest = max(max(got.values()) * (P - 1) / P, total * (P - 1) / P / P) if P > 1 else 0
        moves.append((owners, mc.replica.all_to_all(busiest)))
        largest = max(b.nbytes)
        slot = total / P + max(got.values()) + largest / P + largest
        slots[k % 2] = max(slots[k % 2], slot)

    def gather(k: int) -> None:
        nonlocal transfer
        transfer += moves[k][1]
        gathered[k] = transfer
    for k in range(min(2, len(buckets))):
        gather(k)
    for k, b in enumerate(buckets):
        owners, a2a = moves[k]
        done = gathered[k]
        for r, f in zip(owners, b.flops):
            cfree[r] = max(cfree.get(r, 0.0), gathered[k]) + f / w.ns_rate
            done = max(done, cfree[r])
        transfer = max(transfer, done) + a2a  # the scatter: after every owner's NS
        if k + 2 < len(buckets):
            gather(k + 2)
    return transfer, sum(slots)


def distmuon_refusal(mesh: Mesh) -> str | None:
    """Why torchtitan's DistMuon cannot run this layout, or None."""
    if mesh.tp > 1:
        return "tp > 1 (_StridedShard storage)"
    if mesh.pp > 1:
        return "pp > 1 (stage-local parameter groups)"
    return None


@dataclass
class DistMuonBest:
    """DistMuon's fastest bucket size at a layout: blocks per bucket, its step's optimizer
    seconds and its buffers' bytes."""

    blocks: int
    seconds: float
    buffers: float


def distmuon_best(ns: NSLoads, storage: int, mesh: Mesh, mc: MeshCost, w: Workload
                  ) -> DistMuonBest | None:
    """Every bucket size tried; the fastest (ties: the smaller buffers). None where DistMuon
    refuses the layout."""
    if distmuon_refusal(mesh) or not ns.costs:
        return None
    best = None
    for k in bucket_sizes(len(set(ns.units))):
        secs, buf = distmuon_step(buckets_of(ns, storage, k), mesh, mc, w)
        if best is None or (secs, buf) < (best.seconds, best.buffers):
            best = DistMuonBest(k, secs, buf)
    return best


def distmuon(st: StageCosts, work: StageWork, mesh: Mesh, mc: MeshCost, w: Workload,
             m: int, best: DistMuonBest | None) -> StepTime | None:
    """DistMuon at this layout with its best bucket size, or None where torchtitan refuses."""
    if best is None:
        return None
    return assemble(st.fsdp2_units, work, mesh, mc, m, best.seconds, w.elementwise(st))
