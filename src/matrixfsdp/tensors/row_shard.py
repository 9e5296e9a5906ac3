"""The values MatrixFSDP's state dicts hand to ``torch.distributed.checkpoint`` and to
torch's state-dict helpers: ``model.state_dict()``, the optimizers' ``state_dict()``,
``torch.distributed.checkpoint.state_dict.get_state_dict`` and ``matrixfsdp.get_state_dict``.

A :class:`RowShard` is this rank's piece of a tensor that lives spread over the ranks: a
local tensor, the full (global) shape and where the piece starts in it. A MatrixFSDP
placement is a range of dim-0 rows (a whole Muon matrix is rows ``[0, m)`` on its owner and
rows ``[0, 0)`` elsewhere; an expert stack is a range of whole experts; an even parameter a
row slice), so the offsets are ``(start, 0, ..., 0)``; under tensor parallelism a tp rank's
slice of a matrix its tp group owns is its rows or its columns of the whole matrix
(``(0, first column)``).

DCP recognises such objects by three methods, the ones ``DTensor`` implements
(``torch/distributed/tensor/_api.py``, read by ``planner_helpers._create_write_items``,
``_create_chunk_list`` and ``utils.find_state_dict_object``):

* ``__create_write_items__``: one ``SHARD`` write item for the rows this rank holds, none
  where it holds none (an empty chunk would be one more chunk in the metadata, and a non-owner
  of a matrix has nothing to write). So every element is written exactly once: a matrix by
  its owner, a row shard by the rank that holds it, and the default planner's check that
  the chunks tile the tensor (``_validate_global_plan``) passes. A tensor with no element at
  all is written as one empty chunk at offset 0 by every rank (deduplicated to one) so that
  its name and shape are in the checkpoint; a 0-d tensor (an optimizer's ``step``) by every
  rank holding it, with equal values (deduplicated to one);
* ``__create_chunk_list__``: the same chunk on load. DCP then reads, from whatever chunks
  the checkpoint holds (saved at any world size), the pieces that overlap it;
* ``__get_tensor_shard__``: the local tensor, which DCP reads from on save and copies into
  on load (in place: the values view the parameters and the optimizer state themselves).

It is a ``DTensor`` subclass (on the parameter's ``fully_shard`` mesh) because torch's
state-dict code and DCP find distributed tensors by ``isinstance(value, DTensor)`` and reach
their data through ``_local_tensor`` (DCP's planners, its default async stager, the
``full_state_dict`` and ``cpu_offload`` options, torchtitan's checkpointer). No DTensor
placement says "rows ``a:b`` on this rank", so its placement is :class:`RowsPlacement`,
which DTensor does not compute with: what torch would place by it is answered here or
refused. ``redistribute`` to ``Replicate`` (``full_tensor()``, torch's ``full_state_dict``)
gathers the exact full tensor (:func:`~matrixfsdp.tensors.gather.gather_rows`); ``.to(...)``,
``detach`` and ``copy.deepcopy`` keep it a ``RowShard``; every other tensor operation
raises (it is not a full tensor on any rank), and so does ``to_local()``, which DTensor code
pairs with placement arithmetic. Use ``.local`` for this rank's piece. Pickling it is
refused: ``torch.save`` would store one rank's rows under the full name.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Placement as DTensorPlacement

from .._compat import ATEN_TO_COPY, DISABLED_TORCH_FUNCTION, dtensor_spec, local_tensor
from ..layout.types import Placement
from ..runtime.param import sharded_param
from ..runtime.tp import global_ok
from .gather import gather_rows


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


class RowsPlacement(DTensorPlacement):
    """A :class:`RowShard`'s DTensor placement: each rank holds a range of rows, which no
    DTensor placement describes. torch's ``distribute_tensor`` refuses it, naming it (torch's
    ``StateDictOptions(full_state_dict=True)`` / ``broadcast_from_rank0`` loading optimizer
    state from full tensors)."""

    def __init__(self, fqn: str = ""):
        super().__init__()
        self.fqn = fqn

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowsPlacement)

    def __hash__(self) -> int:
        return hash(RowsPlacement)

    def __deepcopy__(self, memo: dict) -> RowsPlacement:
        return RowsPlacement(self.fqn)

    def __repr__(self) -> str:
        return (f"matrixfsdp rows of '{self.fqn}' (no DTensor placement: load optimizer state "
                "from full tensors with matrixfsdp.set_state_dict)")


class _Ranks:
    """The process groups a :class:`RowShard` gathers over, one after the other (the
    data-parallel group; under tensor or expert parallelism then the tp or ep group), held
    so that copies of the ``RowShard`` (torch's stagers deep-copy its attributes) share them."""

    def __init__(self, group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...]):
        self.groups = group if isinstance(group, tuple) else (group,)

    def __deepcopy__(self, memo: dict) -> _Ranks:
        return self


