"""torch's own state-dict functions on a MatrixFSDP model, as under FSDP2.

FSDP2's parameters are DTensors, so ``model.state_dict()`` and an optimizer's
``state_dict()`` hold DTensors, which ``torch.distributed.checkpoint`` (DCP) saves by name
and reshards, and which torch's helpers (``torch.distributed.checkpoint.state_dict``:
``get_state_dict``, ``set_state_dict``, ``get_model_state_dict``, ...) and torchtitan's
checkpointer take as they come. MatrixFSDP's shards are plain tensors (a whole Muon matrix on
its owner, rows of the rest), so these hooks give the same functions the same behaviour:

* ``model.state_dict()`` (any submodule too): every parameter as a
  :class:`~matrixfsdp.state.dcp.RowShard` of this rank's shard (its place in the full
  tensor; a view, so ``dcp.load`` writes into the parameter), buffers as torch has them
  (every rank holds them whole). Under HSDP the matrices stepped since the last forward are
  broadcast to the other replicas first (a collective, as in ``matrixfsdp.get_state_dict``).
* ``model.load_state_dict(state, strict=..., assign=...)``: each parameter from a
  ``RowShard`` made for this placement (after ``dcp.load``; in place where it views the
  parameter) or from a full tensor (a plain model's ``state_dict()``, torch's
  ``full_state_dict`` / ``broadcast_from_rank0``): each rank copies its rows. Missing and
  unexpected names, ``strict`` and wrong shapes are torch's own (a value for another
  placement or shape is one of torch's ``Error(s) in loading state_dict``); the parameter
  objects stay (``assign=True`` too); buffers of a model built on meta are allocated. A
  load of every parameter marks a model built on meta initialised.
* an optimizer's ``state_dict()``: torch's, with each tensor of a sharded parameter's state
  a ``RowShard`` (element-wise state placed like the parameter, a whole matrix's state of
  any shape at offset 0 on its owner, a 0-d ``step`` on every rank holding rows). A rank
  holding none of a parameter still lists its state, as empty ``RowShard`` s of the keys the
  optimizer keeps (``matrixfsdp.Muon``: its own; any other: those of a parameter of the same
  group), so every rank's state dict has the same entries, as under FSDP2 (torch's
  ``full_state_dict`` gathers entry by entry). Entries go in parameter order, keys sorted.
* an optimizer's ``load_state_dict(state)``: ``RowShard`` s become this rank's pieces
  (checked against this placement), entries of parameters this rank holds none of are
  dropped, and the plan stamps of ``matrixfsdp.Muon`` with them (the state reshards).

Optimizers get the hooks at construction (``matrixfsdp.Muon``) or at their first step (any
other over a sharded model's parameters; torch's helpers and torchtitan step a fresh one
first). Not those on ``matrixfsdp.matrix_params`` (a rank's own matrices, whole: their state
is full already, and differs per rank; ``matrixfsdp.get_state_dict`` saves it).
"""

from __future__ import annotations

import weakref
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..optim.matrix import is_placeholder
from ..optim.muon import STATE_DICT_HOOKS, Muon, _init_state
from ..optim.plan_stamp import PLAN_KEYS
from ..runtime.fully_shard import ON_NEW_ROOT
from ..runtime.param import placement_of, sharded_param
from .dcp import RowShard, where
from .optim_state_dict import local_piece, saved_value

_ROOT_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> ref to its Root
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Root -> ids of shards loaded
_SEEN: weakref.WeakSet = weakref.WeakSet()  # optimizers looked at


def _holds(p: torch.Tensor) -> bool:
    """Whether this rank holds elements of shard ``p`` and steps them (HSDP: a matrix only
    in the replica stepping it)."""
    return p.numel() > 0 and sharded_param(p).steps_here()


# ---- the model --------------------------------------------------------------------------------
def install_module_hooks(root: Any) -> None:
    """Give every module of ``root``'s model the hooks (once per module)."""
    for mod in root.module.modules():
        known = mod in _ROOT_OF
        _ROOT_OF[mod] = weakref.ref(root)
        if not known:
            mod.register_state_dict_pre_hook(_sync)
            mod.register_state_dict_post_hook(_to_row_shards)
            mod.register_load_state_dict_pre_hook(_from_state)
            mod.register_load_state_dict_post_hook(_loaded_all)


def _root(module: nn.Module) -> Any:
    ref = _ROOT_OF.get(module)
    return None if ref is None else ref()


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
                raise ValueError(f"matrixfsdp: load_state_dict: parameter '{key}' is a DTensor "
                                 f"placed {value.placements}; load RowShards or full tensors")
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


