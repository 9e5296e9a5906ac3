"""torch's ``state_dict`` / ``load_state_dict`` on the modules of a sharded model, as under FSDP2.

FSDP2's parameters are DTensors, so ``model.state_dict()`` holds DTensors, which
``torch.distributed.checkpoint`` (DCP) saves by name and reshards, and which torch's helpers
(``torch.distributed.checkpoint.state_dict``) and torchtitan's checkpointer take as they
come. MatrixFSDP's shards are plain tensors (a whole Muon matrix on its owner, rows of the
rest), so :func:`install_module_hooks`, which ``matrixfsdp.fully_shard`` calls on the module
it shards, gives each module the same behaviour:

* ``model.state_dict()`` (any submodule too): every parameter as a
  :class:`~matrixfsdp.tensors.row_shard.RowShard` of this rank's shard (its place in the full
  tensor; a view, so ``dcp.load`` writes into the parameter), buffers as torch has them
  (every rank holds them whole). Under HSDP the matrices stepped since the last forward are
  broadcast to the other replicas first (a collective, as in ``matrixfsdp.get_state_dict``).
* ``model.load_state_dict(state, strict=..., assign=...)``: each parameter from a
  ``RowShard`` made for this placement (after ``dcp.load``; in place where it views the
  parameter) or from a full tensor (a plain model's ``state_dict()``, torch's
  ``full_state_dict`` / ``broadcast_from_rank0``, or a ``Replicate`` DTensor, which is one:
  torchtitan's fused-QKV load hook hands one over): each rank copies its rows. Missing and
  unexpected names, ``strict`` and wrong shapes are torch's own (a value for another
  placement or shape is one of torch's ``Error(s) in loading state_dict``); the parameter
  objects stay (``assign=True`` too); buffers of a model built on meta are allocated. A
  load of every parameter marks a model built on meta initialised.

Before the model is sharded (a model sharded at its first use) the hooks do nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from .._compat import local_tensor
from ..runtime.lazy_init import module_unit
from ..runtime.param import sharded_param
from ..runtime.root import Root
from .pieces import local_piece
from .row_shard import RowShard

# module -> the module fully_shard was called on whose unit holds it (the outermost call last)
_CALLED_ON: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Root -> ids of shards loaded


def install_module_hooks(module: nn.Module) -> None:
    """Give ``module`` (just passed to ``fully_shard``) and its submodules the hooks, once
    per module; a later call on an outer module takes its submodules over."""
    for mod in module.modules():
        known = mod in _CALLED_ON
        _CALLED_ON[mod] = weakref.ref(module)
        if not known:
            mod.register_state_dict_pre_hook(_sync)
            mod.register_state_dict_post_hook(_to_row_shards)
            mod.register_load_state_dict_pre_hook(_from_state)
            mod.register_load_state_dict_post_hook(_loaded_all)


def _root(module: nn.Module) -> Root | None:
    """The root of the sharded model ``module`` belongs to (None before it is sharded)."""
    ref = _CALLED_ON.get(module)
    called_on = ref() if ref is not None else None
    unit = module_unit(called_on) if called_on is not None else None
    return unit.root if unit is not None else None


def _sync(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    root = _root(module)
    if root is not None:
        root.sync_replicas()  # HSDP: every replica holds the stepped matrices (no-op otherwise)


def _to_row_shards(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for attr, p in module._parameters.items():
        key = prefix + attr
        if key in state_dict and sharded_param(p) is not None:
            state_dict[key] = RowShard.of_param(p, p)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, skipped where ``src`` already is ``dst`` (``dcp.load`` wrote it)."""
    if not (src.numel() and src.data_ptr() == dst.data_ptr() and src.shape == dst.shape
            and src.dtype == dst.dtype and src.stride() == dst.stride()):
        dst.copy_(src)


@torch.no_grad()
def _from_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                strict: bool, missing: list, unexpected: list, errors: list) -> None:
    """Copy this rank's rows of each sharded parameter of ``module`` in, and put the
    parameter itself in its entry, so that torch's own load (a copy onto itself, or
    ``assign``) keeps it; a value that does not fit becomes one of torch's errors."""
    root = _root(module)
    if root is None:
        return
    if module is root.module:  # a load of the whole model starts
        _LOADED[root] = set()
    for attr, p in module._parameters.items():
        info, key = sharded_param(p), prefix + attr
        value = state_dict.get(key)
        if info is None or value is p or not isinstance(value, torch.Tensor):
            continue  # not ours, loaded already, missing or no tensor (torch says so)
        try:
            if isinstance(value, DTensor) and not isinstance(value, RowShard):
                if not all(isinstance(pl, Replicate) for pl in value.placements):
                    raise ValueError(f"matrixfsdp: load_state_dict: parameter '{key}' is a DTensor "
                                     f"placed {value.placements}; load RowShards, full tensors or "
                                     "Replicate DTensors")
                value = local_tensor(value)  # every rank holds the full tensor
            _copy(p, local_piece(value, info.placement, info.shard_rank, f"parameter '{key}'",
                                 "matrixfsdp: load_state_dict"))
            _LOADED.setdefault(root, set()).add(id(p))
        except ValueError as e:
            errors.append(str(e))
        state_dict[key] = p
    for attr, b in module._buffers.items():  # a model built on meta: allocate what is loaded
        value = state_dict.get(prefix + attr)
        if b is not None and b.is_meta and isinstance(value, torch.Tensor) and not value.is_meta:
            module._buffers[attr] = value.detach().to(device=root.units[0].local.device,
                                                      dtype=b.dtype, copy=True)
            state_dict[prefix + attr] = module._buffers[attr]


def _loaded_all(module: nn.Module, incompatible_keys: Any) -> None:
    root = _root(module)
    if root is None or module is not root.module:
        return
    loaded = _LOADED.pop(root, set())
    if all(id(p) in loaded for u in root.units for p in u.sharded):
        for u in root.units:  # a model built on meta is initialised now
            u.needs_init = False
