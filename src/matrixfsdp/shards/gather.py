"""The full tensor of a :class:`~matrixfsdp.shards.row_shard.RowShard`, gathered exactly.

torch's state-dict helpers gather a distributed tensor for ``full_state_dict=True`` by
``value.redistribute(placements=[Replicate()] * ndim).to_local()``
(``torch.distributed._state_dict_utils._gather_state_dict``); a ``RowShard`` answers that
call with :func:`gather_rows`. Every rank calls it for the same tensors in the same order
(torch walks each rank's state dict in order), and every rank gets every element, copied
bit for bit from the rank holding it (a gather moves data, it adds nothing up):

1. a descriptor per rank, all-gathered: which tensor (a checksum of its name and shape and,
   for optimizer state, its position among the state dict's ``RowShard`` s and their count)
   and which rows this rank holds. Where two ranks disagree on which tensor this is (their
   state dicts differ: an optimizer state one rank lacks), every rank raises the same
   error here, before any data moves; where no rank holds some rows, likewise;
2. the data: a broadcast from the first rank holding the tensor whole (a Muon matrix on its
   owner, a 0-d ``step``), else one all-gather of every rank's rows padded to the longest
   piece, each piece then copied to its rows (HSDP's replicas hold equal copies).

Under tensor or expert parallelism both steps run per group, one group after the other:
the data-parallel ranks first (together they hold a range of rows: a tp rank's ``Shard(0)``
rows, or a tp-split matrix whole where its owner sits), then the tp or ep group, whose ranks
hold the other ranges, as DTensor gathers a 2-D placement dim by dim.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist


def _descriptor(local: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...], fqn: str,
                seq: tuple[int, int] | None) -> torch.Tensor:
    """``[checksum, first row, rows held, position, count]`` of this rank's piece (a 0-d
    tensor is one row)."""
    held = (local.shape[0] if local.dim() else 1) if local.numel() else 0
    start = offsets[0] if offsets and held else 0
    key = zlib.crc32(f"{fqn}|{tuple(shape)}|{local.dtype}".encode())
    pos, count = seq if seq is not None else (-1, -1)
    return torch.tensor([key, start, held, pos, count], dtype=torch.int64, device=local.device)


def _check(descs: list[list[int]], mine: list[int], fqn: str, rows: int,
           complete: bool) -> tuple[int, int]:
    """The rows ``[lo, hi)`` the ranks hold together; raise where they are at different
    tensors, where rows are missing in between, or (``complete``) where any row is missing."""
    differ = [r for r, d in enumerate(descs) if (d[0], d[3], d[4]) != (mine[0], mine[3], mine[4])]
    if differ:
        raise RuntimeError(
            f"matrixfsdp: gathering '{fqn}' for torch's full_state_dict, ranks {differ} were at "
            "another tensor: the ranks' state dicts hold different entries (an optimizer with state "
            "on some ranks only, e.g. a parameter never stepped, or one built on "
            "matrixfsdp.matrix_params). Nothing was gathered. Save the sharded state with "
            "matrixfsdp.get_state_dict and torch.distributed.checkpoint instead")
    pieces = sorted((d[1], d[2]) for d in descs if d[2])
    lo = pieces[0][0] if pieces and not complete else 0
    covered = lo
    for start, held in pieces:
        if start > covered:
            break
        covered = max(covered, start + held)
    if (complete and covered < rows) or (pieces and covered < max(a + n for a, n in pieces)):
        raise RuntimeError(
            f"matrixfsdp: gathering '{fqn}' for torch's full_state_dict, no rank holds rows "
            f"{covered}: of {rows} (a state that exists on no rank, such as the optimizer state "
            "of a parameter that was never stepped)")
    return lo, covered


@torch.no_grad()
def gather_rows(local: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...], fqn: str,
                groups: dist.ProcessGroup | Sequence[dist.ProcessGroup],
                seq: tuple[int, int] | None = None) -> torch.Tensor:
    """The full tensor of shape ``shape`` whose rows ``offsets[0]:`` each rank holds as
    ``local`` (module docstring), gathered over ``groups`` one after the other: the ranks
    of each group hold together a range of rows, those of the last one every row (tensor
    and expert parallelism: the data-parallel group, then the tp or ep group, as DTensor
    gathers a 2-D placement dim by dim). A collective of every group, in order."""
    groups = [groups] if isinstance(groups, dist.ProcessGroup) else list(groups)
    for k, group in enumerate(groups):
        local, offsets = _gather_stage(local, shape, offsets, fqn, group, seq, k == len(groups) - 1)
    return local


def _gather_stage(local: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...], fqn: str,
                  group: dist.ProcessGroup, seq: tuple[int, int] | None,
                  complete: bool) -> tuple[torch.Tensor, tuple[int, ...]]:
    """One group's gather: the rows its ranks hold together (``complete``: the whole tensor),
    as a tensor and its offsets."""
    rows = shape[0] if shape else 1
    world = dist.get_world_size(group)
    mine = _descriptor(local, shape, offsets, fqn, seq)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    descs = [d.tolist() for d in gathered]
    lo, hi = _check(descs, mine.tolist(), fqn, rows if math.prod(shape) else 0, complete)
    out_shape = shape if complete or not shape else (hi - lo, *shape[1:])
    if not shape and hi == lo:  # a 0-d tensor no rank of this group holds
        out_shape = (0,)
    full = torch.empty(out_shape, dtype=local.dtype, device=local.device)
    at = (lo, *[0] * (len(shape) - 1)) if shape else ()
    if not math.prod(shape) or hi == lo:
        return full, at
    whole = next((r for r, d in enumerate(descs) if d[1] == lo and d[2] == hi - lo), None)
    if whole is not None:
        if dist.get_rank(group) == whole:
            full.copy_(local)
        dist.broadcast(full, src=dist.get_global_rank(group, whole), group=group)
        return full, at
    longest = max(d[2] for d in descs)
    padded = torch.zeros((longest, *shape[1:]), dtype=local.dtype, device=local.device)
    padded[:len(local)] = local
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=group)
    for (_, start, held, _, _), piece in zip(descs, pieces):
        full[start - lo:start - lo + held] = piece[:held]
    return full, at
