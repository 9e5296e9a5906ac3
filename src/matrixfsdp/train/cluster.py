"""``matrixfsdp plan``: a known model planned for a cluster, costed, a shard size advised.

The model is built on the meta device (shapes only) and planned exactly as ``fully_shard``
would plan it (:func:`~matrixfsdp.planning.planner.plan_module`); the costs are
:mod:`matrixfsdp.planning.costs`' model. One model and world size: the per-rank table, the costs
and the recommendation. Several: one summary row each (docs/benchmarks.md's table).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..planning.costs import (
    PlanCosts,
    plan_costs,
    recommend_shard_size,
    smallest_fitting_shard_size,
)
from ..planning.planner import plan_module
from ..planning.report import fmt_bytes, format_costs, format_recommendation, format_report
from ..planning.types import Plan
from .models import GPT, PRESETS

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20,
          "mb": 10**6, "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40,
          "tb": 10**12}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80 GB"`` (10^9), ``"80G"`` (GiB), ``"1024"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"expected a size such as 80GiB, 80GB or 85899345920, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class ClusterPlan:
    """One model on one world size: the plan asked for, its costs, the recommended shard
    size's plan and costs (None if none qualifies), the smallest fitting one where the
    recommended does not fit, and how long all of it took."""

    model: str
    plan: Plan
    costs: PlanCosts
    recommended: tuple[Plan, PlanCosts] | None
    fitting: tuple[Plan, PlanCosts] | None
    seconds: float
    n_params: int


def plan_preset(model: str, world_size: int, shard_size: int | None, device_memory: float,
                gather_itemsize: int | None = None) -> ClusterPlan:
    """Plan, cost and advise for ``PRESETS[model]`` on ``world_size`` ranks."""
    t0 = time.perf_counter()
    with torch.device("meta"):
        net = GPT(PRESETS[model])
    plan = plan_module(net, list(net.layers), world_size, shard_size=shard_size)
    costs = plan_costs(plan, gather_itemsize)
    rec = recommend_shard_size(plan, gather_itemsize=gather_itemsize)
    fit = None
    if rec is not None and rec[1].peak > device_memory:
        fit = smallest_fitting_shard_size(plan, device_memory, rec[0].shard_size + 1,
                                          gather_itemsize)
    n = sum(p.numel() for p in net.parameters())
    return ClusterPlan(model, plan, costs, rec, fit, time.perf_counter() - t0, n)


def _dtypes(gather_itemsize: int | None) -> str:
    if gather_itemsize in (None, 4):
        return "everything in fp32, the model's dtype"
    return ("gathers and gather buffers in bf16 (MixedPrecisionPolicy param_dtype), "
            "storage, gradient reduce and optimizer state in fp32")


def preset_report(cp: ClusterPlan, device_memory: float, max_rows: int,
                  gather_itemsize: int | None = None) -> str:
    """The full text for one model and world size."""
    p = cp.plan
    hsdp = (f" ({p.replicas} replicas x {p.shard_size} shard ranks, HSDP)"
            if p.replicas > 1 else "")
    return "\n".join([
        f"{cp.model}: {cp.n_params / 1e9:.2f}B parameters, {len(p.unit_names) - 1} blocks, "
        f"planned on the meta device for {p.world_size} ranks{hsdp}, costed and advised in "
        f"{cp.seconds:.2f} s", "",
        format_report(p, max_rows=max_rows), "",
        format_costs(cp.costs, device_memory, _dtypes(gather_itemsize)), "",
        format_recommendation(cp.recommended, cp.fitting, device_memory)])


TABLE_HEAD = [
    "| model | ranks | model state per rank, max / mean (max/mean) | peak, fits? | bytes/step "
    "vs FSDP2 | NS max / bound | recommended shard size | its state max (max/mean) | its "
    "peak, fits? | its bytes/step vs FSDP2 | smallest fitting shard size (max/mean) | s |",
    "|---|---:|---|---|---:|---:|---:|---|---|---:|---|---:|",
]


def _peak(c: PlanCosts, device_memory: float) -> str:
    return f"{fmt_bytes(c.peak)}, {'yes' if c.peak <= device_memory else '**no**'}"


def table_row(cp: ClusterPlan, device_memory: float) -> str:
    """One summary row of :data:`TABLE_HEAD` for ``cp``."""
    c = cp.costs
    cells = [cp.model, str(c.world_size),
             f"{fmt_bytes(c.state.max)} / {fmt_bytes(c.state.mean)} ({c.state.ratio:.2f})",
             _peak(c, device_memory), f"{c.step.ratio:.3f}",
             f"{c.ns.max / c.ns_bound if c.ns_bound else 1.0:.3f}"]
    if cp.recommended is None:
        cells += ["none", "", "", ""]
    else:
        r = cp.recommended[1]
        cells += [str(r.shard_size) + (" (1-D)" if r.replicas == 1 else ""),
                  f"{fmt_bytes(r.state.max)} ({r.state.ratio:.2f})", _peak(r, device_memory),
                  f"{r.step.ratio:.3f}"]
    f, short = cp.fitting, cp.recommended is not None and cp.recommended[1].peak > device_memory
    cells += [f"{f[1].shard_size} ({f[1].state.ratio:.2f})" if f else ("none" if short else ""),
              f"{cp.seconds:.1f}"]
    return "| " + " | ".join(cells) + " |"


def preset_table(models: Sequence[str], world_sizes: Sequence[int], shard_size: int | None,
                 device_memory: float, gather_itemsize: int | None = None) -> str:
    """docs/benchmarks.md's table: one row per model and world size."""
    rows = [table_row(plan_preset(m, n, shard_size, device_memory, gather_itemsize),
                      device_memory) for m in models for n in world_sizes]
    return "\n".join([*TABLE_HEAD, *rows])
