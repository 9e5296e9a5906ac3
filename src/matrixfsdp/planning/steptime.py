"""Seconds per training step of one layout, this library's and its baselines' (FSDP2 +
``torch.optim.Muon``, torchtitan's DistMuon), from a stage's costs and the workload.

**A pass** (one micro-batch's forward and backward; the runtime's schedule,
docs/overlap.md): the root unit is gathered first and kept until its backward; each
block's gather is issued when the block before it starts computing (prefetch one unit
ahead) and the block waits for it; under HSDP the step's replicate-dim broadcasts are all
issued at the start of the first pass and a unit's prefetch waits for its own (the CPU
blocks there, so the compute of the unit before it does too). Backward runs the head,
then the blocks in reverse, each gathered again (prefetched one ahead), each reduced as soon
as its backward is done; under HSDP each reduce is followed by its replicate-dim reduce.
The last block's backward gather and the root's reduce (at the end of backward) are
exposed. Collectives queue per link (NVLink, or InfiniBand for a group across nodes), first
issued first served, in parallel with compute; the replicate-dim reduces join their link's
queue when their shard reduce ends. Tensor parallelism's activation all-reduces (two per
block forward, two per backward, two more per recompute) block the compute.

**A step**: ``m`` micro-batches per data-parallel rank (``global batch / (dp x micro
batch)``). Without pipeline stages each runs a pass (gathering and reducing, the runtime's
default). With ``pp`` stages (1F1B, every stage gathered once and kept, its gradients held
unreduced, one reduce per step: :mod:`matrixfsdp.integrations.pipelining`): the first
micro-batch's gathers behind its forward, then ``(m + pp - 1)`` slots of the slowest stage's
forward + backward + two activation sends, then every reduce, exposed. Then the optimizer:
Newton-Schulz of the busiest rank's matrices at the given TFLOP/s, and the element-wise
updates at HBM bandwidth (7 accesses per AdamW element, 5 per Muon element, 4 bytes each).

**Collectives** are this library's on NCCL: one launch per unit and direction over the
shard group (an uneven all-gather / reduce-scatter), the tp hop, and each rank's own
replicate-dim calls. Every rank has its own queues, so a step is timed on the ranks whose
replicate-dim traffic weighs most (and a rank holding no piece) and the slowest counts.

**Baselines** at the same layout and links: FSDP2's all-gathers and reduce-scatters of
padded shards (HSDP: an all-reduce of the shard across replicas after each reduce-scatter),
the same schedule. FSDP2 + ``torch.optim.Muon``: each matrix's NS on its DTensor, every
matmul split over a replica's ranks with an all-gather of its operand
(:func:`dtensor_muon_step`). DistMuon as torchtitan runs it (:func:`distmuon_step`): one
bucket per block through two buffer slots; it refuses tp-split matrices, so it has no time
at ``tp > 1``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .layout_costs import RepLoad, StageCosts, UnitComm
from .links import Links, Mesh, MeshCost, p2p_time


@dataclass(frozen=True)
class Workload:
    """Per data-parallel rank: ``micro_batch`` sequences of ``seq`` tokens per micro-batch;
    ``tflops`` (FLOP/s, bf16, reached by the model's matmuls and by NS), ``hbm`` (bytes/s),
    ``checkpointing`` (recompute each block in backward)."""

    seq: int = 8192
    micro_batch: int = 1
    tflops: float = 400e12
    hbm: float = 3.35e12
    checkpointing: bool = False


@dataclass
class StepTime:
    """Seconds per step and where they go (the busiest rank of the slowest stage)."""

    total: float = 0.0
    compute: float = 0.0  # forward, backward and recompute matmuls
    tp_comm: float = 0.0  # tensor parallelism's activation all-reduces
    exposed_comm: float = 0.0  # data-parallel collectives not hidden behind compute
    bubble: float = 0.0  # pipeline fill and drain
    p2p: float = 0.0  # activations between pipeline stages
    ns: float = 0.0  # Newton-Schulz in the optimizer step
    optimizer_other: float = 0.0  # element-wise updates and the step's own collectives

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class _Link:
    """One link's queue: collectives run one at a time, in the order they were issued."""

    def __init__(self):
        self.free = 0.0
        self.deferred: list[tuple[float, int, float]] = []

    def run(self, ready: float, dur: float) -> float:
        self.flush(ready)
        self.free = max(ready, self.free) + dur
        return self.free

    def defer(self, ready: float, dur: float) -> None:
        """Issued at ``ready`` (a completion in the future): joins the queue then."""
        heapq.heappush(self.deferred, (ready, len(self.deferred), dur))

    def flush(self, until: float) -> None:
        while self.deferred and self.deferred[0][0] <= until:
            ready, _, dur = heapq.heappop(self.deferred)
            self.free = max(ready, self.free) + dur


def _links(mc: MeshCost) -> tuple[_Link, _Link]:
    """One rank's queues: the shard group's and the replicate group's (one queue where both
    travel on the same link, NVLink or the rank's NIC)."""
    a = _Link()
    return a, (a if mc.shard_link == mc.replicate_link else _Link())


Rank = tuple[int, int] | None  # (shard rank, tp rank) whose replicate loads to take; None: bare


def simulate_pass(units: Sequence[UnitComm], cf: Sequence[float], cb: Sequence[float],
                  mc: MeshCost, broadcasts: bool, reduce: bool = True,
                  forward_only: bool = False, rank: Rank = None) -> float:
    """Seconds of one forward + backward pass on ``rank`` (module docstring; its own
    replicate-dim collectives, every shard-group collective alike); ``forward_only``: until
    the end of forward; ``reduce`` False: no gradient reduce (pipeline stages)."""
    n = len(units)
    shard, rep = _links(mc)
    reps = [u.rep_at(rank) if rank is not None else u.bare for u in units]
    bc = [rep.run(0.0, r.bcast) if broadcasts and r.bcast else 0.0 for r in reps]
    done = [0.0] * n
    done[0] = shard.run(bc[0], units[0].gather)
    if n > 1:
        done[1] = shard.run(bc[1], units[1].gather)
    t = done[0]
    for k in range(1, n):
        start = max(t, done[k], bc[k + 1] if k + 1 < n else 0.0)
        if k + 1 < n:
            done[k + 1] = shard.run(start, units[k + 1].gather)
        t = start + cf[k]
    t += cf[0]
    if forward_only:
        return t
    t += cb[0]
    ends = [t]
    ready = shard.run(t, units[n - 1].gather) if n > 1 else t
    for k in range(n - 1, 0, -1):
        start = max(t, ready)
        if k > 1:
            ready = shard.run(start, units[k - 1].gather)
        t = start + cb[k]
        if reduce:
            ends.append(_reduce(shard, rep, t, units[k], reps[k]))
    if reduce:
        ends.append(_reduce(shard, rep, t, units[0], reps[0]))
    rep.flush(float("inf"))
    shard.flush(float("inf"))
    return max(ends + [shard.free, rep.free])


def _reduce(shard: _Link, rep: _Link, t: float, u: UnitComm, r: RepLoad) -> float:
    end = shard.run(t, u.reduce)
    if r.reduce:
        rep.defer(end, r.reduce)
    return end


def busiest_ranks(units: Sequence[UnitComm], m: int, count: int = 3) -> list[Rank]:
    """The ranks whose replicate-dim collectives weigh most over a step (``m`` passes),
    and a rank holding no piece: the candidates for the slowest rank."""
    def weight(r: RepLoad) -> float:
        return m * r.reduce + r.bcast
    total: dict[tuple[int, int], float] = {}
    for u in units:  # a rank's total: every unit's bare load, plus where it holds more
        bare = weight(u.bare)
        for key, r in u.rep.items():
            total[key] = total.get(key, 0.0) + weight(r) - bare
    return [None] + sorted(total, key=lambda k: -total[k])[:count]
@dataclass
class StageWork:
    """One stage's per-micro-batch compute: per unit forward and backward seconds (unit 0
    the root), of which tensor parallelism's all-reduces, and the activation send."""

    cf: list[float]
    cb: list[float]
    tp_comm: float
    p2p: float


def stage_work(block_flops: Sequence[float], head_flops: float, tokens: int, d_model: int,
               mesh: Mesh, mc: MeshCost, links: Links, w: Workload) -> StageWork:
    """Compute seconds per unit of a stage for one micro-batch (FLOPs per token given)."""
    T = mesh.tp
    ar = mc.tp.all_reduce(2.0 * tokens * d_model)
    crosses_nodes = mesh.pp_crosses_nodes(links.gpus_per_node)
    recompute = 1 if w.checkpointing else 0
    cf = [tokens * head_flops / T / w.tflops]
    cb = [2 * cf[0]]
    for f in block_flops:
        fwd = tokens * f / T / w.tflops
        cf.append(fwd + 2 * ar)
        cb.append((2 + recompute) * fwd + (2 + 2 * recompute) * ar)
    tp = len(block_flops) * (4 + 2 * recompute) * ar
    p2p = 2 * p2p_time(2.0 * tokens * d_model / T, crosses_nodes, links) if mesh.pp > 1 else 0.0
    return StageWork(cf, cb, tp, p2p)


def data_parallel_time(units: Sequence[UnitComm], work: StageWork, mesh: Mesh, mc: MeshCost,
                       m: int, rank: Rank = None) -> tuple[float, float]:
    """(seconds of the forward/backward part of a step on ``rank``, of which pipeline
    bubble)."""
    busy = sum(work.cf) + sum(work.cb)
    if mesh.pp == 1:
        first = simulate_pass(units, work.cf, work.cb, mc, broadcasts=True, rank=rank)
        rest = simulate_pass(units, work.cf, work.cb, mc, broadcasts=False, rank=rank) \
            if m > 1 else 0.0
        return first + (m - 1) * rest, 0.0
    fwd = simulate_pass(units, work.cf, work.cb, mc, True, forward_only=True, rank=rank)
    gathers_exposed = fwd - sum(work.cf)
    slots = (m + mesh.pp - 1) * (busy + work.p2p)
    shard, rep = _links(mc)
    end = max([0.0] + [_reduce(shard, rep, 0.0, u, u.rep_at(rank) if rank else u.bare)
                       for u in units])
    rep.flush(float("inf"))
    end = max(end, rep.free)
    return gathers_exposed + slots + end, (mesh.pp - 1) * busy


def assemble(units: Sequence[UnitComm], work: StageWork, mesh: Mesh, mc: MeshCost, m: int,
             ns: float, other: float) -> StepTime:
    """A step from its stage's units and compute, ``m`` micro-batches, the optimizer's NS
    and other seconds: the slowest of the ranks whose replicate-dim collectives weigh most
    (:func:`busiest_ranks`; every shard-group collective is the same on every rank)."""
    dp, bubble = max((data_parallel_time(units, work, mesh, mc, m, r)
                      for r in busiest_ranks(units, m)), key=lambda x: x[0])
    busy = sum(work.cf) + sum(work.cb)
    compute = busy * m
    p2p = work.p2p * (m + mesh.pp - 1) if mesh.pp > 1 else 0.0
    exposed = max(0.0, dp - compute - bubble - p2p)
    tp = work.tp_comm * m
    return StepTime(dp + ns + other, compute - tp, tp, exposed, bubble, p2p, ns, other)


def ours(st: StageCosts, work: StageWork, mesh: Mesh, mc: MeshCost, w: Workload,
         m: int) -> StepTime:
    return assemble(st.units, work, mesh, mc, m, st.ns_max / w.tflops, st.elementwise / w.hbm)


def dtensor_muon_step(shapes: Sequence[tuple[int, int]], ns_steps: int, mesh: Mesh,
                      mc: MeshCost, w: Workload) -> float:
    """FSDP2 + ``torch.optim.Muon`` (torch 2.13): each matrix's Newton-Schulz on its
    ``DTensor`` gradient, whose sharding propagation splits every matmul over the ``S x tp``
    ranks of a replica and all-gathers an operand for it (``X`` twice and ``X X^T`` once per
    iteration, bf16), one matrix after the other, every replica alike. Measured shape of it:
    808 collectives in one step of the bench's 48 matrices (docs/benchmarks.md)."""
    P = mesh.shard * mesh.tp
    total = 0.0
    for rows, cols in shapes:
        a, b = min(rows, cols), max(rows, cols)
        flops = ns_steps * (4 * a * a * b + 2 * a ** 3)
        gathers = 2 * mc.replica.ring(2.0 * a * b) + mc.replica.ring(2.0 * a * a)
        total += flops / P / w.tflops + ns_steps * gathers + mc.replica.all_reduce(4.0)
    return total


def fsdp2_muon(st: StageCosts, work: StageWork, mesh: Mesh, mc: MeshCost, w: Workload,
               m: int, shapes: Sequence[tuple[int, int]], ns_steps: int) -> StepTime:
    ns = dtensor_muon_step(shapes, ns_steps, mesh, mc, w)
    return assemble(st.fsdp2_units, work, mesh, mc, m, ns, st.elementwise / w.hbm)


@dataclass(frozen=True)
class Bucket:
    """One of DistMuon's buckets (a block's matrices): per matrix its NS FLOPs and bytes."""

    flops: tuple[float, ...]
    nbytes: tuple[int, ...]


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
                  ) -> float:
    """torchtitan's DistMuon step, as ``_BucketedRedistributionRuntime.run`` runs it: per
    bucket an all-to-all gathers each matrix to its owner (FSDP2 shards in, the whole
    matrix out), the owner runs NS on its compute stream, an all-to-all scatters the update
    back; two buffer slots, so bucket ``k + 2``'s gather waits for bucket ``k``'s scatter,
    which waits for every owner of bucket ``k``. Each replica repeats it."""
    P = mesh.shard
    transfer, gathered, cfree = 0.0, {}, {}
    cumulative: dict[int, float] = {}
    fresh = [0]
    moves = []
    for b in buckets:
        owners = _bucket_owners(b, P, cumulative, fresh)
        got: dict[int, float] = {}
        for r, n in zip(owners, b.nbytes):
            got[r] = got.get(r, 0.0) + n
        total = sum(b.nbytes)
        busiest = max(max(got.values()) * (P - 1) / P, total * (P - 1) / P / P) if P > 1 else 0
        moves.append((owners, mc.replica.all_to_all(busiest)))

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
            cfree[r] = max(cfree.get(r, 0.0), gathered[k]) + f / w.tflops
            done = max(done, cfree[r])
        transfer = max(transfer, done) + a2a  # the scatter: after every owner's NS
        if k + 2 < len(buckets):
            gather(k + 2)
    return transfer


def distmuon(st: StageCosts, work: StageWork, mesh: Mesh, mc: MeshCost, w: Workload,
             m: int, buckets: Sequence[Bucket]) -> StepTime | None:
    """DistMuon at this layout, or None where torchtitan's cannot run it: it refuses 2-D
    matrices sharded over tp ("multi-axis transport is not implemented")."""
    if mesh.tp > 1:
        return None
    opt = distmuon_step(buckets, mesh, mc, w)
    return assemble(st.fsdp2_units, work, mesh, mc, m, opt, st.elementwise / w.hbm)
