"""Seconds per training step of one layout, this library's and its baselines' (FSDP2 +
``torch.optim.Muon``, torchtitan's DistMuon: :mod:`~matrixfsdp.advisor.peers`), from a
stage's costs and the workload.

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
default). With ``pp`` stages (every stage gathered once and kept, its gradients held
unreduced, one reduce per step: :mod:`matrixfsdp.integrations.pipelining`), one of torch's
schedules (:data:`SCHEDULES`): the first micro-batch's gathers behind its forward, ``m``
micro-batches of the slowest stage's forward and backward, the schedule's bubble, the
activation sends, then every reduce, exposed. Then the optimizer: Newton-Schulz of the
busiest rank's matrices, and the element-wise updates (7 fp32 accesses per AdamW element, 5
per Muon element).

**Collectives** are the ops the runtime issues (:mod:`~matrixfsdp.advisor.layout_costs`),
each at its own latency. Every rank has its own queues, so a step is timed on the ranks
whose replicate-dim traffic weighs most (and a rank holding no piece) and the slowest counts.
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
    ``tflops`` (FLOP/s reached by the model's matmuls), ``ns_tflops`` (by Newton-Schulz, bf16;
    None: ``tflops``), ``hbm`` (bytes/s of the element-wise updates; ``adamw_hbm`` /
    ``muon_hbm`` where measured apart), ``checkpointing`` (recompute each block in
    backward)."""

    seq: int = 8192
    micro_batch: int = 1
    tflops: float = 400e12
    hbm: float = 3.35e12
    checkpointing: bool = False
    ns_tflops: float | None = None
    adamw_hbm: float | None = None
    muon_hbm: float | None = None

    @property
    def ns_rate(self) -> float:
        return self.ns_tflops or self.tflops

    def elementwise(self, st: StageCosts) -> float:
        """Seconds of a stage's element-wise optimizer updates on its busiest rank."""
        return st.adamw_bytes / (self.adamw_hbm or self.hbm) + \
            st.muon_bytes / (self.muon_hbm or self.hbm)


