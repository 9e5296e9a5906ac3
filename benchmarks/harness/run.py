"""What each benchmark rank does, in order.

:func:`rank_main` (one per spawned process) joins the world, makes the token batches
(:func:`make_data`, the same for every system) and runs the selected systems one after the
other. For each, :func:`run_system` builds it on a process group of its own, runs
``warmup`` untimed steps, ``steps`` timed steps and one profiled step (:func:`train_step`:
forward, backward, optimizer step, each started after a barrier), then rank 0 gathers every
rank's record, folds it into the system's results entry and checks exactness. A system
that raises is recorded with its error and the next one runs. Rank 0 also records the
machine as its ranks see it (:func:`~matrixfsdp.train.machine.machine_info`: CPU model, AMX, threads).
"""

from __future__ import annotations

import gc
import json
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import matrixfsdp as mf
from matrixfsdp import testing
from matrixfsdp.runtime.exit import exit_rank
from matrixfsdp.train.launch import device_for
from matrixfsdp.train.machine import barrier, machine_info

from .config import BASELINE, BenchConfig
from .measure import (
    analyse_profile,
    clock,
    compare,
    live_storages,
    ns_owned_ms,
    optimizer_tensors,
    phase_range,
    storage_bytes,
)
from .report import summarise
from .systems import System, build_system, full_params

Batch = tuple[torch.Tensor, torch.Tensor]


def make_data(cfg: BenchConfig, rank: int, device: torch.device) -> list[Batch]:
    """Random byte tokens, one ``(batch, seq+1)`` tensor per step; differs per rank, and
    is the same for every system."""
    out = []
    for step in range(cfg.warmup + cfg.steps + 1):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * cfg.world_size + rank)
        t = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(device)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def train_step(system: System, x: torch.Tensor, y: torch.Tensor, device: torch.device,
               times: dict[str, float] | None = None, annotate: bool = False,
               after_step: Callable[[], None] | None = None,
               phase_hook: Callable[[str, str], None] | None = None) -> None:
    """Forward, backward, optimizer step, each started after a barrier.

    ``times`` receives the wall/CPU clocks of each phase and of the whole step;
    ``annotate`` wraps each phase in a profiler range; ``after_step()`` runs between
    ``optimizer.step()`` and ``zero_grad``; ``phase_hook(phase, "start"|"end")`` runs
    around each phase, outside the clocks.
    """
    times = {} if times is None else times
    hook = phase_hook or (lambda ph, when: None)

    barrier(device, system.group)
    w0, c0 = time.perf_counter(), time.process_time()
    hook("forward", "start")
    with phase_range("forward", annotate), clock(device, times, "forward"):
        loss = system.model.loss(x, y)
    hook("forward", "end")
    barrier(device, system.group)
    hook("backward", "start")
    with phase_range("backward", annotate), clock(device, times, "backward"):
        loss.backward()
    hook("backward", "end")
    barrier(device, system.group)
    hook("step", "start")
    with phase_range("step", annotate), clock(device, times, "step"):
        for opt in system.optimizers:
            opt.step()
        if after_step is not None:
            after_step()
        for opt in system.optimizers:
            opt.zero_grad(set_to_none=True)
    hook("step", "end")
    times["total_wall_ms"] = (time.perf_counter() - w0) * 1e3
    times["total_cpu_ms"] = (time.process_time() - c0) * 1e3


def run_system(name: str, cfg: BenchConfig, rank: int, device: torch.device, data: list[Batch],
               keep_params: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Build, warm up, time, profile and gather one system on this rank.

    Returns this rank's record (clocks per timed step, collectives and memory of the
    profiled step, and for MatrixFSDP its plan, own collective counts and NS limit) and
    the full parameters at the end (empty unless ``keep_params``).
    """
    res: dict[str, Any] = {"rank": rank}
    gc.collect()
    before = set(live_storages(device)) if device.type == "cpu" else set()
    group = dist.new_group(list(range(cfg.world_size)), timeout=timedelta(seconds=cfg.timeout_s))
    system = build_system(name, cfg, _mesh(cfg, device, group), device, group)
    steps = iter(data)
    for _ in range(cfg.warmup):
        train_step(system, *next(steps), device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    res["timed"] = []
    for _ in range(cfg.steps):
        times: dict[str, float] = {}
        train_step(system, *next(steps), device, times)
        res["timed"].append(times)
    if device.type == "cuda":
        res["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    res.update(_profiled_step(name, cfg, system, device, next(steps), before))
    if name == "matrixfsdp":
        plan = mf.plan_of(system.model)
        res["plan"] = {"imbalance": plan.imbalance, "imbalance_bound": plan.imbalance_bound,
                       "report": mf.plan_report(system.model)}
        res["ns_owned"] = ns_owned_ms(system.model, rank, device, system.group)
    return res, full_params(name, system.model, keep_params)


def _mesh(cfg: BenchConfig, device: torch.device, group: dist.ProcessGroup):
    """The system's mesh: 1-D over the world, or HSDP's (replicate, shard), replicate-major
    as init_device_mesh lays out the world."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if cfg.replicas > 1:
        return init_device_mesh(device.type, (cfg.replicas, cfg.shard_size),
                                mesh_dim_names=("replicate", "shard"))
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("fsdp",))


