"""``matrixfsdp bench``: MatrixFSDP against FSDP2 + peer Muon optimizers, side by side.

One invocation launches ``world_size`` local ranks (``torch.multiprocessing`` spawn,
``file://`` rendezvous; gloo on CPU, NCCL with one GPU per rank when CUDA is available)
and runs every selected system, one after the other inside the same ranks, on the same
model (same seed), the same per-rank token batches, the same world size and the same
hyperparameters:

=====================  ================================================================
``fsdp2_adamw``        FSDP2 (``fully_shard`` per block, then root) + ``torch.optim.AdamW``
``fsdp2_torch_muon``   FSDP2 + ``torch.optim.Muon`` on the DTensor matrices (+ AdamW)
``fsdp2_dist_muon``    FSDP2 + torchtitan ``DistMuon`` (+ AdamW)
``fsdp2_muon_fsdp2``   FSDP2 + ``muon_fsdp2.Muon``
``matrixfsdp``         ``matrixfsdp.fully_shard`` per block, then root + ``matrixfsdp.Muon``
=====================  ================================================================

Muon matrices for the peers are the ones MatrixFSDP's default rule selects (2-D weights
inside the blocks, from ``plan_module``); everything else gets AdamW. Each system gets its
own fresh model and its own process group, which its collectives and the harness's
per-phase barriers use (so a peer that fails mid-step cannot desynchronise the next
system), and ``warmup + steps + 1`` training steps:

* ``warmup`` untimed steps (FSDP2 lazy init, muon-fsdp2's ``torch.compile``, optimizer
  state creation);
* ``steps`` timed steps;
* one profiled step (not timed) for the collective counts and the memory accounting.

A peer that raises is recorded as ``"does not run here: <exception>"`` with the exact
error text, and the benchmark goes on with the other systems.

What is measured (units in the names: ``_ms`` milliseconds, ``_mib`` 2**20 bytes)
---------------------------------------------------------------------------------
Time
    Each phase -- ``forward`` (``model.loss``), ``backward`` (``loss.backward()``),
    ``step`` (``optimizer.step()`` then ``zero_grad(set_to_none=True)``) -- starts after a
    barrier on the system's group so all ranks start it together, and is timed on every rank with
    ``time.perf_counter`` (wall) and ``time.process_time`` (CPU time of the whole rank
    process, all threads: the communication threads' work counts). On CUDA the device is
    synchronised before reading the clocks. ``total`` is the time from the aligned start
    of ``forward`` to the end of ``step`` on that rank, so it includes the two barriers in
    between (the wait for the slowest rank after each phase). Reported: median, min and
    max over all measured steps of all ranks, and the per-rank medians.

Collectives (:func:`collective_payload_bytes`, identical for every system)
    ``torch.profiler`` (CPU activity, ``record_shapes=True``) around the profiled step,
    with one ``record_function`` range per phase. Every *outermost* dispatcher op in the
    ``c10d::`` namespace whose start lies in a phase range is one call of that phase (the
    process-group level: functional collectives and DTensor redistribution end up there,
    and ops issued from any thread are attributed by time). The harness's own barriers
    lie outside the ranges. Bytes per call, from the recorded argument shapes and dtypes,
    are the size of the whole (unsharded) buffer the collective works on, as this rank
    sees it:

    * all-gather family (``_allgather_base_``, ``allgather_``, ``allgather_coalesced_``,
      ``allgather_into_tensor_coalesced_``) and ``gather_``: world size x this rank's
      input tensor(s) (= the all-gather output);
    * reduce-scatter family (``_reduce_scatter_base_``, ``reduce_scatter_``,
      ``reduce_scatter_tensor_coalesced_``) and ``scatter_``: world size x this rank's
      output tensor(s) (= the reduce-scatter input);
    * all-to-all (``alltoall_base_``, ``alltoall_``): this rank's input tensor (what it
      sends, its own part included); with uneven splits this varies by rank, and its
      mean over ranks is the size of the gathered buffer;
    * ``allreduce_``, ``allreduce_coalesced_``, ``broadcast_``, ``reduce_``, ``send``,
      ``recv_``, ``recv_any_source_``: the tensor(s) passed;
    * ``barrier`` / ``monitored_barrier_``: 0 bytes; any other ``c10d::`` op: its first
      argument's tensor(s), and its name is listed under ``unknown_ops``.

    The table shows the mean over ranks of calls and bytes per phase.
    MatrixFSDP's own counter (``matrixfsdp.comm_stats``) is reported separately per phase
    as a cross-check.

Memory per rank
    CUDA: ``torch.cuda.max_memory_allocated`` over the timed steps. CPU, where the
    allocator keeps no statistics: ``peak_mib = live_at_start_mib + transient_peak_mib``,
    where ``live_at_start_mib`` is the size of all distinct tensor storages reachable by
    Python's garbage collector at the start of the profiled step that were not alive
    before this system was built (sharded parameters, optimizer state, persistent
    communication buffers; the token batches and earlier systems' leftovers are
    excluded), and ``transient_peak_mib`` is the high-water mark, during the profiled
    step, of the running sum of the CPU allocator's allocations minus frees recorded by
    ``torch.profiler(profile_memory=True)`` (gradients, unsharded parameters, activations,
    collective buffers, NS temporaries). ``state_mib`` is, for information, the distinct
    storages of parameters + gradients + optimizer state right after ``optimizer.step()``.
    The table shows the maximum over ranks.

Exactness
    After all steps, every Muon system's full parameters (``DTensor.full_tensor()`` /
    ``matrixfsdp.full_state_dict``) are compared on rank 0 with the reference (the first
    Muon system that ran, normally ``fsdp2_torch_muon``): max abs difference over all
    parameters. Muon systems differ only by bf16 Newton-Schulz rounding, so a difference
    above :data:`EXACT_BOUND` (5e-2, absolute, any single element) is flagged as a failure.

MatrixFSDP balance
    ``plan_of(model).imbalance`` / ``.imbalance_bound`` (NS FLOP cost, max rank / mean);
    the per-rank median optimizer-step CPU time and its spread (max/min over ranks); and
    ``ns_limit_ms``: every rank times, concurrently, ``zeropower_via_newtonschulz`` in
    bf16 on random matrices of the shapes it owns (median of :data:`NS_REPS` repetitions
    after one warm-up); the maximum over ranks is the time no exact owner-computes step
    can beat on this machine with this plan. ``ns_limit_cpu_ms`` is the same in process
    CPU time, to compare with the step's CPU time when other load shares the cores.

Outputs in ``--out``: ``results.json`` (everything), ``results.md`` (the tables, also
printed), ``phases.png`` (stacked forward/backward/step medians; skipped with a warning
when matplotlib is missing).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import matrixfsdp as mf

from .._exit import exit_rank
from ..cli import _device_for, _positive_float, _sync
from ..optim import MUON_DEFAULTS
from ..plan import plan_module
from . import peers

SYSTEMS: tuple[str, ...] = ("fsdp2_adamw", "fsdp2_torch_muon", "fsdp2_dist_muon",
                            "fsdp2_muon_fsdp2", "matrixfsdp")
BASELINE = "fsdp2_adamw"
MUON_REFERENCE = "fsdp2_torch_muon"
PHASES: tuple[str, ...] = ("forward", "backward", "step")
EXACT_BOUND = 5e-2  # max abs parameter difference between Muon systems (bf16 NS rounding)
NS_REPS = 5
PG_TIMEOUT_S = 600
MIB = 2**20
_RANGE = "matrixfsdp.bench::"

PRESETS: dict[str, dict[str, Any]] = {
    "cpu": dict(layers=8, d_model=384, heads=6, mlp=1536, seq=256, batch=8, dtype="float32"),
    "gpu": dict(layers=16, d_model=2048, heads=16, mlp=8192, seq=2048, batch=8, dtype="bfloat16"),
}


@dataclass
class BenchConfig:
    """Everything a run depends on; saved verbatim into ``results.json``."""

    world_size: int
    steps: int
    warmup: int
    systems: list[str]
    out: str
    preset: str
    layers: int
    d_model: int
    heads: int
    mlp: int
    seq: int
    batch: int  # sequences per rank per step
    dtype: str  # parameter dtype
    mp: str = "fp32"  # "bf16": MixedPrecisionPolicy(bf16 params, fp32 reduce) for every system
    vocab: int = 256
    lr: float = 0.02  # Muon
    weight_decay: float = 0.1  # Muon
    momentum: float = 0.95
    adamw_lr: float = 3e-3
    adamw_weight_decay: float = 0.01
    adamw_betas: tuple[float, float] = (0.9, 0.999)
    adamw_eps: float = 1e-8
    seed: int = 0
    device_type: str = "cpu"
    timeout_s: float = PG_TIMEOUT_S  # process-group timeout, seconds
    backend: str = "gloo"

    def model_config(self):
        from matrixfsdp.models import GPTConfig
        return GPTConfig(vocab_size=self.vocab, seq_len=self.seq, d_model=self.d_model,
                         n_heads=self.heads, n_layers=self.layers, d_mlp=self.mlp)


# ================================================================== measurement helpers


def _barrier(device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


@contextlib.contextmanager
def _clock(device: torch.device, out: dict[str, float], key: str) -> Iterator[None]:
    """Adds ``<key>_wall_ms`` and ``<key>_cpu_ms`` (process CPU time) to ``out``."""
    _sync(device)
    w0, c0 = time.perf_counter(), time.process_time()
    yield
    _sync(device)
    out[f"{key}_wall_ms"] = (time.perf_counter() - w0) * 1e3
    out[f"{key}_cpu_ms"] = (time.process_time() - c0) * 1e3


def _live_storages(device: torch.device) -> dict[tuple[int, str], int]:
    """Distinct tensor storages on ``device`` reachable by the garbage collector:
    ``(data_ptr, device) -> nbytes``. Wrapper tensors (DTensor) are skipped; their local
    tensors are found on their own."""
    out: dict[tuple[int, str], int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or obj.device != device:
                    continue
                st = obj.untyped_storage()
                if st.data_ptr() and st.nbytes():
                    out[(st.data_ptr(), str(obj.device))] = st.nbytes()
            except Exception:  # wrapper subclasses, fake/meta tensors, ...
                continue
    return out


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    from torch.distributed.tensor import DTensor
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        st = t.untyped_storage()
        if st.data_ptr():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizers: Sequence[Any]) -> list[torch.Tensor]:
    """Tensors in the ``state`` of the optimizers (a torchtitan container is unpacked)."""
    found: list[torch.Tensor] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    for opt in optimizers:
        for inner in getattr(opt, "optimizers", [opt]):
            visit(list(getattr(inner, "state", {}).values()))
    return found


# ------------------------------------------------------------------ collective counting

_WORLD_X_INPUT = {"_allgather_base_", "allgather_", "allgather_coalesced_",
                  "allgather_into_tensor_coalesced_", "gather_"}
_WORLD_X_OUTPUT = {"_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_",
                   "scatter_"}
_INPUT = {"alltoall_base_", "alltoall_"}
_TENSORS = {"allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "send", "recv_",
            "recv_any_source_"}
_NO_PAYLOAD = {"barrier", "monitored_barrier_"}


def _meta_bytes(arg: Any) -> int:
    """Bytes of a recorded profiler argument: a tensor's metadata or a list of them."""
    if isinstance(arg, (list, tuple)):
        return sum(_meta_bytes(a) for a in arg)
    sizes, dtype = getattr(arg, "sizes", None), getattr(arg, "dtype", None)
    if sizes is None or dtype is None:
        return 0
    return math.prod(sizes) * dtype.itemsize


