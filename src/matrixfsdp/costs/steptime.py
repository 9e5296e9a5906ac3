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

**Collectives** are the ops the runtime issues (:mod:`~matrixfsdp.costs.comm_costs`),
each at its own latency. Every rank has its own queues, so a step is timed on the ranks
whose replicate-dim traffic weighs most (and a rank holding no piece) and the slowest counts.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

from .comm_costs import RepLoad, UnitComm
from .layout_costs import StageCosts
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


#: What can bound a step, as the critical path of its simulation names it: data-parallel
#: collectives (and pipeline sends), matmuls (with recompute and the element-wise optimizer
#: updates), the optimizer's Newton-Schulz (its tp group's all-reduces included, or a peer's
#: optimizer exchange), the pipeline bubble, tensor parallelism's activation all-reduces.
BOUNDS = ("network", "compute", "Newton-Schulz", "bubble", "TP")


@dataclass
class StepTime:
    """Seconds per step and where they go (the busiest rank of the slowest stage).
    ``path``: the step's critical path in the simulation, seconds per :data:`BOUNDS` kind
    (they sum to ``total``); ``bound``: its largest."""

    total: float = 0.0
    compute: float = 0.0  # forward, backward and recompute matmuls
    tp_comm: float = 0.0  # tensor parallelism's activation all-reduces
    exposed_comm: float = 0.0  # data-parallel collectives not hidden behind compute
    bubble: float = 0.0  # pipeline fill and drain
    p2p: float = 0.0  # activations between pipeline stages
    ns: float = 0.0  # Newton-Schulz in the optimizer step (or the peer's optimizer exchange)
    optimizer_other: float = 0.0  # element-wise updates and the step's own collectives
    recompute: float = 0.0  # of ``compute``: the checkpointed blocks' forward, again
    _path: Callable[[], dict[str, float]] | dict[str, float] | None = field(
        default=None, repr=False, compare=False)

    @property
    def path(self) -> dict[str, float]:
        """The critical path's seconds per kind (computed once, when first asked)."""
        if callable(self._path):
            self._path = self._path()
        return dict(self._path or {})

    @property
    def bound(self) -> str:
        path = self.path
        return max(BOUNDS, key=lambda k: path.get(k, 0.0)) if path else "compute"

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_path"}


Node = tuple  # (end, ((kind, seconds), ...), predecessor Node | None): the critical path


class _Link:
    """One link's queue: collectives run one at a time, in the order they were issued.
    ``trace``: each op also a :data:`Node` (``last``: the one ending at ``free``)."""

    def __init__(self, trace: bool = False):
        self.free = 0.0
        self.trace = trace
        self.last: Node | None = None
        self.deferred: list[tuple[float, int, float, Node | None]] = []

    def run(self, ready: float, dur: float, pred: Node | None = None) -> float:
        self.flush(ready)
        if self.trace:
            start, p = (ready, pred) if ready >= self.free else (self.free, self.last)
            self.free = start + dur
            self.last = (self.free, (("network", dur),), p)
            return self.free
        self.free = max(ready, self.free) + dur
        return self.free

    def defer(self, ready: float, dur: float, pred: Node | None = None) -> None:
        """Issued at ``ready`` (a completion in the future): joins the queue then."""
        heapq.heappush(self.deferred, (ready, len(self.deferred), dur, pred))

    def flush(self, until: float) -> None:
        while self.deferred and self.deferred[0][0] <= until:
            ready, _, dur, pred = heapq.heappop(self.deferred)
            if self.trace:
                start, p = (ready, pred) if ready >= self.free else (self.free, self.last)
                self.free = start + dur
                self.last = (self.free, (("network", dur),), p)
            else:
                self.free = max(ready, self.free) + dur


def _links(mc: MeshCost, trace: bool = False) -> tuple[_Link, _Link]:
    """One rank's queues: the shard group's and the replicate group's (one queue where both
    travel on the same link, NVLink or the rank's NIC)."""
    a = _Link(trace)
    return a, (a if mc.shard_link == mc.replicate_link else _Link(trace))