def _profiled_step(name: str, cfg: BenchConfig, system: System, device: torch.device,
                   batch: Batch, before: set) -> dict[str, Any]:
    """One step under torch's profiler: collectives per phase, transient memory, state
    bytes, and MatrixFSDP's own collective counters per phase."""
    from torch.profiler import ProfilerActivity, profile

    res: dict[str, Any] = {}
    stats = mf.comm_stats(system.model) if name == "matrixfsdp" else None
    own_counts: dict[str, Any] = {}

    wrapped: dict[str, dict[str, Any]] = {}  # grouped_gloo: its own count of every call

    def phase_hook(ph: str, when: str) -> None:
        if when == "start":
            testing.COUNTS.reset()
            if stats is not None:
                stats.reset()
            return
        # launches ("calls": a coalesced group is one) and the ops inside them, by kind
        ops = {k: {"calls": n, "bytes": testing.COUNTS.payload[k]} for k, n in testing.COUNTS.ops.items()}
        wrapped[ph] = {"calls": sum(testing.COUNTS.launches.values()),
                       "op_count": sum(testing.COUNTS.ops.values()),
                       "bytes": sum(testing.COUNTS.payload.values()), "ops": ops}
        if stats is not None:
            own_counts[ph] = stats.summary()

    state: dict[str, int] = {}

    def after_step() -> None:
        params = list(system.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        state["bytes"] = storage_bytes(params + grads + optimizer_tensors(system.optimizers))

    barrier(device)
    if device.type == "cpu":
        gc.collect()
        live = live_storages(device)
        res["live_at_start_bytes"] = sum(v for k, v in live.items() if k not in before)
        del live
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 profile_memory=device.type == "cpu") as prof:
        train_step(system, *batch, device, annotate=True, after_step=after_step,
                   phase_hook=phase_hook)
    # all-gathers and reduce-scatters run in the shard group (every rank under HSDP too)
    res.update(analyse_profile(prof, cfg.shard_size, device))
    if cfg.backend == "grouped_gloo":  # a Python process group: the profiler sees none of
        res["collectives"] = wrapped  # its calls, which it counts itself
    del prof
    res["state_bytes"] = state.get("bytes", 0)
    if device.type == "cpu":
        res["peak_bytes"] = res["live_at_start_bytes"] + res["transient_peak_bytes"]
    if stats is not None:
        res["comm_stats"] = own_counts
    return res


def rank_main(rank: int, cfg: BenchConfig, init_file: str, result_file: str) -> None:
    """One spawned rank: run every system of ``cfg``; rank 0 writes
    ``{"systems": per-system results entries, "machine": machine_info()}`` to
    ``result_file`` (JSON)."""
    torch.set_num_threads(1)
    device = device_for(rank) if cfg.device_type == "cuda" else torch.device("cpu")
    if cfg.backend == "grouped_gloo":
        testing.register("grouped_gloo")
    dist.init_process_group(cfg.backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=cfg.world_size, timeout=timedelta(seconds=cfg.timeout_s))
    try:
        data = make_data(cfg, rank, device)
        systems: dict[str, Any] = {}
        references: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}  # per optimizer family
        for name in cfg.systems:
            barrier(device)
            if rank == 0:
                print(f"[bench] {name} ...", flush=True)
            t0 = time.perf_counter()
            error, res, full = None, {}, {}
            try:
                res, full = run_system(name, cfg, rank, device, data, keep_params=rank == 0)
            except Exception as e:  # a peer that does not run here: record, go on
                error = f"{type(e).__name__}: {e}"
                res = {"rank": rank, "traceback": traceback.format_exc()}
            res["error"] = error
            gathered: list[Any] | None = [None] * cfg.world_size if rank == 0 else None
            dist.gather_object(res, gathered, dst=0)
            if gathered is None:
                continue
            summary = summarise(name, gathered)
            summary["seconds"] = time.perf_counter() - t0
            if summary["status"] == "ok" and name != BASELINE and full:
                family = "soap" if name.endswith("_soap") else "muon"  # compared within a family
                reference = references.setdefault(family, (name, full))
                if reference[0] != name:  # the first of its family has nothing to compare with
                    summary["exactness"] = compare(full, *reference)
            systems[name] = summary
            print(f"[bench] {name}: {summary['status']} ({summary['seconds']:.1f} s)"
                  + (f" -- {summary['error']}" if summary.get("error") else ""), flush=True)
            del full
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump({"systems": systems, "machine": machine_info()}, f)
        barrier(device)
    finally:
        dist.destroy_process_group()
    exit_rank(0)  # finished: leave without interpreter finalization (see matrixfsdp.runtime.exit)