def collective_payload_bytes(op: str, inputs: Sequence[Any], world_size: int) -> tuple[int, bool]:
    """Payload of one ``c10d::<op>`` call (rule in the module docstring).

    ``inputs`` are the profiler's recorded arguments (tensor metadata with ``sizes`` and
    ``dtype``, or lists of them). Returns ``(bytes, known_op)``.
    """
    def arg(i: int) -> int:
        return _meta_bytes(inputs[i]) if len(inputs) > i else 0

    if op in _WORLD_X_INPUT:
        return world_size * arg(1), True
    if op in _WORLD_X_OUTPUT:
        return world_size * arg(0), True
    if op in _INPUT:
        return arg(1), True
    if op in _TENSORS:
        return arg(0), True
    if op in _NO_PAYLOAD:
        return 0, True
    return arg(0), False


def _walk(nodes: Sequence[Any]) -> Iterator[Any]:
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


def _analyse_profile(prof: Any, world_size: int, device: torch.device) -> dict[str, Any]:
    """Collectives per phase and the transient memory high-water mark of one profiled step."""
    from torch._C._profiler import _EventType

    roots = prof.profiler.kineto_results.experimental_event_tree()
    ranges: dict[str, tuple[int, int]] = {}
    for node in _walk(roots):
        if node.name.startswith(_RANGE):
            ranges[node.name[len(_RANGE):]] = (node.start_time_ns, node.end_time_ns)
    if set(ranges) != set(PHASES):
        raise RuntimeError(f"the profiled step has phase ranges {sorted(ranges)}, not {list(PHASES)}")

    per_phase = {ph: {"calls": 0, "bytes": 0, "ops": {}} for ph in PHASES}
    unknown: set[str] = set()

    def visit(node: Any) -> None:
        if node.tag == _EventType.TorchOp and node.name.startswith("c10d::"):
            op = node.name[len("c10d::"):]
            nbytes, known = collective_payload_bytes(op, node.extra_fields.inputs, world_size)
            if not known:
                unknown.add(node.name)
            for ph, (t0, t1) in ranges.items():
                if t0 <= node.start_time_ns <= t1:
                    rec = per_phase[ph]
                    rec["calls"] += 1
                    rec["bytes"] += nbytes
                    o = rec["ops"].setdefault(node.name, {"calls": 0, "bytes": 0})
                    o["calls"] += 1
                    o["bytes"] += nbytes
            return  # outermost only: a c10d op nested in another is part of that call
        for child in node.children:
            visit(child)

    for root in roots:
        visit(root)

    allocs = sorted((n.start_time_ns, n.extra_fields.alloc_size) for n in _walk(roots)
                    if n.tag == _EventType.Allocation and n.extra_fields.device.type == device.type)
    running = peak = 0
    for _, size in allocs:
        running += size
        peak = max(peak, running)
    return {"collectives": per_phase, "unknown_ops": sorted(unknown),
            "transient_peak_bytes": peak}