_UNSUPPORTED = ("Use .local for this rank's rows, model.load_state_dict / torch's set_state_dict "
                "or matrixfsdp.set_state_dict to load a state, torch's full_state_dict option "
                "or matrixfsdp.full_state_dict for full tensors")


def box_offsets(placement: Placement, rank: int) -> tuple[int, ...]:
    """Where shard rank ``rank``'s piece of ``placement`` starts in the whole tensor: its
    first row, and (a tp rank's column slice of a matrix its tp group owns) its first column."""
    shape = placement.spec.shape
    if not shape:
        return ()
    start = placement.row_ranges[rank][0]
    if placement.cols is not None:
        return (start, placement.cols[0])
    return (start, *[0] * (len(shape) - 1))


class RowShard(DTensor):
    """The piece ``local`` at ``offsets`` of a tensor of shape ``self.shape``: rows
    ``[offsets[0], offsets[0] + local.shape[0])``, and (a tp rank's column slice of a matrix
    its tp group owns) columns from ``offsets[1]``.

    ``local`` has the full shape's trailing dims (``(rows held, *shape[1:])``) but for such a
    column slice; a 0-d tensor
    is held whole (``local`` 0-d, ``offsets == ()``) by the ranks holding it and as an empty
    ``(0,)`` elsewhere. ``fqn`` (the parameter name) is for messages. ``mesh``: the DTensor
    mesh (the parameter's ``fully_shard`` mesh; DCP needs it, a test may leave it out);
    ``group``: the ranks :meth:`redistribute` gathers over (every rank holding a piece);
    ``refusal``: why this one cannot be gathered, raised instead; ``seq``: (position, count)
    among the ``RowShard`` s of one optimizer state dict (see
    :func:`~matrixfsdp.tensors.gather.gather_rows`).
    """

    offsets: tuple[int, ...]
    fqn: str

    __torch_function__ = DISABLED_TORCH_FUNCTION

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...],
                name: str = "", *, mesh: DeviceMesh | None = None,
                group: dist.ProcessGroup | None = None, refusal: str | None = None,
                seq: tuple[int, int] | None = None) -> RowShard:
        shape, offsets = tuple(shape), tuple(offsets)
        if len(offsets) != len(shape):
            raise ValueError(f"RowShard '{name}': offsets {offsets} for shape {shape}")
        if local.numel() and (local.dim() != len(shape) or any(
                o + n > s for o, n, s in zip(offsets, local.shape, shape))):
            raise ValueError(f"RowShard '{name}': local {tuple(local.shape)} at {offsets} does "
                             f"not fit in {shape}")
        stride = torch.empty(shape, device="meta").stride()
        spec = dtensor_spec(mesh, (RowsPlacement(name),) * (mesh.ndim if mesh is not None else 1),
                            shape, stride, local.dtype)
        r = super().__new__(cls, local, spec, requires_grad=False)
        r.offsets, r.fqn, r.refusal, r.seq = offsets, name, refusal, seq
        r.ranks = group if isinstance(group, _Ranks) or group is None else _Ranks(group)
        return r

    def __init__(self, *args, **kwargs):  # everything is set in __new__
        pass

    @property
    def local(self) -> torch.Tensor:
        """This rank's rows (a view of the live tensor where the state dict made it)."""
        return local_tensor(self)

    @classmethod
    def of(cls, local: torch.Tensor, placement: Placement, rank: int, **kwargs: Any) -> RowShard:
        """This rank's ``local`` tensor (a parameter shard or optimizer state of the same
        shape) placed as ``placement`` says."""
        spec = placement.spec
        return cls(local.detach(), spec.shape, box_offsets(placement, rank), spec.name, **kwargs)

    @classmethod
    def of_param(cls, local: torch.Tensor, p: torch.Tensor, **kwargs: Any) -> RowShard:
        """``local`` (shard ``p`` or optimizer state shaped like it) placed as ``p``, on
        ``p``'s mesh, gathered over its ranks."""
        check_global(p)
        info = sharded_param(p)
        return cls.of(local, info.placement, info.shard_rank, **{**where(p), **kwargs})

    def like(self, local: torch.Tensor) -> RowShard:
        """The same place in the same tensor, holding ``local`` (a copy, another dtype)."""
        return RowShard(local, tuple(self.shape), self.offsets, self.fqn, mesh=self.device_mesh,
                        group=self.ranks, refusal=self.refusal, seq=self.seq)

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

    # ---- what torch's state-dict helpers call ----------------------------------------------
    def redistribute(self, device_mesh: DeviceMesh | None = None, placements: Any = None,
                     **kwargs: Any) -> DTensor:
        """To ``Replicate`` only: the full tensor on every rank (a collective, exact),
        as a replicated DTensor. ``full_tensor()`` and torch's ``full_state_dict`` call it."""
        if not placements or not all(isinstance(p, Replicate) for p in placements):
            raise NotImplementedError(f"matrixfsdp.RowShard '{self.fqn}' redistributes to "
                                      f"Replicate() only (the full tensor), not {placements}")
        if self.refusal is not None:
            raise NotImplementedError(self.refusal)
        if self.ranks is None or self.device_mesh is None:
            raise NotImplementedError(f"matrixfsdp.RowShard '{self.fqn}' was made without its "
                                      "ranks; it cannot be gathered")
        full = gather_rows(self.local, tuple(self.shape), self.offsets, self.fqn,
                           self.ranks.groups, self.seq)
        return DTensor.from_local(full, self.device_mesh, [Replicate()] * self.device_mesh.ndim,
                                  run_check=False)

    def data_ptr(self) -> int:
        """0: a RowShard owns no storage (its rows are ``.local``'s); torch's wrapper would
        report the local tensor's storage offset as an address."""
        return 0

    def to_local(self, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(
            f"matrixfsdp.RowShard '{self.fqn}': to_local() is refused: DTensor code pairs it "
            "with placement arithmetic, which cannot describe the rows each rank holds (torch's "
            "broadcast_from_rank0 loading optimizer state: use matrixfsdp.set_state_dict; a "
            "model's own save_pretrained: use matrixfsdp.save_pretrained). This rank's rows are "
            ".local; the full tensor is full_tensor() (a collective) or "
            "matrixfsdp.full_state_dict(model)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, ATEN_TO_COPY):
            self = args[0]
            return self.like(func(self.local, *args[1:], **(kwargs or {})))
        if func is torch.ops.aten.new_empty.default and tuple(args[1]) == tuple(args[0].shape):
            # an uninitialised RowShard of the same place (torch's default async stager
            # makes one, then sets its _local_tensor to the staged copy)
            self = args[0]
            return self.like(self.local.new_empty(self.local.shape, **(kwargs or {})))
        shards = [a for a in args if isinstance(a, RowShard)]
        name = shards[0].fqn if shards else ""
        raise NotImplementedError(
            f"matrixfsdp.RowShard '{name}' is one rank's rows of a sharded tensor, not a full "
            f"tensor: {func} is not supported. {_UNSUPPORTED}")

    def __deepcopy__(self, memo: dict) -> RowShard:
        out = self.like(self.local.clone())
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"matrixfsdp.RowShard '{self.fqn}' holds one rank's rows; pickling it (torch.save) "
            "would store them under the full name. Save with torch.distributed.checkpoint "
            "(dcp.save), or, for a plain file, torch.save the full tensors of torch's "
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
            "cpu_offload=True)) (rank 0 gets them) or of matrixfsdp.full_state_dict(model)")

    def __repr__(self, *, tensor_contents=None) -> str:
        start = self.offsets[0] if self.offsets else 0
        stop = start + (self.local.shape[0] if self.local.dim() else self.local.numel())
        return (f"RowShard({self.fqn!r}, shape={tuple(self.shape)}, rows {start}:{stop}, "
                f"{self.dtype}, {self.device})")


def where(p: torch.Tensor) -> dict[str, Any]:
    """The ``mesh`` and ``group`` of shard ``p``'s :class:`RowShard` s: its ``fully_shard``
    mesh, and the groups :meth:`RowShard.redistribute` gathers over: every rank of that
    mesh, then, for a piece of a tensor- or expert-parallel ``Shard`` DTensor (a tp-split
    matrix, a ``Shard(0)`` head or embedding, an expert stack), its tp or ep group, whose
    ranks hold the other pieces. A plain or ``Replicate`` parameter is alike on every tp rank:
    the data-parallel ranks hold it all."""
    info = sharded_param(p)
    groups = (info.unit.domain.groups.world,)
    if info.tp is not None and info.tp.shard_dim is not None and info.tp.mesh.size() > 1:
        groups += (info.tp.mesh.get_group(),)
    return dict(mesh=info.unit.domain.mesh, group=groups)
