"""How the benchmark measures, on one rank (the rules are the ``harness`` docstring, which
``results.json`` stores as its ``"method"``):

* time: :func:`~matrixfsdp.train.machine.barrier` (on the system's own group) and
  :func:`clock` (wall and process CPU time, the device synchronised before each reading);
* memory: :func:`live_storages` (distinct storages reachable by the garbage collector),
  :func:`storage_bytes` and :func:`optimizer_tensors` (parameters, gradients, optimizer state);
* collectives and transient memory of the profiled step: :func:`analyse_profile`, with the
  payload rule :func:`collective_payload_bytes`; phases are marked by :func:`phase_range`;
* the NS limit of MatrixFSDP's step: :func:`ns_owned_ms`;
* exactness: :func:`compare` (max abs parameter difference against the reference system);
* the machine: :func:`~matrixfsdp.train.machine.machine_info` (CPU model, whether bf16
  matmuls run on AMX, threads).
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import matrixfsdp as mf
from matrixfsdp._compat import PROFILER_EVENT_TYPE
from matrixfsdp.optim.muon import MUON_DEFAULTS
from matrixfsdp.train.launch import sync
from matrixfsdp.train.machine import barrier

from .config import EXACT_BOUND, EXACT_ULPS, PHASES

NS_REPS = 5  # timed repetitions of the NS limit (after one warm-up)
RANGE_PREFIX = "benchmarks::"  # profiler range of a phase: RANGE_PREFIX + phase


# ------------------------------------------------------------------ clocks and barriers


@contextlib.contextmanager
def clock(device: torch.device, out: dict[str, float], key: str) -> Iterator[None]:
    """Adds ``<key>_wall_ms`` and ``<key>_cpu_ms`` (process CPU time) to ``out``."""
    sync(device)
    w0, c0 = time.perf_counter(), time.process_time()
    yield
    sync(device)
    out[f"{key}_wall_ms"] = (time.perf_counter() - w0) * 1e3
    out[f"{key}_cpu_ms"] = (time.process_time() - c0) * 1e3


def phase_range(phase: str, annotate: bool) -> contextlib.AbstractContextManager:
    """The profiler range that marks ``phase`` in the profiled step (a no-op unless ``annotate``)."""
    if annotate:
        return torch.profiler.record_function(RANGE_PREFIX + phase)
    return contextlib.nullcontext()


# ------------------------------------------------------------------ memory


def live_storages(device: torch.device) -> dict[tuple[int, str], int]:
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


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        st = t.untyped_storage()
        if st.data_ptr():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizers: Sequence[Any]) -> list[torch.Tensor]:
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


# ------------------------------------------------------------------ collectives (profiler)

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
    """Payload of one ``c10d::<op>`` call (rule in the harness docstring). ``world_size`` is
    the size of the group the all-gathers and reduce-scatters run in (the shard group under
    HSDP).

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


def analyse_profile(prof: Any, world_size: int, device: torch.device) -> dict[str, Any]:
    """Collectives per phase and the transient memory high-water mark of one profiled step.

    Returns ``{"collectives": {phase: {"calls", "bytes", "ops"}}, "unknown_ops": [...],
    "transient_peak_bytes": int}``.
    """
    roots = prof.profiler.kineto_results.experimental_event_tree()
    ranges: dict[str, tuple[int, int]] = {}
    for node in _walk(roots):
        if node.name.startswith(RANGE_PREFIX):
            ranges[node.name[len(RANGE_PREFIX):]] = (node.start_time_ns, node.end_time_ns)
    if set(ranges) != set(PHASES):
        raise RuntimeError(f"the profiled step has phase ranges {sorted(ranges)}, not {list(PHASES)}")

    per_phase = {ph: {"calls": 0, "bytes": 0, "ops": {}} for ph in PHASES}
    unknown: set[str] = set()

    def visit(node: Any) -> None:
        if node.tag == PROFILER_EVENT_TYPE.TorchOp and node.name.startswith("c10d::"):
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
                    if n.tag == PROFILER_EVENT_TYPE.Allocation and n.extra_fields.device.type == device.type)
    running = peak = 0
    for _, size in allocs:
        running += size
        peak = max(peak, running)
    return {"collectives": per_phase, "unknown_ops": sorted(unknown),
            "transient_peak_bytes": peak}


# ------------------------------------------------------------------ NS limit, exactness


def ns_owned_ms(model: nn.Module, rank: int, device: torch.device,
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
        barrier(device, group)
        sync(device)
        w0, c0 = time.perf_counter(), time.process_time()
        for g in mats:
            mf.zeropower_via_newtonschulz(g, ns["ns_coefficients"], ns["ns_steps"], ns["eps"],
                                          ns["ns_dtype"])
        sync(device)
        if rep:  # the first repetition is a warm-up
            wall.append((time.perf_counter() - w0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    return {"wall_ms": statistics.median(wall), "cpu_ms": statistics.median(cpu),
            "matrices": len(shapes)}


def compare(full: dict[str, torch.Tensor], ref_name: str,
            ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Max abs difference of the full parameters ``full`` from those of system ``ref_name``;
    ``ok`` when every parameter is there and every element is within :data:`EXACT_BOUND`
    plus :data:`EXACT_ULPS` of its parameter dtype's rounding at its own size (for fp32
    parameters ~2e-7 |p|; bf16 ones store 8 bits, so 1.6e-2 |p|)."""
    worst, worst_name, within = 0.0, None, True
    missing = sorted(set(ref) ^ set(full))
    for n in sorted(set(ref) & set(full)):
        if not full[n].numel():
            continue
        diff = (full[n].float() - ref[n].float()).abs()
        d = diff.max().item()
        if d > worst or worst_name is None:
            worst, worst_name = d, n
        allowed = EXACT_BOUND + EXACT_ULPS * torch.finfo(ref[n].dtype).eps * ref[n].float().abs()
        within = within and bool((diff <= allowed).all())
    ok = not missing and within and math.isfinite(worst)
    return {"reference": ref_name, "max_abs_diff": worst, "worst_param": worst_name,
            "missing_params": missing, "bound": EXACT_BOUND, "ok": ok}
