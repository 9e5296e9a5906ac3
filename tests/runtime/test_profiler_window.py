"""The tests' collective counter (helpers/collectives.py) never closes torch's profiler over
a collective still in flight: gloo's worker thread then writes the op's profiler record
after the profiler stopped, which corrupted a rank's heap (QK-clip's all-reduce, left in
flight out of a forward window, under HSDP 2x2). The window waits for the library's
collectives to complete, or fails naming them."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from helpers.collectives import Collectives
from helpers.rank_pool import spawn

from matrixfsdp.runtime.collectives import Comm, CommStats, in_flight


def _window(rank, world, late_s):
    comm = Comm(dist.group.WORLD, CommStats())
    counted, t = Collectives(), torch.ones(4)
    error = None
    try:
        with counted.during("forward", settle_s=1.0):
            if rank == 1:
                time.sleep(late_s)  # the peer issues late: rank 0's all-reduce stays in flight
            pending = comm.all_reduce(t)
    except AssertionError as e:
        error = str(e)
    pending.wait()
    assert not in_flight()
    return error


def _check(rank, world):
    assert _window(rank, world, 0.0) is None  # completed within the window: it closes
    late = _window(rank, world, 3.0)
    if rank == 0:  # its all-reduce waited for rank 1 past the window's 1 s
        assert late is not None and "all_reduce" in late and "in flight" in late, late
    else:
        assert late is None


def test_window_waits_for_or_names_collectives_in_flight():
    spawn(_check, 2)
