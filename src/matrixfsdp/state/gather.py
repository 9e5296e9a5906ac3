"""The full tensor of a :class:`~matrixfsdp.state.dcp.RowShard`, gathered exactly.

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
"""

from __future__ import annotations

import math
import zlib

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


def _check(descs: list[list[int]], mine: list[int], fqn: str, rows: int) -> None:
    differ = [r for r, d in enumerate(descs) if (d[0], d[3], d[4]) != (mine[0], mine[3], mine[4])]
    if differ:
        raise RuntimeError(
            f"matrixfsdp: gathering '{fqn}' for torch's full_state_dict, ranks {differ} were at "
            "another tensor: the ranks' state dicts hold different entries (an optimizer with state "
            "on some ranks only, e.g. a parameter never stepped, or one built on "
            "matrixfsdp.matrix_params). Nothing was gathered. Save the sharded state with "
            "matrixfsdp.get_state_dict and torch.distributed.checkpoint instead")
    covered = 0
    for start, held in sorted((d[1], d[2]) for d in descs if d[2]):
        if start > covered:
            break
        covered = max(covered, start + held)
    if covered < rows:
        raise RuntimeError(
            f"matrixfsdp: gathering '{fqn}' for torch's full_state_dict, no rank holds rows "
            f"{covered}: of {rows} (a state that exists on no rank, such as the optimizer state "
            "of a parameter that was never stepped)")


@torch.no_grad()
def gather_rows(local: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...], fqn: str,
                group: dist.ProcessGroup, seq: tuple[int, int] | None = None) -> torch.Tensor:
    """The full tensor of shape ``shape`` whose rows ``offsets[0]:`` each rank of ``group``
    holds as ``local`` (module docstring). A collective of ``group``."""
    world = dist.get_world_size(group)
    mine = _descriptor(local, shape, offsets, fqn, seq)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    descs = [d.tolist() for d in gathered]
    rows = shape[0] if shape else 1
    _check(descs, mine.tolist(), fqn, rows if math.prod(shape) else 0)
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    if not math.prod(shape):
        return full
    whole = next((r for r, d in enumerate(descs) if d[1] == 0 and d[2] == rows), None)
    if whole is not None:
        if dist.get_rank(group) == whole:
            full.copy_(local)
        dist.broadcast(full, src=dist.get_global_rank(group, whole), group=group)
        return full
    longest = max(d[2] for d in descs)
    padded = torch.zeros((longest, *shape[1:]), dtype=local.dtype, device=local.device)
    padded[:len(local)] = local
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=group)
    for (_, start, held, _, _), piece in zip(descs, pieces):
        full[start:start + held] = piece[:held]
    return full
