"""One small helper to run a function on N local gloo ranks (spawned processes)."""

from __future__ import annotations

import faulthandler
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from matrixfsdp.train.exit import exit_rank


def _entry(rank: int, fn, world_size: int, init_file: str, args: tuple) -> None:
    faulthandler.enable(all_threads=True)  # a native abort in a rank prints every thread's stack
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    exit_rank(0)  # finished: leave without interpreter finalization (see matrixfsdp.train.exit)


def spawn(fn, world_size: int, *args, timeout: float = 240.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise if any rank
    fails or the whole run exceeds ``timeout`` seconds (never hang the suite)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(_entry, args=(fn, world_size, init_file, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks ran past {timeout} s")
