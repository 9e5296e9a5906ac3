"""What each rank of ``make gpu-check`` runs (:mod:`tools.gpu_check` starts them, one per GPU
over NCCL, or CPU ranks over gloo for the dry run): parity, host syncs, overlap, set-up
memory, the several-GPU path, on rank 0 Newton-Schulz's speed, and torchtitan's trainer at
context parallelism 2 (:mod:`tools.gpu_check_cp`). Each rank writes
``OUT/ranks/rank<r>.json`` after every check, so a rank that fails leaves what it measured
and where it stopped; the judging is :mod:`tools.gpu_check`'s.

Batches are made on the device (``torch.randint(..., device=...)``): nothing crosses from the
host inside a measured step. Host syncs are recorded by :class:`SyncRecorder`: torch's
``set_sync_debug_mode("warn")`` on CUDA, a stand-in on CPU that emits torch's warning from
every host read."""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.optim.muon import zeropower_via_newtonschulz
from matrixfsdp.runtime.exit import exit_rank
from matrixfsdp.train.launch import device_for
from matrixfsdp.train.machine import barrier
from matrixfsdp.train.models import GPT, GPTConfig

from . import tests_on_path
from .gpu_check_cp import check_context_parallel
from .gpu_check_judges import (
    NS_SHAPES,
    NS_SHAPES_CPU,
    NS_STEPS,
    PARITY_STEPS,
    overlap_stats,
    setup_memory_ok,
    split_events,
    trace_events,
)

CFG = GPTConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_mlp=256, seq_len=32)
LR, ADAMW_LR = 0.02, 3e-3
# the overlap check's model: compute well above communication on NVLink (GPU), seconds on CPU
OVERLAP = {"cuda": (GPTConfig(vocab_size=8192, d_model=1024, n_heads=16, n_layers=8, d_mlp=4096,
                              seq_len=1024), 8),
           "cpu": (GPTConfig(vocab_size=256, d_model=128, n_heads=4, n_layers=4, d_mlp=512, seq_len=64), 4)}
SYNC_TEXT = "called a synchronizing CUDA operation"  # torch's warning (c10/cuda, warn_or_error_on_sync)
INJECTED = "deliberate_host_read"  # the function of the broken input's .item()
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
HERE = os.path.abspath(__file__)


# ---- data and steps --------------------------------------------------------------------------

def batches(device: torch.device, n: int, cfg: GPTConfig = CFG, batch: int = 2) -> list[torch.Tensor]:
    """``n`` token batches made on ``device`` (the same on every rank: means are exact)."""
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), device=device, generator=g)
            for _ in range(n)]


def step(model, optimizers, x: torch.Tensor, clip: bool = False, recorder=None, inject: bool = False) -> None:
    def phase(name):
        if recorder is not None:
            recorder.phase = name
    phase("forward")
    loss = model.loss(x[:, :-1], x[:, 1:])
    if inject:
        deliberate_host_read(loss)
    phase("backward")
    loss.backward()
    if clip:
        phase("clip")
        mf.clip_grad_norm_(model.parameters(), 1.0)
    phase("step")
    for o in optimizers:
        o.step()
    for o in optimizers:
        o.zero_grad()
    phase("")


def deliberate_host_read(loss: torch.Tensor) -> float:
    """The broken input of the host-sync check: a host read in the step."""
    return loss.item()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sharded(device: torch.device, world: int, overlap: bool = True, model: nn.Module | None = None,
            ns_dtype: torch.dtype = torch.bfloat16):
    """A GPT (or ``model``) built on the CPU, sharded over the world: fully_shard moves it."""
    if model is None:
        torch.manual_seed(0)
        model = GPT(CFG)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh, overlap=overlap)
    return model, mf.Muon(mf.muon_param_groups(model, lr=LR, adamw_lr=ADAMW_LR, ns_dtype=ns_dtype))


# ---- parity ------------------------------------------------------------------------------------

