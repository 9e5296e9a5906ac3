"""Runs of torchtitan's own entry point, ``torchtitan.train.main()``, on a test job's ranks
(tests only): each on a fresh gloo process group (torchtitan's ``main()`` destroys the one
it ran on), from one seed checkpoint, its logged steps read back from the metrics file
(:class:`helpers.titan_cpu` ``RecordingMetrics``), its last checkpoint's model read back
on one rank."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import titan_cpu


def group(out: str, name: str) -> None:
    """A fresh gloo process group of this job's ranks, as torchrun would give each run."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, name + '.pg')}",
                                rank=int(os.environ["MF_RANK"]), world_size=int(os.environ["MF_WORLD"]),
                                timeout=timedelta(seconds=120))


def start(rank: int, world: int, out: str) -> None:
    """A job's ranks, before their first run: this rank's place, its first group,
    torchtitan imported (once per process)."""
    os.environ.update(MF_RANK=str(rank), MF_WORLD=str(world))
    group(out, "seed")
    titan_cpu.import_torchtitan()


def run(out: str, name: str, module: str, config: str, *args: str,
        metrics_rank: int = 0, **on_cpu: Any) -> dict[int, dict]:
    """``torchtitan.train.main()`` with ``--module <module> --config <config>`` and ``args``,
    the loaded config made to run here (``titan_cpu.on_cpu``); returns the logged steps
    (written by ``metrics_rank``: under pipeline parallelism a last stage's) on rank 0,
    ``{}`` elsewhere. ``on_cpu``: more of ``titan_cpu.on_cpu``'s arguments."""
    path = os.path.join(out, f"{name}.json")
    titan_cpu.ADAPT["config"] = lambda c: titan_cpu.on_cpu(
        c, dump_folder=os.path.join(out, name), metrics_path=path, metrics_rank=metrics_rank,
        **on_cpu)
    group(out, name)
    titan_cpu.run_main(["--module", module, "--config", config, *args])
    if dist.is_initialized() or int(os.environ["MF_RANK"]) != 0:
        return {}
    deadline = time.monotonic() + 120  # written whole (renamed) by its rank, maybe another
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(path) as f:
        return {int(k): v for k, v in json.load(f).items()}


def seed(out: str, config_fn: Callable[[], Any]) -> str:
    """The seed checkpoint every run loads: the model's state dict after torchtitan's own
    init on one process (rank 0), of ``config_fn()`` at the test's size."""
    import torch.distributed.checkpoint as dcp
    path = os.path.join(out, "seed")
    if dist.get_rank() == 0:
        model = _built(config_fn)
        model.init_weights(buffer_device=None)
        dcp.save(model.state_dict(), checkpoint_id=path, no_dist=True)
    dist.barrier()
    return path


def _built(config_fn: Callable[[], Any]) -> torch.nn.Module:
    config = titan_cpu.on_cpu(config_fn())
    torch.manual_seed(0)
    with torch.device("cpu"):
        return config.model_spec.model.build()


def load_model(path: str, config_fn: Callable[[], Any]) -> dict[str, torch.Tensor]:
    """The model state (parameters and buffers, as torchtitan saves them) in the checkpoint
    at ``path`` (a seed, or a run's ``checkpoint/step-N``), read on this process alone."""
    import torch.distributed.checkpoint as dcp
    state = _built(config_fn).state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return {k: v.detach().clone() for k, v in state.items()}


def first_load(seed_path: str) -> list[str]:
    """torchtitan's flags that load ``seed_path`` (the model only) before step 1."""
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", seed_path]


def diffs(a: dict, b: dict) -> list[float]:
    """Per-step absolute loss differences over the steps both runs logged."""
    return [abs(a[s]["loss"] - b[s]["loss"]) for s in sorted(a) if s in b]
