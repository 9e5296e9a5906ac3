"""gather_v / reduce_v over uneven segments (an empty one included), sync and async."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _dist import spawn

from matrixfsdp.comm import CommStats, gather_v, reduce_v


def _worker(rank, world_size, sizes):
    group = dist.group.WORLD
    stats = CommStats()
    total = sum(sizes)
    offsets = [sum(sizes[:r]) for r in range(world_size)]
    expected = torch.arange(total, dtype=torch.float32)
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
    assert stats.calls == {"gather_v": 2, "reduce_v": 2}
    assert stats.payload_bytes["gather_v"] == 2 * total * 4
    assert stats.sent_bytes["gather_v"] == 2 * sizes[rank] * (world_size - 1) * 4


def test_uneven_segments_three_ranks():
    spawn(_worker, 3, [5, 0, 7])


def test_even_segments_use_the_even_collectives():
    spawn(_worker, 2, [4, 4])
