"""The layout search behind ``matrixfsdp plan``: every ``(replicate, shard, tp, pp)`` layout
of a world size (tp inside a node, activation checkpointing on and off), each planned by
the planner the runtime uses (per pipeline stage, the planner's own owners), costed
(memory per rank, critical-path bytes against FSDP2's, NS against its bound) and timed
(:mod:`~matrixfsdp.costs.steptime`). The advice is the layout with the lowest modelled
step time among those whose largest rank fits the device; none is chosen that does not fit
while one fits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..costs.links import Links, Mesh
from ..costs.steptime import ONE_STAGE, SCHEDULES, PipelineSchedule, Workload
from ..layout.traffic import Dtypes
from .evaluated import SYSTEMS, Evaluated, Layout, ac_mode
from .layout_eval import evaluate, plan_stages, tp_rates
from .model_shapes import ModelShapes, stages, tp_specs

LLAMA3_TOKENS = 2 ** 24  # Llama 3's global batch at its final stage: 16M tokens per step
H100_BF16_DENSE = 989e12  # H100 SXM's dense bf16 tensor-core peak, FLOP/s (NVIDIA datasheet)


@dataclass
class Search:
    """Every layout searched, the advice (None: no layout), and how long it took."""

    layouts: list[Evaluated]
    recommended: Evaluated | None
    seconds: float
    world_size: int
    global_batch: int
    floor: float = 0.0  # the compute floor: the step's model FLOPs over every rank's rate
    peak: float = H100_BF16_DENSE  # the GPU's dense bf16 FLOP/s, for MFU
    tp_ownership: str = "auto"

    @property
    def fitting(self) -> list[Evaluated]:
        return [e for e in self.layouts if e.fits]


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def compute_floor(shapes: ModelShapes, seq: int, tokens: int, world_size: int,
                  tflops: float) -> float:
    """Seconds of a step's model FLOPs (forward, and backward twice it; no recompute, no
    communication) spread evenly over every rank at ``tflops``: what no layout beats."""
    blocks, head = shapes.forward_flops_per_token(seq)
    return 3.0 * (blocks + head) * tokens / (world_size * tflops)


def default_global_batch(seq: int, tokens: int = LLAMA3_TOKENS) -> int:
    """Sequences per step for ``tokens`` per step (default Llama 3's 16M), at least one."""
    return max(1, tokens // seq)


def search(shapes: ModelShapes, world_size: int, device_memory: float, *,
           links: Links | None = None, workload: Workload | None = None,
           dtypes: Dtypes | None = None,
           global_batch: int | None = None, tp: Sequence[int] | None = None,
           pp: Sequence[int] | None = None, shard: Sequence[int] | None = None,
           checkpointing: Sequence[bool | str] = ("fit",), ns_steps: int = 5,
           max_pp: int = 16, schedules: Sequence[PipelineSchedule] = SCHEDULES,
           tp_ownership: str = "auto", peak: float = H100_BF16_DENSE,
           replicate: Sequence[int] | None = None) -> Search:
    """Every layout of ``world_size`` ranks (module docstring), evaluated; the advice.

    ``global_batch``: sequences per step (default :func:`default_global_batch`: Llama 3's
    16M tokens), the same for every layout; a layout whose data-parallel size times the
    micro-batch does not divide it (a fraction of a micro-batch per rank) is skipped.
    ``tp`` / ``pp`` / ``shard`` / ``replicate``: restrict the search to these sizes
    (default: tp up to a node, pp powers of two up to ``max_pp`` and the block count, every
    shard size); ``schedules``: the pipeline schedules tried where ``pp > 1`` (each where
    torch runs it); ``checkpointing``: per layout ``"off"``, ``"fit"`` (each system the
    fewest blocks that fit its memory) or ``"all"`` (True / False: all / off);
    ``tp_ownership``: who owns a tp-split matrix (``fully_shard``'s keyword; "auto" at the
    rates of :func:`tp_rates`); ``peak``: the GPU's dense FLOP/s, for MFU."""
    t0 = time.perf_counter()
    links, workload, dtypes = links or Links(), workload or Workload(), dtypes or Dtypes()
    G = global_batch or default_global_batch(workload.seq)
    g = links.gpus_per_node
    tps = tp or [t for t in divisors(g) if world_size % t == 0]
    floor = compute_floor(shapes, workload.seq, G * workload.seq, world_size, workload.tflops)
    scale = workload.tflops / peak
    found: list[Evaluated] = []
    for T in tps:
        specs = tp_specs(shapes, T)
        if specs is None or world_size % T:
            continue
        pps = pp or [p for p in divisors(world_size // T)
                     if p <= min(max_pp, shapes.blocks) and p & (p - 1) == 0]
        for P in pps:
            if (world_size // T) % P or P > shapes.blocks:
                continue
            dp = world_size // (T * P)
            if G % (dp * workload.micro_batch):
                continue
            m = G // (dp * workload.micro_batch)
            scheds = [sc for sc in schedules if sc.allows(m, P, shapes.blocks)] if P > 1 \
                else [ONE_STAGE]
            if not scheds:
                continue
            stage_list = stages(specs, shapes.unit_names, P)
            for S in (shard or divisors(dp)):
                if dp % S or (replicate and dp // S not in replicate):
                    continue
                mesh = Mesh(P, dp // S, S, T)
                mc = mesh.costs(links)
                rates = tp_rates(workload, dtypes, mc.tp, m, P)
                sps = plan_stages(stage_list, dp, S, mesh, mc, dtypes, ns_steps, workload,
                                  tp_ownership, rates)
                for sc in scheds:
                    for ac in checkpointing:
                        found.append(evaluate(shapes, sps, Layout(dp // S, S, T, P, ac_mode(ac), sc),
                                              m, links, mc, workload, dtypes, device_memory,
                                              floor, scale, rates, tp_ownership))
    fitting = [e for e in found if e.fits]
    pool = fitting or found
    best = min(pool, key=lambda e: (e.step.total if fitting else e.largest_rank_bytes,
                                    e.critical_bytes)) if pool else None
    return Search(found, best, time.perf_counter() - t0, world_size, G, floor, peak,
                  tp_ownership)


def at_rate(shapes: ModelShapes, world_size: int, device_memory: float, e: Evaluated,
            tflops: float, **kw) -> Evaluated | None:
    """Layout ``e`` evaluated again with every matmul and Newton-Schulz at ``tflops``
    FLOP/s (the kernel-rate sensitivity): the same search restricted to it, planned anew
    (``tp_ownership="auto"`` weighs the placements at the new rate)."""
    w = replace(kw.pop("workload", None) or Workload(), tflops=tflops, ns_tflops=tflops)
    lay = e.layout
    found = search(shapes, world_size, device_memory, workload=w, tp=[lay.tp], pp=[lay.pp],
                   shard=[lay.shard], checkpointing=[lay.checkpointing],
                   schedules=[lay.schedule], replicate=[lay.replicate], **kw)
    return found.layouts[0] if found.layouts else None


def best_of(s: Search, system: str, device_memory: float) -> Evaluated | None:
    """``system``'s fastest layout that it can run and that fits its own memory (ours: the
    advice)."""
    if system == "matrixfsdp":
        return s.recommended if s.recommended and s.recommended.fits else None
    if system == "fsdp2_torch_muon":
        pool = [e for e in s.layouts if e.fsdp2_memory <= device_memory]
    else:
        pool = [e for e in s.layouts if e.distmuon_feasible and e.distmuon_memory <= device_memory]
    return min(pool, key=lambda e: e.step_of(system).total) if pool else None


@dataclass
class RateRow:
    """The kernel-rate sensitivity at one matmul / NS rate: the compute floor there and each
    system's best layout (found at the search's rate) evaluated again at it."""

    tflops: float
    floor: float
    systems: dict[str, Evaluated | None]

    def record(self, peak: float) -> dict:
        out: dict = {"tflops": self.tflops / 1e12, "compute_floor_seconds": self.floor}
        for k, e in self.systems.items():
            st = e.step_of(k) if e is not None else None
            out[k] = None if st is None else {
                "layout": e.label(k), "step_seconds": st.total,
                "vs_compute_floor": st.total / self.floor,
                "mfu": self.floor * self.tflops / (st.total * peak), "bound": st.bound}
        return out


def sensitivity(shapes: ModelShapes, s: Search, device_memory: float, rates: Sequence[float],
                workload: Workload | None = None, **kw) -> list[RateRow]:
    """Each system's best layout of ``s`` at each kernel rate of ``rates`` (FLOP/s): the
    layout's step again with every matmul and Newton-Schulz at that rate (:func:`at_rate`);
    at the search's own rate, the search's figures."""
    workload = workload or Workload()
    best = {k: best_of(s, k, device_memory) for k in SYSTEMS}
    rows = []
    for r in rates:
        same = r == workload.tflops and workload.ns_rate == r
        fl = s.floor * workload.tflops / r
        systems = {}
        for k, e in best.items():
            systems[k] = e if e is None or same else at_rate(
                shapes, s.world_size, device_memory, e, r, workload=workload,
                global_batch=s.global_batch, tp_ownership=s.tp_ownership, peak=s.peak, **kw)
        rows.append(RateRow(r, fl, systems))
    return rows