# ================================================================== the systems


@dataclass
class System:
    """A built system: the model and the objects whose ``step``/``zero_grad`` we call."""

    model: nn.Module
    group: dist.ProcessGroup  # the system's own process group; its barriers use it too
    optimizers: list[Any]


def _split_muon(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The peers' Muon matrices are exactly the ones MatrixFSDP's default rule picks."""
    plan = plan_module(model, list(model.layers), world_size=1)
    names = {pl.spec.name for pl in plan.placements.values() if pl.spec.muon}
    muon, adamw = [], []
    for name, p in model.named_parameters():
        (muon if name in names else adamw).append(p)
    return muon, adamw


def _build(name: str, cfg: BenchConfig, mesh: Any, device: torch.device) -> System:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from matrixfsdp.models import GPT

    group = mesh.get_group()
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config()).to(device=device, dtype=getattr(torch, cfg.dtype))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.mp == "bf16" else MixedPrecisionPolicy()
    if name == "matrixfsdp":
        for block in model.layers:
            mf.fully_shard(block, mesh=mesh, mp_policy=mp)
        mf.fully_shard(model, mesh=mesh, mp_policy=mp)
        groups = mf.muon_param_groups(
            model, lr=cfg.lr, adamw_lr=cfg.adamw_lr, weight_decay=cfg.weight_decay,
            momentum=cfg.momentum, adamw_betas=cfg.adamw_betas, adamw_eps=cfg.adamw_eps,
            adamw_weight_decay=cfg.adamw_weight_decay)
        return System(model, group, [mf.Muon(groups)])

    from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if name == "fsdp2_adamw":
        return System(model, group, [torch.optim.AdamW(
            model.parameters(), lr=cfg.adamw_lr, betas=cfg.adamw_betas, eps=cfg.adamw_eps,
            weight_decay=cfg.adamw_weight_decay)])

    muon, adamw = _split_muon(model)
    kw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
              adamw_lr=cfg.adamw_lr, adamw_betas=cfg.adamw_betas, adamw_eps=cfg.adamw_eps,
              adamw_weight_decay=cfg.adamw_weight_decay)
    if name == "fsdp2_torch_muon":
        return System(model, group, peers.build_torch_muon(muon, adamw, **kw))
    if name == "fsdp2_dist_muon":
        return System(model, group, [peers.build_dist_muon(model, mesh, list(model.layers), muon,
                                                    adamw, **kw)])
    if name == "fsdp2_muon_fsdp2":
        return System(model, group, [peers.build_muon_fsdp2(muon, adamw, **kw)])
    raise ValueError(f"unknown system {name!r}")


def _full_params(name: str, model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """Full parameters as fp32 CPU tensors (a collective; only kept where ``keep``)."""
    if name == "matrixfsdp":
        full = mf.full_state_dict(model)
        names = [n for n, _ in model.named_parameters()]
        return {n: full[n].detach().float().cpu() for n in names} if keep else {}
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        if keep:
            out[n] = t.detach().float().cpu()
    return out


# ================================================================== one system, one rank


def _train_step(system: System, x: torch.Tensor, y: torch.Tensor, device: torch.device,
                times: dict[str, float] | None = None, annotate: bool = False,
                after_step: Any = None, phase_hook: Any = None) -> None:
    """Forward, backward, optimizer step, each started after a barrier.

    ``times`` receives the wall/CPU clocks of each phase and of the whole step;
    ``annotate`` wraps each phase in a profiler range; ``after_step()`` runs between
    ``optimizer.step()`` and ``zero_grad``; ``phase_hook(phase, "start"|"end")`` runs
    around each phase, outside the clocks.
    """
    times = {} if times is None else times
    hook = phase_hook or (lambda ph, when: None)

    def rng(ph: str):
        return torch.profiler.record_function(_RANGE + ph) if annotate else contextlib.nullcontext()

    _barrier(device, system.group)
    w0, c0 = time.perf_counter(), time.process_time()
    hook("forward", "start")
    with rng("forward"), _clock(device, times, "forward"):
        loss = system.model.loss(x, y)
    hook("forward", "end")
    _barrier(device, system.group)
    hook("backward", "start")
    with rng("backward"), _clock(device, times, "backward"):
        loss.backward()
    hook("backward", "end")
    _barrier(device, system.group)
    hook("step", "start")
    with rng("step"), _clock(device, times, "step"):
        for opt in system.optimizers:
            opt.step()
        if after_step is not None:
            after_step()
        for opt in system.optimizers:
            opt.zero_grad(set_to_none=True)
    hook("step", "end")
    times["total_wall_ms"] = (time.perf_counter() - w0) * 1e3
    times["total_cpu_ms"] = (time.process_time() - c0) * 1e3


def _ns_owned_ms(model: nn.Module, rank: int, device: torch.device,
                 group: dist.ProcessGroup) -> dict[str, Any]:
    """bf16 NS on random matrices of the shapes this rank owns, all ranks concurrently:
    median wall ms and median process CPU ms over ``NS_REPS`` repetitions (after one
    warm-up repetition), and the number of matrices."""
    ns = MUON_DEFAULTS  # the Newton-Schulz every system's step runs
    plan = mf.plan_of(model)
    shapes = [pl.spec.shape for pl in plan.placements.values() if pl.spec.muon and pl.owner == rank]
    mats = [torch.randn(s, device=device) for s in shapes]
    wall, cpu = [], []
    for rep in range(NS_REPS + 1):
        _barrier(device, group)
        _sync(device)
        w0, c0 = time.perf_counter(), time.process_time()
        for g in mats:
            mf.zeropower_via_newtonschulz(g, ns["ns_coefficients"], ns["ns_steps"], ns["eps"],
                                          ns["ns_dtype"])
        _sync(device)
        if rep:  # the first repetition is a warm-up
            wall.append((time.perf_counter() - w0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    return {"wall_ms": statistics.median(wall), "cpu_ms": statistics.median(cpu),
            "matrices": len(shapes)}


def _run_system(name: str, cfg: BenchConfig, rank: int, device: torch.device,
                data: list[tuple[torch.Tensor, torch.Tensor]],
                keep_params: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Build, warm up, time, profile and gather one system on this rank."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.profiler import ProfilerActivity, profile

    res: dict[str, Any] = {"rank": rank}
    gc.collect()
    before = set(_live_storages(device)) if device.type == "cpu" else set()
    group = dist.new_group(list(range(cfg.world_size)), timeout=timedelta(seconds=cfg.timeout_s))
    mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=("fsdp",))
    system = _build(name, cfg, mesh, device)
    steps = iter(data)
    for _ in range(cfg.warmup):
        _train_step(system, *next(steps), device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    res["timed"] = []
    for _ in range(cfg.steps):
        times: dict[str, float] = {}
        _train_step(system, *next(steps), device, times)
        res["timed"].append(times)
    if device.type == "cuda":
        res["peak_bytes"] = torch.cuda.max_memory_allocated(device)

    # The profiled step: collectives per phase, transient memory, MatrixFSDP's counter.
    stats = mf.comm_stats(system.model) if name == "matrixfsdp" else None
    own_counts: dict[str, Any] = {}

    def phase_hook(ph: str, when: str) -> None:
        if when == "start":
            stats.reset()
        else:
            own_counts[ph] = stats.summary()

    state: dict[str, int] = {}

    def after_step() -> None:
        params = list(system.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        state["bytes"] = _storage_bytes(params + grads + _optimizer_tensors(system.optimizers))

    _barrier(device)
    if device.type == "cpu":
        gc.collect()
        live = _live_storages(device)
        res["live_at_start_bytes"] = sum(v for k, v in live.items() if k not in before)
        del live
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 profile_memory=device.type == "cpu") as prof:
        _train_step(system, *next(steps), device, annotate=True, after_step=after_step,
                    phase_hook=phase_hook if stats is not None else None)
    res.update(_analyse_profile(prof, cfg.world_size, device))
    del prof
    res["state_bytes"] = state.get("bytes", 0)
    if device.type == "cpu":
        res["peak_bytes"] = res["live_at_start_bytes"] + res["transient_peak_bytes"]
    if stats is not None:
        res["comm_stats"] = own_counts

    if name == "matrixfsdp":
        plan = mf.plan_of(system.model)
        res["plan"] = {"imbalance": plan.imbalance, "imbalance_bound": plan.imbalance_bound,
                       "report": mf.plan_report(system.model)}
        res["ns_owned"] = _ns_owned_ms(system.model, rank, device, system.group)

    return res, _full_params(name, system.model, keep_params)


# ================================================================== rank entry point


def _make_data(cfg: BenchConfig, rank: int, device: torch.device
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random byte tokens, one ``(batch, seq+1)`` tensor per step; differs per rank, and
    is the same for every system."""
    out = []
    for step in range(cfg.warmup + cfg.steps + 1):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * cfg.world_size + rank)
        t = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(device)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _rank_main(rank: int, cfg: BenchConfig, init_file: str, result_file: str) -> None:
    torch.set_num_threads(1)
    device = _device_for(rank) if cfg.device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(cfg.backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=cfg.world_size, timeout=timedelta(seconds=cfg.timeout_s))
    try:
        data = _make_data(cfg, rank, device)
        systems: dict[str, Any] = {}
        reference: tuple[str, dict[str, torch.Tensor]] | None = None
        for name in cfg.systems:
            _barrier(device)
            if rank == 0:
                print(f"[bench] {name} ...", flush=True)
            t0 = time.perf_counter()
            error, res, full = None, {}, {}
            try:
                res, full = _run_system(name, cfg, rank, device, data, keep_params=rank == 0)
            except Exception as e:  # a peer that does not run here: record, go on
                error = f"{type(e).__name__}: {e}"
                res = {"rank": rank, "traceback": traceback.format_exc()}
            res["error"] = error
            gathered: list[Any] | None = [None] * cfg.world_size if rank == 0 else None
            dist.gather_object(res, gathered, dst=0)
            if gathered is None:
                continue
            summary = _summarise(name, gathered)
            summary["seconds"] = time.perf_counter() - t0
            if summary["status"] == "ok" and name != BASELINE and full:
                if reference is None:
                    reference = (name, full)
                summary["exactness"] = _compare(full, *reference)
            systems[name] = summary
            print(f"[bench] {name}: {summary['status']} ({summary['seconds']:.1f} s)"
                  + (f" -- {summary['error']}" if summary.get("error") else ""), flush=True)
            del full
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump(systems, f)
        _barrier(device)
    finally:
        dist.destroy_process_group()
    exit_rank(0)  # finished: leave without interpreter finalization (see matrixfsdp._exit)


