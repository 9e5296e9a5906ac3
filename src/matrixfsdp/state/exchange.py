"""The few collectives a checkpoint load runs besides the reads, each O(1) on every rank but
the coordinator: it gathers the ranks' requests and scatters back each rank's plan, the ranks
agree on one verdict with a MIN all-reduce (the details from the failing rank only), and
what every rank loads alike goes out from the coordinator in one broadcast.

On the group's own device (NCCL: the current GPU, as the library's other object
collectives), without numpy. Without a process group (one process, a launcher reading a
checkpoint alone) each is the identity. The coordinator is rank 0 of the group.
"""

from __future__ import annotations

import ctypes
import pickle
import struct

import torch
import torch.distributed as dist

from ..diagnosis.agree import broadcast_object, object_device

_HEAD = 8  # each pickled object is sent as its length (int64, little-endian), then its bytes


def _on(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _encode(obj: object, length: int | None = None) -> bytearray:
    data = pickle.dumps(obj)
    out = bytearray(struct.pack("<q", len(data)) + data)
    if length is not None:
        out.extend(bytes(length - len(out)))
    return out


def _tensor(buf: bytearray, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=torch.uint8).to(device) if buf else \
        torch.empty(0, dtype=torch.uint8, device=device)


def _decode(t: torch.Tensor) -> object:
    t = t.cpu().contiguous()
    n = struct.unpack("<q", ctypes.string_at(t.data_ptr(), _HEAD))[0]
    return pickle.loads(ctypes.string_at(t.data_ptr() + _HEAD, n))


def gather_to_coordinator(obj: object, group=None) -> list | None:
    """Every rank's ``obj`` on rank 0 of ``group`` (in rank order; None on the others): one
    all-reduce of the longest length, then one gather, each rank sending its own bytes."""
    if not _on(group):
        return [obj]
    device, rank, world = object_device(group), dist.get_rank(group), dist.get_world_size(group)
    mine = _encode(obj)
    longest = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    mine.extend(bytes(int(longest) - len(mine)))
    out = torch.empty((world, int(longest)), dtype=torch.uint8, device=device) if rank == 0 else None
    dist.gather(_tensor(mine, device), list(out.unbind(0)) if out is not None else None,
                dst=dist.get_global_rank(group, 0), group=group)
    return [_decode(row) for row in out.unbind(0)] if out is not None else None


def scatter_from_coordinator(objs: list | None, group=None) -> object:
    """Rank r of ``group`` gets ``objs[r]`` from rank 0 (``objs`` there, None elsewhere): one
    broadcast of the longest length, then one scatter."""
    if not _on(group):
        return objs[0]
    device, rank = object_device(group), dist.get_rank(group)
    longest = torch.zeros(1, dtype=torch.int64, device=device)
    parts = None
    if rank == 0:
        encoded = [_encode(o) for o in objs]
        longest[0] = max(len(b) for b in encoded)
    src = dist.get_global_rank(group, 0)
    dist.broadcast(longest, src=src, group=group)
    if rank == 0:
        parts = [_tensor(b + bytes(int(longest) - len(b)), device) for b in encoded]
    out = torch.empty(int(longest), dtype=torch.uint8, device=device)
    dist.scatter(out, parts, src=src, group=group)
    return _decode(out)


def broadcast_from_coordinator(obj: object, group=None) -> object:
    """Rank 0's ``obj`` on every rank of ``group`` (two broadcasts: the length, the bytes)."""
    if not _on(group):
        return obj
    device, rank = object_device(group), dist.get_rank(group)
    src = dist.get_global_rank(group, 0)
    data = _encode(obj) if rank == 0 else bytearray()
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(n, src=src, group=group)
    t = _tensor(data, device) if rank == 0 else torch.empty(int(n), dtype=torch.uint8, device=device)
    dist.broadcast(t, src=src, group=group)
    return obj if rank == 0 else _decode(t)


def maxima(values: list[int], group=None) -> list[int]:
    """The largest of each of ``values`` over the ranks of ``group`` (one all-reduce of a
    few integers; the smallest of ``x`` is minus the largest of ``-x``)."""
    if not _on(group):
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=object_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def from_rank(obj: object, rank: int, group=None) -> object:
    """Group rank ``rank``'s ``obj`` on every rank of ``group`` (the failure path's details)."""
    if not _on(group):
        return obj
    return broadcast_object(obj, dist.get_global_rank(group, rank), group)


def agree(problem: object | None, group=None) -> object | None:
    """The verdict of every rank of ``group``: None when no rank has a problem, else the
    problem (a message, an exception) of the lowest rank that has one, on every rank. One
    all-reduce of one integer; only when a rank failed, its problem is broadcast from it."""
    if not _on(group):
        return problem
    world = dist.get_world_size(group)
    first = world - maxima([world - dist.get_rank(group) if problem is not None else 0], group)[0]
    return None if first == world else from_rank(problem, first, group)
