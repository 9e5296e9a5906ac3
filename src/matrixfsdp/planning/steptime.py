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

**Baselines** at the same layout and links: FSDP2's all-gathers and reduce-scatters of
padded shards (HSDP: an all-reduce of the shard across replicas after each reduce-scatter),
the same schedule. FSDP2 + ``torch.optim.Muon``: every rank runs NS on every matrix after
gathering it (one all-gather of its bf16 update per matrix over the shard group's ``S x
tp`` ranks). DistMuon: each matrix gathered to one owner (longest-processing-time over
the ``S x tp`` ranks of a replica, repeated on every replica) and scattered back, two
all-to-alls in the storage dtype.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .layout_costs import StageCosts, UnitComm
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
    """The shard group's queue and the replicate group's (the same one on one link)."""
    a = _Link()
    return a, (a if mc.shard_link == mc.replicate_link else _Link())


def simulate_pass(units: Sequence[UnitComm], cf: Sequence[float], cb: Sequence[float],
                  mc: MeshCost, broadcasts: bool, reduce: bool = True,
                  forward_only: bool = False) -> float:
    """Seconds of one forward + backward pass (module docstring); ``forward_only``: until
    the end of forward; ``reduce`` False: no gradient reduce (pipeline stages)."""
    n = len(units)
    shard, rep = _links(mc)
    bc = [rep.run(0.0, u.rep_bcast) if broadcasts else 0.0 for u in units]
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
            ends.append(_reduce(shard, rep, t, units[k]))
    if reduce:
        ends.append(_reduce(shard, rep, t, units[0]))
    rep.flush(float("inf"))
    shard.flush(float("inf"))
    return max(ends + [shard.free, rep.free])


def _reduce(shard: _Link, rep: _Link, t: float, u: UnitComm) -> float:
    end = shard.run(t, u.reduce)
    if u.rep_reduce:
        rep.defer(end, u.rep_reduce)
    return end


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
                       m: int) -> tuple[float, float]:
    """(seconds of the forward/backward part of a step, of which pipeline bubble)."""
    busy = sum(work.cf) + sum(work.cb)
    if mesh.pp == 1:
        first = simulate_pass(units, work.cf, work.cb, mc, broadcasts=True)
        rest = simulate_pass(units, work.cf, work.cb, mc, broadcasts=False) if m > 1 \
            else 0.0
        return first + (m - 1) * rest, 0.0
    fwd = simulate_pass(units, work.cf, work.cb, mc, True, forward_only=True)
    gathers_exposed = fwd - sum(work.cf)
    slots = (m + mesh.pp - 1) * (busy + work.p2p)
    shard, rep = _links(mc)
    end = max([0.0] + [_reduce(shard, rep, 0.0, u) for u in units])
    rep.flush(float("inf"))
    end = max(end, rep.free)
    return gathers_exposed + slots + end, (mesh.pp - 1) * busy


def assemble(units: Sequence[UnitComm], work: StageWork, mesh: Mesh, mc: MeshCost, m: int,
             ns: float, other: float) -> StepTime:
    """A step from its stage's units and compute, ``m`` micro-batches, the optimizer's NS
    and other seconds."""
    dp, bubble = data_parallel_time(units, work, mesh, mc, m)
    busy = sum(work.cf) + sum(work.cb)
    compute = busy * m
    p2p = work.p2p * (m + mesh.pp - 1) if mesh.pp > 1 else 0.0
    exposed = max(0.0, dp - compute - bubble - p2p)
    tp = work.tp_comm * m
    return StepTime(dp + ns + other, compute - tp, tp, exposed, bubble, p2p, ns, other)


def ours(st: StageCosts, work: StageWork, mesh: Mesh, mc: MeshCost, w: Workload,
         m: int) -> StepTime:
    return assemble(st.units, work, mesh, mc, m, st.ns_max / w.tflops, st.elementwise / w.hbm)


def fsdp2_muon(st: StageCosts, work: StageWork, mesh: Mesh, mc: MeshCost, w: Workload,
               m: int) -> StepTime:
    gathers = sum(mc.replica.ring(2.0 * n) for n in st.matrix_numel)  # bf16 NS inputs
    return assemble(st.fsdp2_units, work, mesh, mc, m, st.ns_total / w.tflops,
                    st.elementwise / w.hbm + gathers)


def distmuon(st: StageCosts, work: StageWork, mesh: Mesh, mc: MeshCost, w: Workload,
             m: int, ns: float, owned: int, storage: int) -> StepTime:
    """``ns``, ``owned``: the busiest rank's NS FLOPs and bytes of matrices it owns
    (:func:`~matrixfsdp.planning.layout_costs.lpt_max` over a replica's ranks)."""
    P = mesh.shard * mesh.tp
    total = sum(st.matrix_numel) * storage
    busiest = max(owned * (P - 1) / P, total / P) if P > 1 else 0.0
    return assemble(st.fsdp2_units, work, mesh, mc, m, ns / w.tflops,
                    st.elementwise / w.hbm + 2 * mc.replica.all_to_all(busiest))
