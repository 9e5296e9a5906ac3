"""matrixfsdp.runtime.collectives: each collective's result and what it is charged (this rank's bytes, its
most loaded rank's, the mean), and a unit without parameters of its own issuing none."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist
from helpers.rank_pool import spawn

from matrixfsdp.layout.loads import op_load
from matrixfsdp.runtime.collectives import Comm, CommStats, coalescing_supported


def _worker(rank, world_size):
    stats = CommStats()
    comm = Comm(dist.group.WORLD, stats)
    P, n = world_size, 6
    x = torch.arange(n, dtype=torch.float32) + 10 * rank

    out = torch.empty(P * n)
    comm.all_gather(out, x.clone()).wait()
    assert torch.equal(out, torch.cat([torch.arange(n, dtype=torch.float32) + 10 * r for r in range(P)]))

    full = torch.arange(P * n, dtype=torch.float32) * (rank + 1)
    mine = torch.empty(n)
    comm.reduce_scatter(mine, full.clone()).wait()  # mean of (r + 1) * x over ranks
    mean = sum(range(1, P + 1)) / P
    torch.testing.assert_close(mine, torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) * mean)

    t = x.clone()
    comm.broadcast(t, 1).wait()
    assert torch.equal(t, torch.arange(n, dtype=torch.float32) + 10)

    t = x.clone()
    comm.reduce(t, 2).wait()
    if rank == 2:
        expected = torch.arange(n, dtype=torch.float32) + 10 * sum(range(P)) / P
        torch.testing.assert_close(t, expected)

    counts = stats.summary()
    b = n * 4  # bytes of one rank's piece
    assert counts["all_gather"]["critical_bytes"] == (P - 1) * b  # ring: (P-1)/P of P*b
    assert counts["reduce_scatter"]["critical_bytes"] == (P - 1) * b
    # pipelined: every rank moves the piece about once, the root only sends (broadcast) or
    # only receives (reduce)
    assert counts["broadcast"]["critical_bytes"] == b and counts["reduce"]["critical_bytes"] == b
    assert counts["broadcast"]["received_bytes"] == (0 if rank == 1 else b)
    assert counts["reduce"]["sent_bytes"] == (0 if rank == 2 else b)


def test_collectives_and_their_loads_four_ranks():
    spawn(_worker, 4)


def _batch_worker(rank, world_size):
    from matrixfsdp import testing
    group = dist.group.WORLD
    coalesce = coalescing_supported(group, torch.device("cpu"))
    assert coalesce == (dist.get_backend() == "grouped_gloo")
    stats = CommStats()
    comm = Comm(group, stats, coalesce=coalesce, device=torch.device("cpu"))
    sizes = [3, 0, 5, 2]  # a rank may hold nothing
    rows = torch.empty(world_size * 2)
    held = [torch.full((n,), float(r if r == rank else -1)) for r, n in enumerate(sizes)]
    testing.COUNTS.reset()
    pending = comm.batch("gather", [lambda: comm.all_gather(rows, torch.full((2,), float(rank)))] +
                         [(lambda r=r, t=t: comm.broadcast(t, r)) for r, t in enumerate(held) if t.numel()])
    pending.wait()
    assert torch.equal(rows, torch.arange(world_size).repeat_interleave(2).float())
    assert all(torch.equal(t, torch.full((n,), float(r))) for r, (t, n) in enumerate(zip(held, sizes)))
    # one launch where the group coalesces, else one per op; the same ops either way
    assert stats.launches == {"gather": 1 if coalesce else 4}, stats.launches
    assert stats.calls == {"all_gather": 1, "broadcast": 3}, stats.calls
    if coalesce:
        assert dict(testing.COUNTS.launches) == {"coalesced": 1}, testing.COUNTS.launches
        assert dict(testing.COUNTS.ops) == {"all_gather": 1, "broadcast": 3}, testing.COUNTS.ops


def test_a_batch_is_one_launch_where_the_group_coalesces():
    """An even all-gather and a broadcast from each rank holding something: one launch on a
    group that coalesces (grouped_gloo, NCCL's behaviour), one per op on gloo; the same ops,
    results and counts either way."""
    spawn(_batch_worker, 4, backend="grouped_gloo")
    spawn(_batch_worker, 4)


def test_load_model_sums_to_what_the_ring_moves():
    """Over all ranks, a pipelined broadcast/reduce of n bytes sends and receives (P-1) n in
    total (each of P-1 links carries it once); a ring all-gather moves (P-1) n per rank."""
    for P in (2, 3, 8, 1000):
        n = 4096
        for kind in ("broadcast", "reduce"):
            loads = [op_load(kind, n, P, r, root=P // 2) for r in range(P)]
            assert sum(ld.sent for ld in loads) == sum(ld.received for ld in loads) == (P - 1) * n
            assert max(max(ld.sent, ld.received) for ld in loads) == n
            ends = [r for r, ld in enumerate(loads) if not ld.sent or not ld.received]
            assert sorted(ends) == sorted({P // 2, (P // 2 + (1 if kind == "reduce" else -1)) % P})
        for kind in ("all_gather", "reduce_scatter"):
            assert {op_load(kind, P * n, P, r).critical for r in range(P)} == {(P - 1) * n}
        assert op_load("all_reduce", n, P, 0).critical == 2 * n * (P - 1) // P


def _empty_root_worker(rank, world_size):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp as mf

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        mf.fully_shard(layer, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)  # the root holds nothing of its own
    opt = mf.Muon(mf.muon_param_groups(model, lr=0.02))
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    # per layer: a gather in forward and backward (the bias all-gathered, the weight
    # broadcast from its owner) and a reduce (the bias rows and the gradient flags
    # reduce-scattered, the weight reduced to its owner); nothing for the root
    assert mf.comm_stats(model).calls == {"all_gather": 4, "broadcast": 4, "reduce_scatter": 2,
                                          "reduce": 2}


def test_unit_without_parameters_issues_no_collective():
    spawn(_empty_root_worker, 2)


TWIN_SCRIPT = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from matrixfsdp.diagnosis.timeouts import group_timeout, twin_group

made = []
for i in range(2):  # the second time after destroy_process_group, as a worker reused by tests
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/init{i}", rank=0,
                            world_size=1, timeout=timedelta(seconds=42))
    world = dist.group.WORLD
    assert group_timeout(world) == timedelta(seconds=42) == group_timeout(world, "cpu")
    twin = twin_group(world, backend="gloo")
    assert twin is not world and twin_group(world, backend="gloo") is twin  # made once
    assert group_timeout(twin) == timedelta(seconds=42)  # the group's own by default
    short = twin_group(world, timeout=timedelta(seconds=7))
    assert short is not twin and twin_group(world, timeout=timedelta(seconds=7)) is short
    assert group_timeout(short) == timedelta(seconds=7)
    t = torch.ones(1)
    dist.all_reduce(t, group=twin)
    made.append(twin)
    dist.destroy_process_group()
assert made[0] is not made[1]
print("ok", flush=True)
from matrixfsdp.runtime.exit import exit_rank
exit_rank(0)  # the twins' gloo threads outlive their destroyed groups: no interpreter teardown
"""


def test_twin_group_is_made_once_per_group_and_again_after_a_destroyed_process_group(tmp_path):
    """runtime.process_groups: a group's timeout, and its twin (HSDP's bounded mesh groups,
    the asynchronous save's gloo group) made once per (group, backend, timeout) and made
    again once the process group it came from was destroyed."""
    out = subprocess.run([sys.executable, "-c", TWIN_SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _failed_probe_worker(rank, world_size):
    import logging

    from matrixfsdp import testing

    class Failing(testing.Hollow):  # a backend that should coalesce and fails
        def _start_coalescing(self, device):
            raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp: unhandled system error")

    if "failing" not in dist.Backend.backend_list:
        dist.Backend.register_backend("failing", lambda store, r, size, timeout: Failing(r, size),
                                      devices=["cpu"])
    dist.init_process_group("failing", store=dist.HashStore(), rank=1, world_size=2)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("matrixfsdp.runtime.collectives")
    log.addHandler(handler)
    try:
        assert coalescing_supported(dist.group.WORLD, torch.device("cpu")) is False
    finally:
        log.removeHandler(handler)
    assert any("failed to coalesce" in m and "unhandled system error" in m for m in seen), seen


def test_a_failed_coalescing_probe_says_so():
    """A group that cannot coalesce for another reason than gloo's "does not implement"
    (a failing NCCL) takes the one-launch-per-op path with a warning naming the error, not
    silently (gloo's refusal is silent: tests above)."""
    spawn(_failed_probe_worker, 1, init=False)


def _averages(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from matrixfsdp.runtime.collectives import group_capabilities
    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    can = group_capabilities(group, torch.device("cpu"))
    assert can.average and not can.coalesce, can  # gloo in torch 2.13: AVG, no coalescing
    x = torch.arange(8.0) * (rank + 1) / 3
    got = {}
    for average in (True, False):
        comm = Comm(group, CommStats(), average=average)
        out = torch.empty(8 // world)
        comm.reduce_scatter(out, x.clone()).wait()
        t = x.clone()
        comm.all_reduce(t).wait()
        r = x.clone()
        comm.reduce(r, 0).wait()
        got[average] = (out, t, r[:4] if rank == 0 else None)
        assert comm._mean(None, t)[0] == (dist.ReduceOp.AVG if average else dist.ReduceOp.SUM)
        assert comm._mean(2.5, t)[0] == dist.ReduceOp.SUM  # another divisor: a sum, then div_
    for a, b in zip(got[True], got[False]):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-7, atol=0)


def test_a_group_that_averages_gets_its_means_from_the_collective():
    """Asked once at set-up (one all-reduce that is also the AVG probe): gloo in torch 2.13
    averages, so a mean is ``ReduceOp.AVG`` with no division after it (NCCL's op, FSDP2's
    choice there); another divisor, or a group without AVG, sums and divides. Both give the
    same means."""
    spawn(_averages, 2)
