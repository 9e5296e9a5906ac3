"""The full tensor of a :class:`~matrixfsdp.tensors.row_shard.RowShard`, gathered exactly.

torch's state-dict helpers gather a distributed tensor for ``full_state_dict=True`` by
``value.redistribute(placements=[Replicate()] * ndim).to_local()``
(``torch.distributed._state_dict_utils._gather_state_dict``); a ``RowShard`` answers that
call with :func:`gather_rows`. Every rank calls it for the same tensors in the same order
(torch walks each rank's state dict in order), and every rank gets every element, copied
bit for bit from the rank holding it (a gather moves data, it adds nothing up):

1. one all-reduce (MAX) of ten integers, whatever the number of ranks: each rank's tensor
   (a checksum of its name, shape and dtype and, for optimizer state, its position among
   the state dict's ``RowShard`` s and their count) as the largest and the smallest over
   the ranks, the rows the ranks hold together (the smallest first row, the largest end),
   the rank holding the most rows, and whether every rank holds the rows of torch's even
   ``Shard(0)`` split (MatrixFSDP's even parameters and their AdamW moments). Where the
   ranks are at different tensors (their state dicts differ: an optimizer state one rank
   lacks), every rank raises the same error here, before any data moves; only then are the
   ranks' checksums gathered, to name the ranks that differ. Before, this step all-gathered
   a descriptor of every rank: P x 40 bytes to every rank and a Python loop over P, for
   every tensor;
2. the data: a broadcast from the rank holding the tensor whole (a Muon matrix on its
   owner, a 0-d ``step``); else, for the even split, one all-gather of equal pieces that is
   the full tensor as it lands; else one all-gather of every rank's rows padded to the
   longest piece, each behind a 16-byte header saying where its rows go (HSDP's replicas,
   expert stacks), placed by one indexed copy. Where no rank holds some rows, every rank
   raises the same error.

Under tensor or expert parallelism both steps run per group, one group after the other:
the data-parallel ranks first (together they hold a range of rows: a tp rank's ``Shard(0)``
rows, or a tp-split matrix whole where its owner sits), then the tp or ep group, whose ranks
hold the other ranges, as DTensor gathers a 2-D placement dim by dim. A tp rank's column
slice of a matrix its tp group owns is gathered over the data-parallel ranks as rows of its
columns, then the tp group's slices side by side (one all-gather of equal slices).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .._compat import all_gather_single
from ..diagnosis.agree import all_gather_object

_NONE = -(2 ** 62)  # "holds no rows" in a maximum
_HEADER = 16  # a piece's first row and row count (int64 each), ahead of its bytes


def _key(local: torch.Tensor, shape: tuple[int, ...], fqn: str) -> int:
    return zlib.crc32(f"{fqn}|{tuple(shape)}|{local.dtype}".encode())


def _differ(mine: tuple[int, int, int], fqn: str, group: dist.ProcessGroup) -> RuntimeError:
    """The ranks at another tensor than this one (the failure path: each rank's checksum
    gathered, to name them)."""
    differ = [r for r, d in enumerate(all_gather_object(mine, group)) if tuple(d) != mine]
    return RuntimeError(
        f"matrixfsdp: gathering '{fqn}' for torch's full_state_dict, ranks {differ} were at "
        "another tensor: the ranks' state dicts hold different entries (an optimizer with state "
        "on some ranks only, e.g. a parameter never stepped, or one built on "
        "matrixfsdp.matrix_params). Nothing was gathered. Save the sharded state with "
        "matrixfsdp.get_state_dict and torch.distributed.checkpoint instead")


def _missing(fqn: str, row: int, rows: int) -> RuntimeError:
    return RuntimeError(
        f"matrixfsdp: gathering '{fqn}' for torch's full_state_dict, no rank holds rows "
        f"{row}: of {rows} (a state that exists on no rank, such as the optimizer state "
        "of a parameter that was never stepped)")


def _even(rows: int, world: int, rank: int) -> tuple[int, int]:
    """torch's ``Shard(0)`` (and MatrixFSDP's even parameters): ``ceil(rows / world)`` rows
    a rank, the last ones short or empty. ``(first row, rows)`` of ``rank``."""
    chunk = -(-rows // world)
    return rank * chunk, max(0, min(rows, (rank + 1) * chunk) - rank * chunk)


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
    if len(shape) == 2 and local.dim() == 2 and local.shape[1] != shape[1]:
        # a tp rank's column slice of a matrix its tp group owns: its rows over the
        # data-parallel group(s), then the slices side by side over the tp group (the last)
        *rows, columns = groups
        part = gather_rows(local, (shape[0], local.shape[1]), (offsets[0], 0), fqn, rows, seq)
        every = part.new_empty((dist.get_world_size(columns), *part.shape))
        all_gather_single(every, part.contiguous(), group=columns)
        return every.permute(1, 0, 2).reshape(shape)
    for k, group in enumerate(groups):
        local, offsets = _gather_stage(local, shape, offsets, fqn, group, seq, k == len(groups) - 1)
    return local


def _gather_stage(local: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...], fqn: str,
                  group: dist.ProcessGroup, seq: tuple[int, int] | None,
                  complete: bool) -> tuple[torch.Tensor, tuple[int, ...]]:
    """One group's gather: the rows its ranks hold together (``complete``: the whole tensor),
    as a tensor and its offsets."""
    rows = shape[0] if shape else 1
    world, me = dist.get_world_size(group), dist.get_rank(group)
    held = (local.shape[0] if local.dim() else 1) if local.numel() else 0
    start = offsets[0] if offsets and held else 0
    mine = (_key(local, shape, fqn), *(seq if seq is not None else (-1, -1)))
    first, count = _even(rows, world, me) if complete and shape else (0, -1)
    even = held == count and (not held or start == first)
    # MAX of x and of -x: the largest and the smallest over the ranks, in one all-reduce
    v = [mine[0], -mine[0], mine[1], -mine[1], mine[2], -mine[2],
         -start if held else _NONE, start + held if held else _NONE,
         held * world + me if held else -1, 0 if even else 1]
    t = torch.tensor(v, dtype=torch.int64, device=local.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    got = t.tolist()
    if any(got[i] != -got[i + 1] for i in (0, 2, 4)):
        raise _differ(mine, fqn, group)
    lo, hi = (-got[6], got[7]) if got[7] != _NONE else (0, 0)
    longest, root = divmod(got[8], world) if got[8] >= 0 else (0, -1)
    numel = math.prod(shape)
    if got[9] == 0 and numel and longest < rows:  # torch's even split on every rank: rows 0: all
        return _gather_even(local, shape, held, group), (0, *[0] * (len(shape) - 1))
    if complete and numel and (lo > 0 or hi < rows):
        raise _missing(fqn, 0 if lo > 0 else hi, rows)
    out_shape = shape if complete or not shape else (hi - lo, *shape[1:])
    if not shape and hi == lo:  # a 0-d tensor no rank of this group holds
        out_shape = (0,)
    at = (lo, *[0] * (len(shape) - 1)) if shape else ()
    if not numel or hi == lo:
        return torch.empty(out_shape, dtype=local.dtype, device=local.device), at
    if longest == hi - lo:  # one rank holds all of it: a broadcast from there
        full = torch.empty(out_shape, dtype=local.dtype, device=local.device)
        if me == root:
            full.copy_(local)
        dist.broadcast(full, src=dist.get_global_rank(group, root), group=group)
        return full, at
    return _gather_headed(local, shape, start, held, longest, lo, hi, out_shape, fqn, group), at


def _gather_even(local: torch.Tensor, shape: tuple[int, ...], held: int,
                 group: dist.ProcessGroup) -> torch.Tensor:
    """torch's even split, every rank ``ceil(rows / P)`` rows (the last short or empty): one
    all-gather of equal pieces, which is the full tensor as it lands (its padding cut off)."""
    chunk = -(-shape[0] // dist.get_world_size(group))
    piece = torch.zeros((chunk, *shape[1:]), dtype=local.dtype, device=local.device)
    piece[:held] = local
    full = torch.empty((chunk * dist.get_world_size(group), *shape[1:]), dtype=local.dtype,
                       device=local.device)
    all_gather_single(full, piece, group=group)
    return full[:shape[0]]


def _gather_headed(local: torch.Tensor, shape: tuple[int, ...], start: int, held: int,
                   longest: int, lo: int, hi: int, out_shape: tuple[int, ...], fqn: str,
                   group: dist.ProcessGroup) -> torch.Tensor:
    """Rows ``[lo, hi)`` from pieces anywhere: each rank's rows padded to ``longest``, behind
    a header (first row, rows), all-gathered as bytes; placed by one indexed copy (replicas'
    equal copies land on the same rows); a row no rank holds raises on every rank alike."""
    world, dev = dist.get_world_size(group), local.device
    row = math.prod(shape[1:]) * local.element_size()
    mine = torch.zeros(_HEADER + longest * row, dtype=torch.uint8, device=dev)
    mine[:_HEADER] = torch.tensor([start, held], dtype=torch.int64, device=dev).view(torch.uint8)
    if held:
        mine[_HEADER:_HEADER + held * row] = local.contiguous().reshape(-1).view(torch.uint8)
    every = torch.empty(world * mine.numel(), dtype=torch.uint8, device=dev)
    all_gather_single(every, mine, group=group)
    every = every.view(world, mine.numel())
    heads = every[:, :_HEADER].contiguous().view(torch.int64)  # (world, 2): first row, rows
    data = every[:, _HEADER:].contiguous().view(local.dtype).view(world, longest, *shape[1:])
    j = torch.arange(longest, device=dev)
    valid = j[None, :] < heads[:, 1:2]
    dest = (heads[:, 0:1] + j[None, :])[valid] - lo
    covered = torch.zeros(hi - lo, dtype=torch.bool, device=dev)
    covered[dest] = True
    if not bool(covered.all()):
        raise _missing(fqn, lo + int(torch.nonzero(~covered)[0]), shape[0])
    full = torch.empty(out_shape, dtype=local.dtype, device=dev)
    full.index_copy_(0, dest, data[valid])
    return full
