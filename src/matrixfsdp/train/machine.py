"""The machine a run is on, as every measurement records it (``matrixfsdp calibrate``'s
constants, the benchmarks' ``results.json``): the CPU model, the ISA torch dispatches to,
bf16 matmuls on AMX, the threads, the GPU; and a barrier pinned to the rank's device."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch
import torch.distributed as dist

from .._compat import amx_tile_supported


def _cpuinfo() -> tuple[str | None, set[str]]:
    """The CPU model name and flags from ``/proc/cpuinfo`` (Linux; else ``(None, set())``)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None, set()
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def machine_info() -> dict[str, Any]:
    """What the figures depend on, recorded in ``results.json`` and the table: the CPU model,
    the ISA torch dispatches to (``AVX2``, ``AVX512``, ...), whether bf16 matmuls run on AMX
    (the CPU has ``amx_bf16`` and torch can use its tiles, via oneDNN), the threads of this
    rank (``torch.get_num_threads``, ``OMP_NUM_THREADS``), the logical CPUs, and the GPU."""
    model, flags = _cpuinfo()
    amx_tiles = amx_tile_supported()
    amx_flag = "amx_bf16" in flags if flags else None
    return {
        "cpu_model": model or platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_matmul_amx": bool(amx_tiles and (amx_flag is not False)
                                and torch.backends.mkldnn.is_available()),
        "cpu_flag_amx_bf16": amx_flag,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def machine_line(m: dict[str, Any] | None) -> str:
    """One sentence naming the machine of :func:`machine_info` (for tables and docs)."""
    if not m:
        return "Machine: not recorded."
    gpu = f"; GPU {m['gpu']}" if m.get("gpu") else ""
    return (f"Machine: {m['cpu_model']} ({m['logical_cpus']} logical CPUs, torch CPU capability "
            f"{m['cpu_capability']}, bf16 matmuls on AMX: {'yes' if m['bf16_matmul_amx'] else 'no'})"
            f"{gpu}; {m['torch_threads']} torch thread(s) per rank, "
            f"OMP_NUM_THREADS={m['omp_num_threads']}.")


def barrier(device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    """``dist.barrier`` on ``group`` (default: the world), pinned to the rank's GPU on CUDA."""
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)