# ---- optimizers -------------------------------------------------------------------------------
def install_optimizer_hooks(opt: torch.optim.Optimizer) -> None:
    """Give ``opt`` the hooks if it steps a sharded model's parameters, the same ones on
    every rank (decided once per optimizer)."""
    if opt in _SEEN:
        return
    _SEEN.add(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    if any(sharded_param(p) is not None for p in params) and not _per_rank(opt, params):
        opt.register_state_dict_post_hook(_optim_to_row_shards)
        opt.register_load_state_dict_pre_hook(_optim_from_row_shards, prepend=True)


def _per_rank(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Built on ``matrix_params``: a placeholder, or only Muon matrices, all this rank's (an
    optimizer over the model's parameters holds row shards too, and the others' matrices
    empty; a rank that owns every matrix must not decide otherwise than its peers)."""
    if any(is_placeholder(p) for p in params):
        return True
    mats = [p for p in params if getattr(placement_of(p), "owner", None) is not None]
    return not isinstance(opt, Muon) and bool(mats) and len(mats) == len(params) and \
        all(p.numel() for p in mats) and sharded_param(mats[0]).unit.domain.size > 1


def _numbered(opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict]]:
    """(parameter, group) in the order torch's ``state_dict`` numbers them."""
    seen, out = set(), []
    for g in opt.param_groups:
        for p in g["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append((p, g))
    return out


def _optim_to_row_shards(opt: torch.optim.Optimizer, sd: dict) -> dict:
    state: dict = {}
    order = _numbered(opt)
    for i, (p, group) in enumerate(order):
        live, info = sd["state"].get(i), sharded_param(p)
        if info is None:
            if live is not None:
                state[i] = live
        elif _holds(p):
            if live:
                state[i] = {k: saved_value(live[k], p, info.placement, str(k), scalars=True)
                            for k in sorted(live, key=str)}
        elif p.requires_grad:
            filled = _empty_state(opt, p, group, live)
            if filled:
                state[i] = filled
    state.update({k: v for k, v in sd["state"].items()  # anything not a parameter's, as it is
                  if not (isinstance(k, int) and 0 <= k < len(order))})
    shards = [v for v in _leaves(state) if isinstance(v, RowShard)]
    for n, rs in enumerate(shards):
        rs.seq = (n, len(shards))
    return {**sd, "state": state}


def _leaves(obj: Any):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def _empty_state(opt: torch.optim.Optimizer, p: torch.Tensor, group: dict, live: Any) -> dict:
    """The state of ``p``, which this rank holds none of, as empty ``RowShard`` s of the
    keys its holders keep: from this rank's own (empty) state of it, ``Muon``'s first-step
    state, or the state of a parameter of ``group`` this rank holds."""
    like = p
    if not live and isinstance(opt, Muon):
        live = {}
        _init_state(live, p, group)
    if not live:
        like = next((q for q in group["params"] if sharded_param(q) is not None and _holds(q)
                     and opt.state.get(q)), None)
        live = opt.state.get(like) if like is not None else None
    if not live:
        return {}

    def empty(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: x for k, x in ((k, empty(v[k])) for k in sorted(v, key=str)) if x is not None}
        if not isinstance(v, torch.Tensor):
            return None
        if v.dim() == 0:
            return RowShard(torch.empty(0, dtype=v.dtype, device=v.device), (), (),
                            sharded_param(p).name, **where(p))
        if v.shape == like.shape:
            rest = tuple(placement_of(p).spec.shape[1:])
            return RowShard.of_param(torch.empty((0, *rest), dtype=v.dtype, device=p.device), p)
        return None  # a whole matrix's state of its own shape: unknown here
    return empty(live)


def _has_row_shard(v: Any) -> bool:
    return any(isinstance(x, RowShard) for x in _leaves(v))


def _local(v: Any, p: torch.Tensor, what: str) -> Any:
    """A saved value as this rank's state holds it: a ``RowShard``'s piece, checked."""
    if isinstance(v, dict):
        return {k: _local(x, p, f"{what}.{k}") for k, x in v.items()}
    if isinstance(v, list):
        return [_local(x, p, f"{what}.{i}") for i, x in enumerate(v)]
    if not isinstance(v, RowShard):
        return v
    info = sharded_param(p)
    if v.dim() and tuple(v.shape) == info.placement.spec.shape:
        return local_piece(v, info.placement, info.shard_rank, what,
                           "matrixfsdp: optimizer load_state_dict")
    if tuple(v.local.shape) != tuple(v.shape):
        raise ValueError(f"matrixfsdp: optimizer load_state_dict: {what} holds "
                         f"{tuple(v.local.shape)} of {tuple(v.shape)} here, but this rank holds "
                         f"'{info.name}' and needs it whole: the state was made for another "
                         "placement. Take the optimizer's state_dict() here, then dcp.load into it")
    return v.local


def _optim_from_row_shards(opt: torch.optim.Optimizer, sd: dict) -> dict | None:
    saved, groups = sd.get("param_groups", []), opt.param_groups
    if len(saved) != len(groups) or any(len(s["params"]) != len(g["params"])
                                        for s, g in zip(saved, groups)):
        return None  # torch refuses it, in its own words
    id_map = dict(zip(chain.from_iterable(s["params"] for s in saved),
                      chain.from_iterable(g["params"] for g in groups)))
    state, converted = {}, False
    for k, v in sd["state"].items():
        p = id_map.get(k)
        if p is None or sharded_param(p) is None or not _has_row_shard(v):
            state[k] = v
            continue
        converted = True
        if _holds(p):  # else: this rank holds none of it, no state here
            state[k] = _local(v, p, f"optimizer state of '{sharded_param(p).name}'")
    if not converted:
        return None
    return {**sd, "state": state,
            "param_groups": [{k: v for k, v in s.items() if k not in PLAN_KEYS} for s in saved]}


ON_NEW_ROOT.append(install_module_hooks)
STATE_DICT_HOOKS.append(install_optimizer_hooks)
register_optimizer_step_pre_hook(lambda opt, args, kwargs: install_optimizer_hooks(opt))