def _compare(full: dict[str, torch.Tensor], ref_name: str,
             ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    worst, worst_name = 0.0, None
    missing = sorted(set(ref) ^ set(full))
    for n in sorted(set(ref) & set(full)):
        d = (full[n] - ref[n]).abs().max().item() if full[n].numel() else 0.0
        if d > worst or worst_name is None:
            worst, worst_name = d, n
    ok = not missing and worst <= EXACT_BOUND and math.isfinite(worst)
    return {"reference": ref_name, "max_abs_diff": worst, "worst_param": worst_name,
            "missing_params": missing, "bound": EXACT_BOUND, "ok": ok}


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _summarise(name: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: fold the per-rank records of one system into the results entry."""
    failed = [r for r in per_rank if r.get("error")]
    if failed:
        return {"status": "does not run here", "error": failed[0]["error"],
                "failed_ranks": [r["rank"] for r in failed], "traceback": failed[0].get("traceback")}
    out: dict[str, Any] = {"status": "ok", "error": None, "phases": {}, "collectives": {}}
    for ph in (*PHASES, "total"):
        entry = {}
        for kind in ("wall_ms", "cpu_ms"):
            key = f"{ph}_{kind}"
            pooled = [t[key] for r in per_rank for t in r["timed"]]
            entry[kind] = {**_stats(pooled), "per_rank_median":
                           [statistics.median(t[key] for t in r["timed"]) for r in per_rank]}
        out["phases"][ph] = entry
    for ph in PHASES:
        calls = [r["collectives"][ph]["calls"] for r in per_rank]
        nbytes = [r["collectives"][ph]["bytes"] for r in per_rank]
        out["collectives"][ph] = {"calls": statistics.mean(calls), "bytes": statistics.mean(nbytes),
                                  "per_rank": [r["collectives"][ph] for r in per_rank]}
    out["unknown_ops"] = sorted({o for r in per_rank for o in r["unknown_ops"]})
    peak = [r["peak_bytes"] for r in per_rank]
    out["memory"] = {"peak_mib": max(peak) / MIB, "per_rank_peak_mib": [b / MIB for b in peak],
                     "per_rank_state_mib": [r["state_bytes"] / MIB for r in per_rank]}
    if "live_at_start_bytes" in per_rank[0]:
        out["memory"]["per_rank_live_at_start_mib"] = [r["live_at_start_bytes"] / MIB
                                                       for r in per_rank]
        out["memory"]["per_rank_transient_peak_mib"] = [r["transient_peak_bytes"] / MIB
                                                        for r in per_rank]
    if name == "matrixfsdp":
        r0 = per_rank[0]
        step_cpu = out["phases"]["step"]["cpu_ms"]["per_rank_median"]
        ns = [r["ns_owned"]["wall_ms"] for r in per_rank]
        ns_cpu = [r["ns_owned"]["cpu_ms"] for r in per_rank]
        own = r0["comm_stats"]
        prof_ok = all(
            sum(v["calls"] for v in own[ph].values()) == out["collectives"][ph]["calls"]
            and sum(v["payload_bytes"] for v in own[ph].values()) == out["collectives"][ph]["bytes"]
            for ph in PHASES)
        out["matrixfsdp"] = {
            "imbalance": r0["plan"]["imbalance"], "imbalance_bound": r0["plan"]["imbalance_bound"],
            "plan_report": r0["plan"]["report"],
            "step_cpu_ms_per_rank": step_cpu,
            "step_cpu_spread": max(step_cpu) / min(step_cpu) if min(step_cpu) > 0 else math.inf,
            "ns_owned_ms_per_rank": ns,
            "ns_owned_cpu_ms_per_rank": ns_cpu,
            "ns_owned_matrices_per_rank": [r["ns_owned"]["matrices"] for r in per_rank],
            "ns_limit_ms": max(ns),
            "ns_limit_cpu_ms": max(ns_cpu),
            "comm_stats_rank0": own,
            "comm_stats_matches_profiler": prof_ok,
        }
    return out


# ================================================================== reporting


def _fmt_range(st: dict[str, float]) -> str:
    return f"{st['median']:.1f} [{st['min']:.1f}, {st['max']:.1f}]"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a" if not (a == 0 and b == 0) else "—"
    return f"{a / b:.2f}x"


def _coll(res: dict[str, Any], ph: str) -> str:
    c = res["collectives"][ph]
    return f"{c['calls']:g} / {c['bytes'] / MIB:.1f}"


def render_markdown(results: dict[str, Any]) -> str:
    """The two tables (and the run's settings) as Markdown."""
    cfg, systems = results["config"], results["systems"]
    mp = " with a bf16 MixedPrecisionPolicy (fp32 reduce)" if cfg.get("mp") == "bf16" else ""
    ok = {n: s for n, s in systems.items() if s["status"] == "ok"}
    exact_ref = next((s["exactness"]["reference"] for s in ok.values() if s.get("exactness")),
                     MUON_REFERENCE)

    def med(name: str, ph: str) -> float | None:
        return ok[name]["phases"][ph]["wall_ms"]["median"] if name in ok else None

    def fb(name: str) -> float | None:
        return None if name not in ok else med(name, "forward") + med(name, "backward")

    def total_bytes(name: str) -> float | None:
        return None if name not in ok else sum(ok[name]["collectives"][p]["bytes"] for p in PHASES)

    def mem(name: str) -> float | None:
        return ok[name]["memory"]["peak_mib"] if name in ok else None

    peers = [med(n, "step") for n in ("fsdp2_dist_muon", "fsdp2_muon_fsdp2") if n in ok]
    best_peer = min(peers) if peers else None
    lines = [
        f"MatrixFSDP benchmark: {cfg['world_size']} ranks on {results['device']} "
        f"({cfg['backend']}), GPT {cfg['layers']} layers, d_model {cfg['d_model']}, "
        f"{cfg['heads']} heads, MLP {cfg['mlp']}, seq {cfg['seq']}, batch {cfg['batch']}/rank, "
        f"{cfg['dtype']}{mp}; {cfg['warmup']} warm-up + {cfg['steps']} timed steps "
        f"(+1 profiled); torch {results['torch']}.",
        "",
        "Times: wall ms, median [min, max] over timed steps x ranks; each phase starts after a "
        "barrier; total includes the barriers between phases. CPU ms: median process CPU time "
        "fwd/bwd/step. Collectives: calls / MiB per rank (mean over ranks), one profiled "
        "step, payload rule in the harness docstring. Peak: MiB, max over ranks. "
        f"max|Δ|: max abs parameter difference vs {exact_ref} (bound {EXACT_BOUND:g}).",
        "",
        "| system | fwd ms | bwd ms | step ms | total ms | CPU ms f/b/s | coll fwd | coll bwd "
        "| coll step | peak MiB | fwd+bwd vs adamw | bytes vs adamw | mem vs adamw "
        "| step vs torch_muon | step vs best(dist_muon, muon_fsdp2) | max abs Δ |",
        "|" + "---|" * 16,
    ]
    for name, s in systems.items():
        if s["status"] != "ok":
            err = s["error"].splitlines()[0].replace("|", "\\|") if s.get("error") else ""
            lines.append(f"| {name} | does not run here: {err[:300]} |" + " |" * 14)
            continue
        ph = s["phases"]
        cpu = "/".join(f"{ph[p]['cpu_ms']['median']:.0f}" for p in PHASES)
        ex = s.get("exactness")
        exs = "—" if ex is None else (f"{ex['max_abs_diff']:.1e} "
                                      + ("ok" if ex["ok"] else "**FAIL**"))
        lines.append(
            f"| {name} | {_fmt_range(ph['forward']['wall_ms'])} | {_fmt_range(ph['backward']['wall_ms'])} "
            f"| {_fmt_range(ph['step']['wall_ms'])} | {_fmt_range(ph['total']['wall_ms'])} | {cpu} "
            f"| {_coll(s, 'forward')} | {_coll(s, 'backward')} | {_coll(s, 'step')} "
            f"| {s['memory']['peak_mib']:.1f} | {_ratio(fb(name), fb(BASELINE))} "
            f"| {_ratio(total_bytes(name), total_bytes(BASELINE))} | {_ratio(mem(name), mem(BASELINE))} "
            f"| {_ratio(med(name, 'step'), med(MUON_REFERENCE, 'step'))} "
            f"| {_ratio(med(name, 'step'), best_peer)} | {exs} |")
    m = ok.get("matrixfsdp", {}).get("matrixfsdp")
    if m:
        step = med("matrixfsdp", "step")
        cpu = m["step_cpu_ms_per_rank"]
        lines += [
            "",
            "MatrixFSDP plan balance. NS cost = Newton-Schulz FLOPs per rank. ns_limit = max over "
            "ranks of the median time of bf16 NS alone on the matrices a rank owns (all ranks at "
            "once; wall ms and process CPU ms): the floor of an owner-computes step here. "
            "The CPU-time ratio is the robust one on a shared machine.",
            "",
            "| NS-cost imbalance (max/mean) | best possible | step CPU ms per rank | "
            "step CPU spread (max/min) | ns_limit wall ms | ns_limit CPU ms | step wall ms "
            "| step wall / ns_limit wall | max step CPU / ns_limit CPU | comm_stats = profiler |",
            "|---|---|---|---|---|---|---|---|---|---|",
            f"| {m['imbalance']:.3f} | {m['imbalance_bound']:.3f} "
            f"| {', '.join(f'{c:.0f}' for c in cpu)} | {m['step_cpu_spread']:.2f} "
            f"| {m['ns_limit_ms']:.1f} | {m['ns_limit_cpu_ms']:.1f} | {step:.1f} "
            f"| {_ratio(step, m['ns_limit_ms'])} | {_ratio(max(cpu), m['ns_limit_cpu_ms'])} "
            f"| {'yes' if m['comm_stats_matches_profiler'] else 'NO'} |",
        ]
    failed = [n for n, s in ok.items() if s.get("exactness") and not s["exactness"]["ok"]]
    if failed:
        lines += ["", f"**Exactness check failed** (max abs diff > {EXACT_BOUND:g}): "
                  + ", ".join(failed)]
    return "\n".join(lines) + "\n"


def plot_phases(results: dict[str, Any], path: str) -> bool:
    """Stacked bars of the forward/backward/step median wall ms; False if no matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: phases.png skipped", stacklevel=2)
        return False
    ok = {n: s for n, s in results["systems"].items() if s["status"] == "ok"}
    fig, ax = plt.subplots(figsize=(1.6 * max(len(ok), 2) + 2, 4.5))
    bottom = [0.0] * len(ok)
    for ph, color in zip(PHASES, ("#4C72B0", "#DD8452", "#55A868")):
        vals = [s["phases"][ph]["wall_ms"]["median"] for s in ok.values()]
        ax.bar(list(ok), vals, bottom=bottom, label=ph, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    cfg = results["config"]
    ax.set_ylabel("median wall time per step (ms)")
    ax.set_title(f"{cfg['world_size']} ranks, {results['device']}, GPT {cfg['layers']}x"
                 f"{cfg['d_model']}, batch {cfg['batch']}x{cfg['seq']}/rank")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ================================================================== command line


def parse_args(argv: list[str] | None) -> BenchConfig:
    p = argparse.ArgumentParser(
        prog="matrixfsdp bench",
        description="MatrixFSDP vs FSDP2 + AdamW / torch Muon / DistMuon / muon-fsdp2, "
                    "side by side on local ranks.")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model/batch preset (default: cpu; gpu = bf16, d_model 2048, 16 layers, "
                        "MLP 8192, seq 2048, needs CUDA)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default: 4 on CPU, the GPU count with CUDA)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system first")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list out of {','.join(SYSTEMS)}")
    p.add_argument("--out", default="runs/bench", help="output directory")
    p.add_argument("--timeout", type=_positive_float, default=PG_TIMEOUT_S, metavar="SECONDS",
                   help=f"process-group timeout (default {PG_TIMEOUT_S})")
    p.add_argument("--mp", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: every system gathers and computes in bf16 and reduces in fp32 "
                        "(torch's MixedPrecisionPolicy), fp32 master weights")
    for flag, dest in (("--layers", "layers"), ("--d-model", "d_model"), ("--heads", "heads"),
                       ("--mlp", "mlp"), ("--seq", "seq"), ("--batch", "batch")):
        p.add_argument(flag, dest=dest, type=int, default=None, help="override the preset")
    a = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    preset = a.preset or "cpu"
    if preset == "gpu" and not cuda:
        p.error("--preset gpu needs CUDA")
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        p.error(f"unknown systems {unknown}; choose from {','.join(SYSTEMS)}")
    world = a.world_size or (torch.cuda.device_count() if cuda else 4)
    if world < 1 or (cuda and world > torch.cuda.device_count()):
        p.error(f"--world-size {world}: need 1..{torch.cuda.device_count() if cuda else 'N'} "
                "(one GPU per rank)")
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    sizes = {k: (v if getattr(a, k, None) is None else getattr(a, k))
             for k, v in PRESETS[preset].items()}
    if sizes["d_model"] % sizes["heads"]:
        p.error(f"--d-model {sizes['d_model']} is not divisible by --heads {sizes['heads']}")
    return BenchConfig(world_size=world, steps=a.steps, warmup=a.warmup,
                       systems=[s for s in SYSTEMS if s in systems], out=a.out, preset=preset,
                       device_type="cuda" if cuda else "cpu", backend="nccl" if cuda else "gloo",
                       timeout_s=a.timeout, mp=a.mp,
                       **sizes)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write ``results.json``, ``results.md``, ``phases.png`` into
    ``--out`` and print the table. Returns 0, or 1 if a rank crashed outside a system."""
    cfg = parse_args(argv)
    os.makedirs(cfg.out, exist_ok=True)
    if cfg.device_type == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    started = time.time()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="matrixfsdp_bench_") as tmp:
        result_file = os.path.join(tmp, "systems.json")
        try:
            mp.start_processes(_rank_main, args=(cfg, os.path.join(tmp, "init"), result_file),
                               nprocs=cfg.world_size, join=True, start_method="spawn")
        except Exception as e:  # a rank died outside the per-system error handling
            print(f"matrixfsdp bench: a rank failed: {e}", file=sys.stderr)
            return 1
        with open(result_file) as f:
            systems = json.load(f)
    results = {
        "config": asdict(cfg), "device": cfg.device_type, "torch": torch.__version__,
        "started_unix": started, "wall_s": time.perf_counter() - t0,
        "exact_bound": EXACT_BOUND, "method": __doc__, "systems": systems,
    }
    with open(os.path.join(cfg.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    md = render_markdown(results)
    with open(os.path.join(cfg.out, "results.md"), "w") as f:
        f.write(md)
    plot_phases(results, os.path.join(cfg.out, "phases.png"))
    print(md)
    print(f"total wall time {results['wall_s']:.1f} s; results in {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