def _worst(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(((ours[n].float() - p.float()).abs() / (1 + p.float().abs())).max().item()
               for n, p in ref.items() if p.numel())


def check_parity(device: torch.device, world: int, out: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(CFG)  # on the CPU: fully_shard moves it to the mesh's device
    reference = copy.deepcopy(model).to(device)
    model, opt = sharded(device, world, model=model, ns_dtype=torch.float32)
    on_device = all(p.device == device for p in model.parameters())
    muon = {n for n, pl in mf.plan_of(model).placements.items() if pl.spec.muon}
    named = list(reference.named_parameters())
    ref_opts = [torch.optim.Muon([p for n, p in named if n in muon], lr=LR),
                torch.optim.AdamW([p for n, p in named if n not in muon], lr=ADAMW_LR)]
    data = batches(device, PARITY_STEPS)
    for x in data:
        step(model, [opt], x)
    behind = {}
    tests_on_path()
    from helpers.reference import reference_ns_fp32

    with reference_ns_fp32():
        for i, x in enumerate(data):
            if i == len(data) - 1:
                behind = {n: p.detach().clone() for n, p in named}
            step(reference, ref_opts, x)
    full = mf.full_state_dict(model)
    return {"diff": _worst(full, dict(named)), "behind": _worst(full, behind), "on_device": on_device,
            "world": world}


# ---- host syncs ------------------------------------------------------------------------------------

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
MAKERS = ("tensor", "as_tensor")


class SyncRecorder:
    """While entered: every host synchronisation, as ``{"phase", "where", "stack"}``.

    CUDA: ``torch.cuda.set_sync_debug_mode("warn")``, and each of torch's "called a
    synchronizing CUDA operation" warnings is taken with the Python stack it was raised on
    (``warnings.showwarning`` replaced: it runs in the thread that warned, autograd's
    included). CPU, where there is no such mode: a stand-in emits the same warning from every
    host read (``Tensor.item``, ``tolist``, ``bool()``, ``int()``, ``float()``, ``cpu``,
    ``numpy``, ``.to("cpu")``, ``torch.tensor(..., device=...)``) made by code outside torch's
    own package (torch's optimizers read their CPU step counters, which is no device sync).
    ``where`` is the innermost frame outside torch, ``warnings`` and this stand-in."""

    def __init__(self, device: torch.device):
        self.device, self.phase, self.seen, self._saved = device, "", [], {}
        self._warnings = warnings.catch_warnings()

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_TEXT not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if not f.filename.startswith(TORCH_DIR) and os.path.basename(f.filename) != "warnings.py"
                  and not (f.filename == HERE and f.name in ("emit", "_read", "_made", "_moved"))]
        inner = frames[-1] if frames else None
        where = (f"{_short(inner.filename)}:{inner.lineno} in {inner.name}" if inner
                 else f"{filename}:{lineno}")
        self.seen.append({"phase": self.phase, "where": where, "message": str(message).splitlines()[0][:200],
                          "stack": [f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in frames[-12:]]})

    def __enter__(self) -> SyncRecorder:
        self._warnings.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._stand_in()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        else:
            for name, original in self._saved.items():
                setattr(torch if name in MAKERS else torch.Tensor, name, original)
            self._saved = {}
        self._warnings.__exit__(*exc)

    def _stand_in(self) -> None:
        def emit(what: str) -> None:
            caller = inspect.currentframe().f_back.f_back.f_code.co_filename  # past _read
            if not caller.startswith(TORCH_DIR):
                warnings.warn(f"{SYNC_TEXT} (CPU stand-in: {what})", UserWarning, stacklevel=3)

        for name in READS:
            original = self._saved[name] = getattr(torch.Tensor, name)

            def _read(t, *args, _name=name, _original=original, **kwargs):
                emit(f"Tensor.{_name}")
                return _original(t, *args, **kwargs)
            setattr(torch.Tensor, name, _read)
        to = self._saved["to"] = torch.Tensor.to

        def _moved(t, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu" \
                    and t.device.type != "cpu":
                emit("Tensor.to(cpu)")
            return to(t, *args, **kwargs)
        torch.Tensor.to = _moved
        for name in MAKERS:
            original = self._saved[name] = getattr(torch, name)

            def _made(*args, _name=name, _original=original, **kwargs):
                if "device" in kwargs:  # host values made on a device: a host-to-device copy
                    emit(f"torch.{_name}(..., device=)")
                return _original(*args, **kwargs)
            setattr(torch, name, _made)


def _short(path: str) -> str:
    for root in (os.sep + "src" + os.sep, os.sep + "tools" + os.sep):
        if root in path:
            return path[path.rindex(root) + 1:]
    return os.path.basename(path)


class Unused(nn.Module):
    """A layer no rank calls: its parameters never get a gradient."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Linear(d, d)


def check_syncs(device: torch.device, world: int, out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for label, extra in (("steady", False), ("unused", True)):
        torch.manual_seed(0)
        model = GPT(CFG)
        if extra:
            model.layers[0].unused = Unused(CFG.d_model)
        model, opt = sharded(device, world, model=model)
        data = batches(device, 4)
        for x in data[:2]:  # the first steps' one-time work (lazy set-up, optimizer state)
            step(model, [opt], x, clip=True)
        sync(device)
        with SyncRecorder(device) as rec:
            step(model, [opt], data[2], clip=True, recorder=rec)
        sync(device)
        res[label] = rec.seen
        if not extra:
            with SyncRecorder(device) as rec:  # the broken input: it must be seen
                step(model, [opt], data[3], clip=True, recorder=rec, inject=True)
            res["injected"] = rec.seen
    return res


# ---- overlap -------------------------------------------------------------------------------------

def _profiled(device: torch.device, model, optimizers, data, keep: Path | None) -> list[dict[str, Any]]:
    """Two steps, then one under ``torch.profiler``: its events (its chrome trace kept at
    ``keep``)."""
    from torch.profiler import ProfilerActivity, profile

    for x in data[:2]:
        step(model, optimizers, x)
    sync(device)
    barrier(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step(model, optimizers, data[2])
        sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(keep) if keep else os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return trace_events(json.load(f))


def check_overlap(device: torch.device, world: int, out: Path) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if world < 2:
        return {"world": world}
    cfg, batch = OVERLAP[device.type]
    cuda = device.type == "cuda"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
    mesh = init_device_mesh(device.type, (world,))
    data = batches(device, 3, cfg, batch)
    res: dict[str, Any] = {"world": world}
    for label in ("matrixfsdp", "matrixfsdp overlap off", "fsdp2"):
        torch.manual_seed(0)
        with torch.device(device) if cuda else contextlib.nullcontext():
            model = GPT(cfg)
        if label == "fsdp2":
            for block in model.layers:
                fully_shard(block, mesh=mesh, **({"mp_policy": mp} if mp else {}))
            fully_shard(model, mesh=mesh, **({"mp_policy": mp} if mp else {}))
            opts = [torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)]
        else:
            for block in model.layers:
                mf.fully_shard(block, mesh=mesh, mp_policy=mp)
            mf.fully_shard(model, mesh=mesh, mp_policy=mp, overlap=label == "matrixfsdp")
            opts = [mf.Muon(mf.muon_param_groups(model, lr=LR, adamw_lr=ADAMW_LR))]
        keep = out / "ranks" / f"trace_{label.replace(' ', '_')}.json" if dist.get_rank() == 0 else None
        events = _profiled(device, model, opts, data, keep)
        res[label] = overlap_stats(*split_events(events, device.type))
        del model, opts, events
        _free(device)
    return res


# ---- set-up memory ------------------------------------------------------------------------------------

def check_setup_memory(device: torch.device, world: int, out: Path) -> dict[str, Any]:
    cuda = device.type == "cuda"
    width = 1024 if cuda else 128  # a dry run checks the logic, quickly
    cfg = GPTConfig(vocab_size=8192, d_model=width, n_heads=16, n_layers=8, d_mlp=4 * width, seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg)  # on the CPU
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    if cuda:
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    root = mf.get_root(model)
    shards = sum(u.storage.local.numel() * u.storage.local.element_size() for u in root.units)
    unit = max(u.layout.gathered_numel + u.layout.copied_numel for u in root.units) * 4
    held = sum(b.untyped_storage().nbytes() for u in root.units
               for b in (u.storage.gathered, u.storage.copied))
    m: dict[str, Any] = {"model (fp32)": f"{full / 2**20:.0f} MiB",
                         "this rank's shards": f"{shards / 2**20:.0f} MiB",
                         "largest unit": f"{unit / 2**20:.0f} MiB", "unsharded buffers held": f"{held} B"}
    after = peak = export = None
    if cuda:
        after = torch.cuda.memory_allocated(device) - base
        peak = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
        exported = mf.full_state_dict(model, cpu_offload=True, every_rank=True)
        export = torch.cuda.max_memory_allocated(device) - base
        m.update({"allocated after set-up": f"{after / 2**20:.0f} MiB",
                  "peak during it": f"{peak / 2**20:.0f} MiB",
                  "peak of full_state_dict(cpu_offload=True)": f"{export / 2**20:.0f} MiB"})
    else:
        exported = mf.full_state_dict(model, cpu_offload=True, every_rank=True)
    ok = setup_memory_ok(held, shards, unit, after, peak, export) and all(
        t.device.type == "cpu" for t in exported.values())
    return {"ok": ok, "measured": m,
            "note": "" if ok else "more than the shards + two units, or a buffer held"}


# ---- several GPUs ---------------------------------------------------------------------------------------

def check_many(device: torch.device, world: int, out: Path) -> dict[str, Any]:
    if world == 1:
        return {"ok": None, "measured": {"ranks": 1}, "note": "needs 2+ ranks"}
    states, launches, units = [], None, 0
    for overlap in (True, False):
        model, opt = sharded(device, world, overlap)
        mf.comm_stats(model).reset()
        for x in batches(device, 2):
            step(model, [opt], x)
        states.append(mf.full_state_dict(model))
        if overlap:
            root = mf.get_root(model)
            launches, units = (root.comm.coalesce, dict(mf.comm_stats(model).launches)), len(root.units)
    same = all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    coalesced, count = launches
    one_each = coalesced and count.get("reduce") == 2 * units
    ok = same and (device.type != "cuda" or one_each)
    return {"ok": ok, "measured": {"coalescing": coalesced, "launches (2 steps)": count,
                                   "overlap on/off bit-identical": same},
            "note": "" if ok else "overlap on and off differ" if not same
            else "more than one launch per unit"}


# ---- Newton-Schulz ----------------------------------------------------------------------------

def check_ns(device: torch.device, world: int, out: Path, reps: int = 5) -> dict[str, Any]:
    """Rank 0 (the others wait): seconds per NS at each shape, bf16, after one warm-up."""
    if dist.get_rank() != 0:
        return {"rank": dist.get_rank()}
    coeff = (3.4445, -4.775, 2.0315)
    timings = []
    for m, n in (NS_SHAPES if device.type == "cuda" else NS_SHAPES_CPU):
        g = torch.randn(m, n, device=device)
        zeropower_via_newtonschulz(g, coeff, NS_STEPS, 1e-7, torch.bfloat16)  # warm-up
        sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            zeropower_via_newtonschulz(g, coeff, NS_STEPS, 1e-7, torch.bfloat16)
        sync(device)
        timings.append([m, n, (time.perf_counter() - t) / reps])
        del g
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "timings": timings}


# ---- the rank ------------------------------------------------------------------------------------

CHECKS = (("parity", check_parity), ("host syncs", check_syncs), ("overlap", check_overlap),
          ("set-up memory", check_setup_memory), ("several GPUs", check_many), ("Newton-Schulz", check_ns),
          ("context parallelism", check_context_parallel))


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rank_entry(rank: int, from_launcher, settings: dict[str, Any]) -> None:
    """One rank, forked from the launcher's preloaded server (:mod:`matrixfsdp.train.rank_process`):
    every check in turn; ``OUT/ranks/rank<r>.json`` rewritten after each. A check that raises
    is recorded with its traceback and ends the rank (the others would wait in a collective):
    the launcher then ends them."""
    from_launcher.adopt()
    world, cuda = settings["world"], settings["cuda"]
    if not cuda:
        torch.set_num_threads(1)
    device = device_for(rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{settings['init']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=settings["timeout_s"]))
    path = Path(settings["out"]) / "ranks" / f"rank{rank}.json"
    done: dict[str, Any] = {}
    for name, fn in CHECKS:
        t = time.perf_counter()
        try:
            done[name] = fn(device, world, Path(settings["out"]))
        except Exception:
            done[name] = {"error": traceback.format_exc()}
            path.write_text(json.dumps(done, indent=1, default=str))
            print(f"[gpu-check] rank {rank}: {name} raised:\n{done[name]['error']}", file=sys.stderr,
                  flush=True)
            os._exit(1)
        done[name + " seconds"] = time.perf_counter() - t
        path.write_text(json.dumps(done, indent=1, default=str))
        _free(device)
        barrier(device)
        if rank == 0:
            print(f"[gpu-check] {name}: measured ({time.perf_counter() - t:.1f} s)", flush=True)
    dist.destroy_process_group()
    exit_rank(0)