@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule of torch's: ``v`` stages per rank (looped), ``split``: backward
    split into input and weight passes (zero bubble)."""

    name: str
    v: int
    split: bool

    def allows(self, m: int, pp: int, blocks: int) -> bool:
        """Whether torch runs it: 1F1B needs ``m >= pp``; the looped schedules need
        ``pp x v`` stages of at least one block and ``m`` a multiple of its rounds
        (``max(1, m // pp)``: ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``)."""
        if self.v == 1:
            return m >= pp
        return pp * self.v <= blocks and m % max(1, m // pp) == 0

    def in_flight(self, m: int, pp: int) -> float:
        """Micro-batches whose activations the first stage holds at its peak (in whole-stage
        units): 1F1B ``pp``; looped, ``((v-1) pp + 2 (pp-1) + 1) / v`` chunks' worth (its
        warm-up); never more than ``m``."""
        if pp == 1:
            return 1.0
        if self.v == 1:
            return float(min(m, pp))
        return min(float(m), ((self.v - 1) * pp + 2 * (pp - 1) + 1) / self.v)

    def bubble(self, pp: int, fwd: float, bwd: float, weight: float) -> float:
        """Idle seconds of the slowest stage: 1F1B ``(pp-1)(F+B)``; interleaved over ``v``
        stages per rank ``(pp-1)(F+B)/v`` (Narayanan et al. 2021); zero bubble, the weight
        pass ``W`` filling it, ``(pp-1)(F+B-2W)/v`` (Qi et al. 2023, ZB-H1: ``F+B_in-W``)."""
        if pp == 1:
            return 0.0
        busy = fwd + bwd - (2 * weight if self.split else 0.0)
        return (pp - 1) * max(busy, 0.0) / self.v


SCHEDULES = (PipelineSchedule("1F1B", 1, False), PipelineSchedule("interleaved 1F1B", 2, False),
             PipelineSchedule("interleaved zero bubble", 2, True))
ONE_STAGE = SCHEDULES[0]


@dataclass
class StepTime:
    """Seconds per step and where they go (the busiest rank of the slowest stage)."""

    total: float = 0.0
    compute: float = 0.0  # forward, backward and recompute matmuls
    tp_comm: float = 0.0  # tensor parallelism's activation all-reduces
    exposed_comm: float = 0.0  # data-parallel collectives not hidden behind compute
    bubble: float = 0.0  # pipeline fill and drain
    p2p: float = 0.0  # activations between pipeline stages
    ns: float = 0.0  # Newton-Schulz in the optimizer step (or the peer's optimizer exchange)
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
    the root), of which tensor parallelism's all-reduces, the weight-gradient matmuls
    (``weight``: what a zero-bubble schedule defers), and the activation send."""

    cf: list[float]
    cb: list[float]
    tp_comm: float
    p2p: float
    weight: float = 0.0


def stage_work(block_flops: Sequence[float], head_flops: float, tokens: int, d_model: int,
               mesh: Mesh, mc: MeshCost, links: Links, w: Workload) -> StageWork:
    """Compute seconds per unit of a stage for one micro-batch (FLOPs per token given)."""
    T = mesh.tp
    ar = mc.tp.all_reduce(2.0 * tokens * d_model)
    crosses_nodes = mesh.pp_crosses_nodes(links.gpus_per_node)
    recompute = 1 if w.checkpointing else 0
    cf = [tokens * head_flops / T / w.tflops]
    cb = [2 * cf[0]]
    weight = cf[0]
    for f in block_flops:
        fwd = tokens * f / T / w.tflops
        cf.append(fwd + 2 * ar)
        cb.append((2 + recompute) * fwd + (2 + 2 * recompute) * ar)
        weight += fwd
    tp = len(block_flops) * (4 + 2 * recompute) * ar
    p2p = 2 * p2p_time(2.0 * tokens * d_model / T, crosses_nodes, links) if mesh.pp > 1 else 0.0
    return StageWork(cf, cb, tp, p2p, weight)


def data_parallel_time(units: Sequence[UnitComm], work: StageWork, mesh: Mesh, mc: MeshCost,
                       m: int, rank: Rank = None, schedule: PipelineSchedule = ONE_STAGE
                       ) -> tuple[float, float]:
    """(seconds of the forward/backward part of a step on ``rank``, of which pipeline
    bubble)."""
    if mesh.pp == 1:
        first = simulate_pass(units, work.cf, work.cb, mc, broadcasts=True, rank=rank)
        rest = simulate_pass(units, work.cf, work.cb, mc, broadcasts=False, rank=rank) \
            if m > 1 else 0.0
        return first + (m - 1) * rest, 0.0
    fwd = simulate_pass(units, work.cf, work.cb, mc, True, forward_only=True, rank=rank)
    gathers_exposed = fwd - sum(work.cf)
    bubble = schedule.bubble(mesh.pp, sum(work.cf), sum(work.cb), work.weight)
    sends = (m + mesh.pp - 1) * schedule.v * work.p2p
    shard, rep = _links(mc)
    end = max([0.0] + [_reduce(shard, rep, 0.0, u, u.rep_at(rank) if rank else u.bare)
                       for u in units])
    rep.flush(float("inf"))
    end = max(end, rep.free)
    busy = sum(work.cf) + sum(work.cb)
    return gathers_exposed + m * busy + bubble + sends + end, bubble


def assemble(units: Sequence[UnitComm], work: StageWork, mesh: Mesh, mc: MeshCost, m: int,
             ns: float, other: float, schedule: PipelineSchedule = ONE_STAGE) -> StepTime:
    """A step from its stage's units and compute, ``m`` micro-batches, the optimizer's NS
    and other seconds: the slowest of the ranks whose replicate-dim collectives weigh most
    (:func:`busiest_ranks`; every shard-group collective is the same on every rank)."""
    dp, bubble = max((data_parallel_time(units, work, mesh, mc, m, r, schedule)
                      for r in busiest_ranks(units, m)), key=lambda x: x[0])
    busy = sum(work.cf) + sum(work.cb)
    compute = busy * m
    p2p = work.p2p * (m + mesh.pp - 1) * schedule.v if mesh.pp > 1 else 0.0
    exposed = max(0.0, dp - compute - bubble - p2p)
    tp = work.tp_comm * m
    return StepTime(dp + ns + other, compute - tp, tp, exposed, bubble, p2p, ns, other)


def ours(st: StageCosts, work: StageWork, mesh: Mesh, mc: MeshCost, w: Workload,
         m: int, schedule: PipelineSchedule = ONE_STAGE) -> StepTime:
    return assemble(st.units, work, mesh, mc, m, st.ns_max / w.ns_rate, w.elementwise(st),
                    schedule)
