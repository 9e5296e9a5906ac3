"""gather_v / reduce_v over uneven segments (an empty one included), sync and async."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _dist import spawn
from torch.profiler import ProfilerActivity, profile

from matrixfsdp.comm import CommStats, gather_v, reduce_v


def _worker(rank, world_size, sizes, expected_ops):
    group = dist.group.WORLD
    stats = CommStats()
    total = sum(sizes)
    offsets = [sum(sizes[:r]) for r in range(world_size)]
    expected = torch.arange(total, dtype=torch.float32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _gather_and_reduce(rank, world_size, sizes, group, stats, offsets, expected)
    ops = {e.name for e in prof.events() if e.name.startswith("c10d::")}
    assert ops == expected_ops, ops
    assert stats.calls == {"gather_v": 2, "reduce_v": 2}
    assert stats.payload_bytes["gather_v"] == 2 * total * 4
    assert stats.sent_bytes["gather_v"] == 2 * sizes[rank] * (world_size - 1) * 4


def _gather_and_reduce(rank, world_size, sizes, group, stats, offsets, expected):
    total = sum(sizes)
    for async_op in (False, True):
        seg = expected[offsets[rank]:offsets[rank] + sizes[rank]].clone()
        out = torch.full((total,), -1.0)
        gather_v(seg, out, sizes, group, stats, async_op=async_op).wait()
        assert torch.equal(out, expected)
        full = expected * (rank + 1)  # rank r contributes (r + 1) * x
        mine = torch.empty(sizes[rank])
        reduce_v(full.clone(), mine, sizes, group, stats, async_op=async_op).wait()
        mean_factor = sum(range(1, world_size + 1)) / world_size
        torch.testing.assert_close(mine, expected[offsets[rank]:offsets[rank] + sizes[rank]] * mean_factor)


def test_uneven_segments_three_ranks():
    """Uneven segments go through one all-to-all each way."""
    spawn(_worker, 3, [5, 0, 7], {"c10d::alltoall_base_"})


def test_even_segments_use_the_even_collectives():
    """Even segments use all-gather and reduce-scatter, no all-to-all."""
    spawn(_worker, 2, [4, 4], {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_"})


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
    # one gather per layer in forward and backward, one reduce per layer, none for the root
    assert dict(mf.comm_stats(model).calls) == {"gather_v": 4, "reduce_v": 2}


def test_unit_without_parameters_issues_no_collective():
    spawn(_empty_root_worker, 2)
