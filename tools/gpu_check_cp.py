"""``make gpu-check``'s context-parallelism check (a rank check of :mod:`tools.gpu_check_ranks`):
torchtitan's own Trainer at ``context_parallel_degree`` 2 through the one line
(torchtitan's ``apply_cp_to_forward`` called unchanged by ``parallelize``; ``mf.fully_shard``
over torchtitan's ``fsdp`` mesh, which holds the cp ranks) against torchtitan + FSDP2 + torch
Muon from one seed checkpoint: 10 steps of the llama3 debug model at a test's size (the tests'
tiny tokenizer and data, ``tests/helpers``), fp32 parameters and Newton-Schulz.

It cannot run on CPU: SDPA's CPU flash kernel has no DTensor sharding strategy (both sides
fail there, ``tests/integrations/test_torchtitan_nd.py``). ``degree`` 1 runs the same
comparison without CP on CPU ranks (torchtitan's CPU shim, ``tests/helpers/titan_cpu.py``):
how the script itself is tested without a GPU (``tests/tools/test_gpu_check.py``, heavy)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import tests_on_path
from .gpu_check_judges import CP_STEPS, CP_TOL


def check_context_parallel(device: torch.device, world: int, out: Path,
                           degree: int = 2) -> dict[str, Any]:
    """Rank 0 returns ``{"steps", "diff"}`` (the largest per-step loss difference); the
    other ranks ``{}``. Not run (``{"skipped": why}``) without 2+ GPUs in an even number, or
    without torchtitan."""
    if degree > 1 and (device.type != "cuda" or world < 2 or world % degree):
        return {"skipped": "needs 2+ GPUs, an even number"}
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        return {"skipped": "torchtitan is not installed (pip install -e '.[test]')"}
    tests_on_path()
    from helpers import titan_cpu, titan_reference, titan_runs
    from helpers.reference import reference_ns_fp32

    titan_cpu.import_torchtitan()
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    import matrixfsdp.integrations.torchtitan as mft

    def configured(ours: bool):
        config = llama3_debugmodel()
        config.optimizer = mft.muon_optimizer(config.optimizer, ns_dtype="float32")
        return mft.convert(config) if ours else titan_reference.on_fsdp2(config)

    rank = dist.get_rank()
    folder = out / "context-parallel"
    folder.mkdir(parents=True, exist_ok=True)
    # what torchrun would have set (gpu-check's ranks are one node's: local = global rank);
    # torchtitan's trainer reads them. The other checks read none of them.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world),
                      MF_RANK=str(rank), MF_WORLD=str(world))
    seed = titan_runs.seed(str(folder), lambda: configured(False))
    steps = {}
    for name, ours in (("fsdp2", False), ("ours", True)):
        path = folder / f"{name}.json"
        config = titan_cpu.on_cpu(configured(ours), dump_folder=str(folder / name),
                                  metrics_path=str(path), positions=True, steps=CP_STEPS)
        config.parallelism.context_parallel_degree = degree
        config.training.mixed_precision_param = "float32"
        config.training.disable_cuda_graphs = True
        config.checkpoint.enable, config.checkpoint.initial_load_path = True, seed
        on_cpu = titan_cpu.titan_on_cpu() if device.type == "cpu" else contextlib.nullcontext()
        ns = reference_ns_fp32() if not ours else contextlib.nullcontext()
        with on_cpu, ns:
            trainer = config.build()
            try:
                trainer.train()
            finally:
                trainer.close()
        dist.barrier()
        if rank == 0:
            with open(path) as f:
                steps[name] = {int(k): v for k, v in json.load(f).items()}
    if rank != 0:
        return {}
    diffs = [abs(steps["ours"][s]["loss"] - steps["fsdp2"][s]["loss"]) for s in steps["fsdp2"]]
    return {"steps": len(diffs), "diff": max(diffs), "degree": degree, "expected": CP_STEPS,
            "bound": CP_TOL}