Rank = tuple[int, int] | None  # (shard rank, tp rank) whose replicate loads to take; None: bare


def walk(node: Node | None, into: dict[str, float] | None = None, times: float = 1.0
         ) -> dict[str, float]:
    """The seconds per kind along a critical path, from its last node back (``times``:
    counted that many times, for passes alike)."""
    out = into if into is not None else {}
    while node is not None:
        for kind, secs in node[1]:
            if secs:
                out[kind] = out.get(kind, 0.0) + times * secs
        node = node[2]
    return out


Flags = tuple[Sequence[bool], Sequence[bool], Sequence[bool]]  # per unit: gathered in
# forward, gathered again in backward, reduced


def simulate_pass(units: Sequence[UnitComm], cf: Sequence[float], cb: Sequence[float],
                  mc: MeshCost, broadcasts: bool, reduce: bool = True,
                  forward_only: bool = False, rank: Rank = None, flags: Flags | None = None,
                  tp_f: Sequence[float] | None = None, tp_b: Sequence[float] | None = None,
                  path: dict[str, float] | None = None, times: float = 1.0) -> float:
    """Seconds of one forward + backward pass on ``rank`` (module docstring; its own
    replicate-dim collectives, every shard-group collective alike); ``forward_only``: until
    the end of forward; ``reduce`` False: no gradient reduce (pipeline stages). ``flags``:
    per unit whether this pass gathers it in forward, gathers it again in backward and
    reduces it (default: all; a unit kept gathered is neither gathered nor, until the last
    micro-batch, reduced: :func:`pass_flags`). ``path``: add the pass's critical path to it
    (seconds per kind, ``times`` over; ``tp_f`` / ``tp_b``: the tensor-parallel seconds in
    each unit's ``cf`` / ``cb``)."""
    n = len(units)
    trace = path is not None
    shard, rep = _links(mc, trace)
    reps = [u.rep_at(rank) if rank is not None else u.bare for u in units]
    tp_f = tp_f or [0.0] * n
    tp_b = tp_b or [0.0] * n
    fg, bg, rd = flags or ((True,) * n,) * 3
    none: tuple[float, Node | None] = (0.0, None)

    def comp(start: float, pred: Node | None, dur: float, tp: float) -> tuple[float, Node | None]:
        end = start + dur
        return end, ((end, (("compute", dur - tp), ("TP", tp)), pred) if trace else None)

    def later(*pairs: tuple[float, Node | None]) -> tuple[float, Node | None]:
        return max(pairs, key=lambda p: p[0])

    def gather(k: int, ready: tuple[float, Node | None]) -> tuple[float, Node | None]:
        return shard.run(ready[0], units[k].gather, ready[1]), shard.last

    bc = [none] * n
    if broadcasts:
        for k, r in enumerate(reps):
            if r.bcast:
                bc[k] = (rep.run(0.0, r.bcast), rep.last)
    done = [none] * n
    for k in range(min(n, 2)):
        if fg[k]:
            done[k] = gather(k, bc[k])
    t = done[0]
    for k in range(1, n):
        start = later(t, done[k], bc[k + 1] if k + 1 < n else none)
        if k + 1 < n and fg[k + 1]:
            done[k + 1] = gather(k + 1, start)
        t = comp(start[0], start[1], cf[k], tp_f[k])
    t = comp(t[0], t[1], cf[0], tp_f[0])
    if forward_only:
        if trace:
            walk(t[1], path, times)
        return t[0]
    t = comp(t[0], t[1], cb[0], tp_b[0])
    ends = [t]
    ready = gather(n - 1, t) if n > 1 and bg[n - 1] else t
    for k in range(n - 1, 0, -1):
        start = later(t, ready)
        if k > 1:
            ready = gather(k - 1, start) if bg[k - 1] else none
        t = comp(start[0], start[1], cb[k], tp_b[k])
        if reduce and rd[k]:
            ends.append(_reduce(shard, rep, t, units[k], reps[k]))
    ends.append(t)  # backward's last compute (where nothing is reduced after it)
    if reduce and rd[0]:
        ends.append(_reduce(shard, rep, t, units[0], reps[0]))
    rep.flush(float("inf"))
    shard.flush(float("inf"))
    end = later(*ends, (shard.free, shard.last), (rep.free, rep.last))
    if trace:
        walk(end[1], path, times)
    return end[0]


