"""The exact gather of torch's ``full_state_dict`` (``RowShard.redistribute``,
``matrixfsdp.tensors.gather.gather_rows``) on each of its paths: a tensor whole on one rank
(a broadcast), torch's even split (one all-gather landing in place), pieces anywhere
(replicas' copies, uneven stacks: one all-gather of headed pieces), a 0-d and an empty
tensor; a missing row and ranks at different tensors raise the same error on every rank
before anything is used. Before any data moves the ranks exchange one all-reduce of ten
integers, whatever their number: as rank 16383 of 16384 no call is handed a list of tensors
(before: an all-gather of a descriptor from each of the P ranks, for every tensor)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.rank_pool import spawn

from matrixfsdp.tensors.gather import gather_rows

FULL = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3) / 7

# rank -> rows [a, b) of FULL it holds, per layout (3 ranks)
LAYOUTS = {
    "whole on rank 1": [(0, 0), (0, 7), (0, 0)],
    "even split": [(0, 3), (3, 6), (6, 7)],
    "uneven": [(0, 3), (0, 0), (3, 7)],
    "replicas": [(0, 4), (0, 4), (4, 7)],
}


def _piece(full: torch.Tensor, rows: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    a, b = rows
    return full[a:b].clone(), (a if b > a else 0, *[0] * (full.dim() - 1))


def _paths(rank: int, world: int) -> None:
    group = dist.group.WORLD
    for name, layout in LAYOUTS.items():
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            full = (FULL * 7).to(dtype)
            local, offsets = _piece(full, layout[rank])
            got = gather_rows(local, tuple(full.shape), offsets, f"t.{name}", group)
            assert torch.equal(got, full), (name, dtype, got)
    scalar = torch.tensor(3.5)
    got = gather_rows(scalar if rank == 2 else torch.empty(0), (), (), "step", group)
    assert got.shape == () and got.item() == 3.5
    got = gather_rows(torch.empty(0, 3), (0, 3), (0, 0), "empty", group)
    assert got.shape == (0, 3)
    # row 2 held by no rank: every rank raises, naming the first missing row
    local, offsets = _piece(FULL, [(0, 2), (0, 0), (3, 7)][rank])
    with pytest.raises(RuntimeError, match=r"gathering 'gap' for torch's full_state_dict, no rank "
                                           r"holds rows 2: of 7"):
        gather_rows(local, (7, 3), offsets, "gap", group)
    # rank 1 at another tensor: every rank raises before any data moves, naming the others
    local, offsets = _piece(FULL, LAYOUTS["even split"][rank])
    with pytest.raises(RuntimeError, match=r"ranks \[(1|0, 2)\] were at another tensor"):
        gather_rows(local, (7, 3), offsets, "b" if rank == 1 else "a", group)
    got = gather_rows(local, (7, 3), offsets, "after", group)  # the ranks are still in step
    assert torch.equal(got, FULL)


def test_every_path_gathers_exactly_and_refuses_alike():
    spawn(_paths, 3)


def _as_rank_of_16384(rank: int, world: int) -> None:
    from matrixfsdp import testing
    P = 16384
    testing.register("hollow")
    dist.init_process_group("hollow", store=dist.HashStore(), rank=P - 1, world_size=P)
    try:
        group = dist.group.WORLD
        cases = {  # this rank's piece of: a matrix it owns, its even share, a 0-d step
            "matrix": (torch.randn(64, 64), (64, 64), (0, 0)),
            "even rows": (torch.randn(2, 64), (2 * P, 64), (2 * (P - 1), 0)),
            "step": (torch.tensor(1.0), (), ())}
        for name, (local, shape, offsets) in cases.items():
            testing.COUNTS.reset()
            gather_rows(local, shape, offsets, name, group)
            stats = testing.COUNTS
            assert stats.longest_list == 1, (name, stats)  # before: P descriptors
            assert stats.ops["all_reduce"] == 1 and stats.total_ops == 2, (name, stats)
            assert stats.gather_input_bytes <= local.numel() * local.element_size(), (name, stats)
    finally:
        dist.destroy_process_group()


def test_as_rank_16383_of_16384_no_call_is_handed_a_list():
    spawn(_as_rank_of_16384, 1, init=False)
