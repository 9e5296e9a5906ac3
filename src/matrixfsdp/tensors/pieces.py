"""One value of a sharded parameter's state, to and from what torch's state dicts hold:
:func:`saved_value` (this rank's tensor as a :class:`~matrixfsdp.tensors.row_shard.RowShard`
placed in the whole tensor) and :func:`local_piece` (this rank's piece of a ``RowShard`` or a
full tensor, checked against the placement)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..layout.types import Placement
from ..runtime.storage import local_rows
from .row_shard import RowShard, box_offsets
from .row_shard import where as where_of


def whole_here(p: torch.Tensor, pl: Placement) -> bool:
    """Whether this rank holds ``p`` whole and is the only one that does (its writer)."""
    return pl.whole_on_one_rank and tuple(p.shape) == pl.spec.shape and p.numel() > 0


def saved_value(v: Any, p: torch.Tensor, pl: Placement, where: str, scalars: bool = False) -> Any:
    """One state value as it goes to DCP (module docstring); lists and dicts recursively.
    ``scalars``: a 0-d tensor too becomes a (0-d) ``RowShard``, held by every rank holding
    rows, so that torch's ``full_state_dict`` gathers it onto the ranks that hold none."""
    if isinstance(v, dict):
        return {k: saved_value(x, p, pl, f"{where}.{k}", scalars) for k, x in v.items()}
    if isinstance(v, list):
        return [saved_value(x, p, pl, f"{where}.{i}", scalars) for i, x in enumerate(v)]
    if not isinstance(v, torch.Tensor) or (v.dim() == 0 and not scalars):
        return v
    if v.dim() == 0:
        return RowShard(v.detach(), (), (), pl.spec.name, **where_of(p))
    if v.shape == p.shape:
        return RowShard.of_param(v, p)
    if whole_here(p, pl):
        return RowShard(v.detach(), tuple(v.shape), (0,) * v.dim(), pl.spec.name, **where_of(p))
    raise ValueError(
        f"matrixfsdp.get_state_dict: optimizer state '{where}' of parameter '{pl.spec.name}' has "
        f"shape {tuple(v.shape)}, but this rank holds the row shard {tuple(p.shape)} of "
        f"{pl.spec.shape}: only element-wise state (shaped like the shard) reshards. Step whole "
        "matrices with matrixfsdp.matrix_params(model)")


def local_piece(value: Any, pl: Placement, rank: int, what: str,
                who: str = "matrixfsdp.set_state_dict") -> torch.Tensor:
    """This rank's piece of ``value`` (a RowShard of this placement, or a full tensor);
    ``who`` loads it (for the messages)."""
    spec = pl.spec
    shape = pl.local_shape(rank)
    if isinstance(value, RowShard):
        start = pl.row_ranges[rank][0]
        want = box_offsets(pl, rank)
        if tuple(value.shape) != spec.shape or tuple(value.local.shape) != tuple(shape) or \
                (math.prod(shape) and value.offsets != want):
            raise ValueError(
                f"{who}: {what} holds rows {value.offsets[:1]} +"
                f"{tuple(value.local.shape)} of {tuple(value.shape)}, but rank {rank} holds "
                f"{shape} at row {start} of {spec.shape}: the state was made for another placement. "
                "Take the state dict of this model (model.state_dict(), torch's or matrixfsdp's "
                "get_state_dict), then dcp.load into it")
        return value.local
    if isinstance(value, torch.Tensor):
        if tuple(value.shape) != spec.shape:
            raise ValueError(f"{who}: {what} has shape {tuple(value.shape)}, the model "
                             f"{spec.shape}")
        return local_rows(value, pl, rank)
    raise TypeError(f"{who}: {what} is a {type(value).__name__}, not a tensor")