def _reduce(shard: _Link, rep: _Link, t: tuple[float, Node | None], u: UnitComm, r: RepLoad
            ) -> tuple[float, Node | None]:
    end = shard.run(t[0], u.reduce, t[1])
    node = shard.last
    if r.reduce:
        rep.defer(end, r.reduce, node)
    return end, node


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
    the root), of which tensor parallelism's all-reduces (``tp_f``, ``tp_b``), the
    weight-gradient matmuls (``weight``: what a zero-bubble schedule defers), the activation
    send, and the checkpointed blocks' recompute (``recompute``, in ``cb``)."""

    cf: list[float]
    cb: list[float]
    tp_comm: float
    p2p: float
    weight: float = 0.0
    tp_f: list[float] = field(default_factory=list)
    tp_b: list[float] = field(default_factory=list)
    recompute: float = 0.0


def stage_work(block_flops: Sequence[float], head_flops: float, tokens: int, d_model: int,
               mesh: Mesh, mc: MeshCost, links: Links, w: Workload,
               checkpointed: Sequence[bool] | None = None) -> StageWork:
    """Compute seconds per unit of a stage for one micro-batch (FLOPs per token given).
    ``checkpointed``: per block, whether its backward recomputes its forward (default: all
    of them where ``w.checkpointing``)."""
    T = mesh.tp
    ar = mc.tp.all_reduce(2.0 * tokens * d_model)
    crosses_nodes = mesh.pp_crosses_nodes(links.gpus_per_node)
    if checkpointed is None:
        checkpointed = [w.checkpointing] * len(block_flops)
    cf = [tokens * head_flops / T / w.tflops]
    cb = [2 * cf[0]]
    tp_f, tp_b = [0.0], [0.0]
    weight = cf[0]
    again = tp = 0.0
    for f, ck in zip(block_flops, checkpointed):
        fwd = tokens * f / T / w.tflops
        re = 1 if ck else 0
        cf.append(fwd + 2 * ar)
        cb.append((2 + re) * fwd + (2 + 2 * re) * ar)
        tp_f.append(2 * ar)
        tp_b.append((2 + 2 * re) * ar)
        tp += (4 + 2 * re) * ar
        again += re * fwd
        weight += fwd
    p2p = 2 * p2p_time(2.0 * tokens * d_model / T, crosses_nodes, links) if mesh.pp > 1 else 0.0
    return StageWork(cf, cb, tp, p2p, weight, tp_f, tp_b, again)


def pass_flags(n: int, m: int, keep: str = "each") -> list[tuple[bool, Flags, int]]:
    """A step's distinct passes over ``n`` units: (its broadcasts, its :data:`Flags`, how
    many), as the runtime runs ``keep`` (:data:`~matrixfsdp.costs.passes.KEEPS`):
    every unit gathered and reduced each micro-batch; or the root (``"root"``), and the
    first block too (``"edges"``), gathered in the first micro-batch and reduced in the last,
    kept gathered between; ``"edges"``: the last block not gathered again in backward."""
    kept = {0} if keep == "root" else {0, 1} if keep == "edges" else set()
    bg = [k != 0 and not (keep == "edges" and k in (1, n - 1)) for k in range(n)]

    def flags(first: bool, last: bool) -> Flags:
        return ([first or k not in kept for k in range(n)], bg,
                [last or k not in kept for k in range(n)])
    if m == 1:
        return [(True, flags(True, True), 1)]
    out = [(True, flags(True, False), 1)]
    if m > 2:
        out.append((False, flags(False, False), m - 2))
    return out + [(False, flags(False, True), 1)]


