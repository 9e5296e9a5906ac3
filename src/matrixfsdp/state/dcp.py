"""The values ``matrixfsdp.get_state_dict`` hands to ``torch.distributed.checkpoint``.

A :class:`RowShard` is this rank's piece of a tensor that lives spread over the ranks: a
local tensor, the full (global) shape and where the piece starts in it. Every MatrixFSDP
placement is a range of dim-0 rows (a whole Muon matrix is rows ``[0, m)`` on its owner and
rows ``[0, 0)`` elsewhere; an expert stack is a range of whole experts; an even parameter a
row slice), so the offsets are ``(start, 0, ..., 0)``.

DCP recognises such objects by three methods, the ones ``DTensor`` implements
(``torch/distributed/tensor/_api.py``, read by ``planner_helpers._create_write_items``,
``_create_chunk_list`` and ``utils.find_state_dict_object``):

* ``__create_write_items__``: one ``SHARD`` write item for the rows this rank holds, none
  where it holds none (an empty chunk would be one more chunk in the metadata, and a non-owner
  of a matrix has nothing to write). So every element is written exactly once: a matrix by
  its owner, a row shard by the rank that holds it, and the default planner's check that
  the chunks tile the tensor (``_validate_global_plan``) passes. A tensor with no element at
  all is written as one empty chunk at offset 0 by every rank (deduplicated to one) so that
  its name and shape are in the checkpoint;
* ``__create_chunk_list__``: the same chunk on load. DCP then reads, from whatever chunks
  the checkpoint holds (saved at any world size), the pieces that overlap it;
* ``__get_tensor_shard__``: the local tensor, which DCP reads from on save and copies into
  on load (in place: the values ``get_state_dict`` returns view the parameters and the
  optimizer state themselves).

It is a tensor subclass only because DCP's lookups (``find_state_dict_object``) go to
``__get_tensor_shard__`` for tensors alone; it supports no tensor operation (it is not a
full tensor on any rank). Use ``.local`` for this rank's piece, ``matrixfsdp.set_state_dict``
to load it, ``matrixfsdp.full_state_dict`` for full tensors. Pickling it is refused:
``torch.save`` would store one rank's rows under the full name.

For ``dcp.async_save`` a state must first be *staged*: copied, so that training can change
the live tensors while a background thread writes. torch's default stager copies tensors
through tensor operations (``new_empty``, storages), which a ``RowShard`` refuses, so
:class:`RowShardStager` (used by ``matrixfsdp.save_checkpoint(..., async_save=True)``)
stages it: each ``RowShard`` becomes a ``RowShard`` of a CPU copy of ``.local`` with the same
shape and offsets, every other tensor a CPU copy, every other value a deep copy.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager

from ..planning.types import Placement
from ..runtime.param import sharded_param
from ..runtime.tp import global_ok


def check_global(p: torch.Tensor) -> None:
    """Refuse a shard whose place in the whole tensor is not a range of rows: a tensor-
    parallel ``Shard(1)`` parameter that is not a Muon matrix (a ColwiseParallel embedding,
    or a RowwiseParallel weight left to AdamW)."""
    info = sharded_param(p)
    if info is not None and not global_ok(info.placement, info.tp):
        raise NotImplementedError(
            f"matrixfsdp: parameter '{info.name}' is split over tp along dim 1 "
            f"({info.tp.placements}) and sharded by rows over the data-parallel ranks: its pieces "
            "are no row ranges of the whole tensor, which this library's state dicts hold. "
            "Make it a Muon matrix (muon_filter), or shard that module with Shard(0) "
            "(RowwiseParallel for an embedding, as torchtitan does)")


class RowShard(torch.Tensor):
    """Rows ``[offsets[0], offsets[0] + local.shape[0])`` of a tensor of shape ``self.shape``.

    ``local`` has the full shape's trailing dims (``(rows held, *shape[1:])``); a 0-d tensor
    is held whole by one rank (``local`` 0-d, ``offsets == ()``) and as an empty ``(0,)``
    elsewhere. ``fqn`` (the parameter name) is for messages only.
    """

    local: torch.Tensor
    offsets: tuple[int, ...]
    fqn: str

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...],
                name: str = "") -> RowShard:
        shape, offsets = tuple(shape), tuple(offsets)
        if len(offsets) != len(shape):
            raise ValueError(f"RowShard '{name}': offsets {offsets} for shape {shape}")
        if local.numel() and (local.dim() != len(shape) or tuple(local.shape[1:]) != shape[1:]
                              or (shape and offsets[0] + local.shape[0] > shape[0])):
            raise ValueError(f"RowShard '{name}': local {tuple(local.shape)} at {offsets} does "
                             f"not fit in {shape}")
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device,
                                                requires_grad=False)
        r.local, r.offsets, r.fqn = local, offsets, name
        return r

    @classmethod
    def of(cls, local: torch.Tensor, placement: Placement, rank: int) -> RowShard:
        """This rank's ``local`` tensor (a parameter shard or optimizer state of the same
        shape) placed as ``placement`` says."""
        spec = placement.spec
        start = placement.row_ranges[rank][0]
        offsets = (start, *[0] * (len(spec.shape) - 1)) if spec.shape else ()
        return cls(local.detach(), spec.shape, offsets, spec.name)

    # ---- what DCP calls -----------------------------------------------------------------
    def _chunk(self) -> ChunkStorageMetadata | None:
        if self.local.numel():
            return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.local.shape)
        if math.prod(self.shape) == 0:  # nothing anywhere: one empty chunk, so the name is kept
            return ChunkStorageMetadata(offsets=torch.Size([0] * self.dim()), sizes=self.shape)
        return None  # this rank holds none of it

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        chunk = self._chunk()
        if chunk is None:
            return []
        props = TensorProperties.create_from_tensor(self.local)
        props.pin_memory = False  # the tensor's, not a (pinned) staging copy's
        return [WriteItem(
            index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=chunk, properties=props, size=self.shape))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        chunk = self._chunk()
        return [] if chunk is None else [chunk]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        chunk = self._chunk()
        if chunk is None or (index.offset is not None and index.offset != chunk.offsets):
            raise ValueError(f"RowShard '{index.fqn}': no piece at {index.offset} on this rank "
                             f"(it holds {None if chunk is None else tuple(chunk.offsets)})")
        if not self.local.numel() and chunk.sizes != self.local.shape:
            return self.local.new_empty(chunk.sizes)
        return self.local

    # ---- everything else ------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            self = args[0]
            return RowShard(self.local.detach(), tuple(self.shape), self.offsets, self.fqn)
        shards = [a for a in args if isinstance(a, RowShard)]
        name = shards[0].fqn if shards else ""
        raise NotImplementedError(
            f"matrixfsdp.RowShard '{name}' is one rank's rows of a sharded tensor, not a full "
            f"tensor: {func} is not supported. Use .local for this rank's rows, "
            "matrixfsdp.set_state_dict to load a state, matrixfsdp.full_state_dict for full tensors")

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"matrixfsdp.RowShard '{self.fqn}' holds one rank's rows; pickling it (torch.save) "
            "would store them under the full name. Save with torch.distributed.checkpoint "
            "(dcp.save), or save matrixfsdp.full_state_dict(model) for a plain file")

    def __repr__(self, *, tensor_contents=None) -> str:
        start = self.offsets[0] if self.offsets else 0
        stop = start + (self.local.shape[0] if self.local.dim() else self.local.numel())
        return (f"RowShard({self.fqn!r}, shape={tuple(self.shape)}, rows {start}:{stop}, "
                f"{self.dtype}, {self.device})")


# ---- staging for dcp.async_save ---------------------------------------------------------------
def _cpu_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A CPU copy of ``t``. From an accelerator: into pinned memory, non-blocking (the caller
    synchronizes once for all copies)."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    out.copy_(t, non_blocking=pin)
    return out


def stage_state(state: Any) -> Any:
    """A copy of ``state`` (nested dicts, lists and tuples of :class:`RowShard` s, tensors and
    plain values) that no later change to the live tensors can reach, in CPU memory.

    A ``RowShard`` becomes a ``RowShard`` of a CPU copy of ``.local`` with the same shape and
    offsets (so DCP plans and writes exactly the chunks the live one would), a tensor a CPU
    copy, any other value a ``copy.deepcopy``. An object met twice (a tied parameter under
    two names) is copied once. From an accelerator, ``RowShard`` rows go to pinned memory
    and the copies are awaited before this returns. The memory cost is one CPU copy of this
    rank's rows (parameters and optimizer state): each element once over all ranks.
    """
    memo: dict[int, Any] = {}
    devices: set[torch.device] = set()

    def stage(obj: Any) -> Any:
        if id(obj) in memo:
            return memo[id(obj)]
        if isinstance(obj, RowShard):
            pin = obj.local.device.type != "cpu" and torch.accelerator.is_available()
            if pin:
                devices.add(obj.local.device)
            out: Any = RowShard(_cpu_copy(obj.local, pin), tuple(obj.shape), obj.offsets, obj.fqn)
        elif isinstance(obj, torch.Tensor):
            out = _cpu_copy(obj, False)
        elif isinstance(obj, dict):
            out = {k: stage(v) for k, v in obj.items()}
        elif isinstance(obj, list):
            out = [stage(v) for v in obj]
        elif type(obj) is tuple:
            out = tuple(stage(v) for v in obj)
        else:
            out = copy.deepcopy(obj)
        memo[id(obj)] = out
        return out

    staged = stage(state)
    for device in devices:  # the non-blocking copies into pinned memory have landed
        torch.accelerator.synchronize(device)
    return staged


class RowShardStager(AsyncStager):
    """The stager ``dcp.async_save`` gets from ``matrixfsdp.save_checkpoint``: stages with
    :func:`stage_state`, in the calling thread, before ``async_save`` returns (so the
    checkpoint holds the values at the time of the call, whatever training does next).
    Nothing to synchronize or close afterwards."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return stage_state(state_dict)

    def synchronize_staging(self) -> None:  # staging is done when stage returns
        pass

    def close(self) -> None:
        pass