def data_parallel_time(units: Sequence[UnitComm], work: StageWork, mesh: Mesh, mc: MeshCost,
                       m: int, rank: Rank = None, schedule: PipelineSchedule = ONE_STAGE,
                       keep: str = "each", path: dict[str, float] | None = None
                       ) -> tuple[float, float]:
    """(seconds of the forward/backward part of a step on ``rank``, of which pipeline
    bubble); ``path``: its critical path added (seconds per kind)."""
    if mesh.pp == 1:
        return sum(times * simulate_pass(units, work.cf, work.cb, mc, bc, rank=rank, flags=fl,
                                         tp_f=work.tp_f, tp_b=work.tp_b, path=path, times=times)
                   for bc, fl, times in pass_flags(len(units), m, keep)), 0.0
    fwd = simulate_pass(units, work.cf, work.cb, mc, True, forward_only=True, rank=rank)
    gathers_exposed = fwd - sum(work.cf)
    bubble = schedule.bubble(mesh.pp, sum(work.cf), sum(work.cb), work.weight)
    sends = (m + mesh.pp - 1) * schedule.v * work.p2p
    shard, rep = _links(mc)
    end = max([0.0] + [_reduce(shard, rep, (0.0, None), u, u.rep_at(rank) if rank else u.bare)[0]
                       for u in units])
    rep.flush(float("inf"))
    end = max(end, rep.free)
    busy = sum(work.cf) + sum(work.cb)
    if path is not None:
        tp = sum(work.tp_f) + sum(work.tp_b)
        for kind, secs in (("network", gathers_exposed + sends + end), ("bubble", bubble),
                           ("compute", m * (busy - tp)), ("TP", m * tp)):
            path[kind] = path.get(kind, 0.0) + secs
    return gathers_exposed + m * busy + bubble + sends + end, bubble


def assemble(units: Sequence[UnitComm], work: StageWork, mesh: Mesh, mc: MeshCost, m: int,
             ns: float, other: float, schedule: PipelineSchedule = ONE_STAGE,
             keep: str = "each") -> StepTime:
    """A step from its stage's units and compute, ``m`` micro-batches, the optimizer's NS
    and other seconds: the slowest of the ranks whose replicate-dim collectives weigh most
    (:func:`busiest_ranks`; every shard-group collective is the same on every rank), its
    critical path traced when first asked for (:attr:`StepTime.path`)."""
    dp, bubble, slowest = max(
        ((*data_parallel_time(units, work, mesh, mc, m, r, schedule, keep), r)
         for r in busiest_ranks(units, m)), key=lambda x: x[0])
    busy = sum(work.cf) + sum(work.cb)
    compute = busy * m
    p2p = work.p2p * (m + mesh.pp - 1) * schedule.v if mesh.pp > 1 else 0.0
    exposed = max(0.0, dp - compute - bubble - p2p)
    tp = work.tp_comm * m

    def path() -> dict[str, float]:
        out: dict[str, float] = {}
        data_parallel_time(units, work, mesh, mc, m, slowest, schedule, keep, out)
        out["Newton-Schulz"] = out.get("Newton-Schulz", 0.0) + ns
        out["compute"] = out.get("compute", 0.0) + other
        return out
    return StepTime(dp + ns + other, compute - tp, tp, exposed, bubble, p2p, ns, other,
                    work.recompute * m, path)


def ours(st: StageCosts, work: StageWork, mesh: Mesh, mc: MeshCost, w: Workload,
         m: int, schedule: PipelineSchedule = ONE_STAGE, keep: str = "each") -> StepTime:
    ns = st.ns_seconds if st.ns_seconds is not None else st.ns_max / w.ns_rate
    return assemble(st.units, work, mesh, mc, m, ns, w.elementwise(st), schedule, keep)
