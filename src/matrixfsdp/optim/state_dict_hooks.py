"""An optimizer's ``state_dict`` / ``load_state_dict`` over a sharded model, as under FSDP2.

Under FSDP2 an optimizer's state tensors are DTensors (made from its DTensor parameters), so
torch's ``optimizer.state_dict()`` holds them and DCP reshards them. Here the hooks that
:func:`install_optimizer_hooks` registers on an optimizer give the same:

* ``state_dict()``: torch's, with each tensor of a sharded parameter's state a
  :class:`~matrixfsdp.tensors.row_shard.RowShard` (element-wise state placed like the
  parameter, a whole matrix's state of any shape at offset 0 on its owner, a 0-d ``step`` on
  every rank holding rows). A rank holding none of a parameter still lists its state, as
  empty ``RowShard`` s of the keys the optimizer keeps (``matrixfsdp.Muon``: its own; any
  other: those of a parameter of the same group), so every rank's state dict has the same
  entries, as under FSDP2 (torch's ``full_state_dict`` gathers entry by entry). Entries go in
  parameter order, keys sorted.
* ``load_state_dict(state)``: ``RowShard`` s become this rank's pieces (checked against this
  placement), entries of parameters this rank holds none of are dropped, and the plan
  stamps of ``matrixfsdp.Muon`` with them (the state reshards).
* ``matrixfsdp.Muon``'s AdamW groups are saved keyed as ``torch.optim.AdamW``'s (with its
  ``decoupled_weight_decay``), so that torch's AdamW on FSDP2 loads them; a group saved by
  ``torch.optim.Adam`` (L2 decay) is refused on load.

``matrixfsdp.Muon`` installs them when it is built; any other optimizer over a sharded
model's parameters gets them from :func:`~matrixfsdp.optim.watch.watch` at its first step
(torch's helpers and torchtitan step a fresh one first). Not those on
``matrixfsdp.matrix_params`` (a rank's own matrices, whole: their state is full already, and
differs per rank; ``matrixfsdp.get_state_dict`` saves it).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import chain
from typing import Any

import torch

from ..runtime.param import placement_of, sharded_param
from ..tensors.pieces import local_piece, saved_value
from ..tensors.row_shard import RowShard, where
from .matrix import is_placeholder
from .plan_stamp import PLAN_KEYS

# (state, parameter, group) -> None: fills ``state`` with a parameter's first-step state
InitialState = Callable[[dict, torch.Tensor, dict], None]


def _holds(p: torch.Tensor) -> bool:
    """Whether this rank holds elements of shard ``p`` and steps them (HSDP: a matrix only
    in the replica stepping it)."""
    return p.numel() > 0 and sharded_param(p).steps_here()


def install_optimizer_hooks(opt: torch.optim.Optimizer, initial_state: InitialState | None = None) -> None:
    """Give ``opt`` the hooks if it steps a sharded model's parameters, the same ones on
    every rank (call once per optimizer). ``initial_state``: ``matrixfsdp.Muon``'s, whose
    parameter lists are the model's on every rank; None for any other optimizer."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if any(sharded_param(p) is not None for p in params) and \
            (initial_state is not None or not _per_rank(params)):
        opt.register_state_dict_post_hook(partial(_optim_to_row_shards, initial_state=initial_state))
        opt.register_load_state_dict_pre_hook(_optim_from_row_shards, prepend=True)


def _per_rank(params: list[torch.Tensor]) -> bool:
    """Built on ``matrix_params``: a placeholder, or only Muon matrices, all this rank's (an
    optimizer over the model's parameters holds row shards too, and the others' matrices
    empty; a rank that owns every matrix must not decide otherwise than its peers)."""
    if any(is_placeholder(p) for p in params):
        return True
    mats = [p for p in params if getattr(placement_of(p), "owner", None) is not None]
    return bool(mats) and len(mats) == len(params) and \
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


def _optim_to_row_shards(opt: torch.optim.Optimizer, sd: dict,
                         initial_state: InitialState | None) -> dict:
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
            filled = _empty_state(opt, p, group, live, initial_state)
            if filled:
                state[i] = filled
    state.update({k: v for k, v in sd["state"].items()  # anything not a parameter's, as it is
                  if not (isinstance(k, int) and 0 <= k < len(order))})
    shards = [v for v in _leaves(state) if isinstance(v, RowShard)]
    for n, rs in enumerate(shards):
        rs.seq = (n, len(shards))
    return {**sd, "state": state, "param_groups": [torch_keyed(g) for g in sd["param_groups"]]}


def torch_keyed(group: dict) -> dict:
    """A saved param group of ``matrixfsdp.Muon``, keyed as torch's optimizer of its kind
    keys it: an AdamW group also holds torch.optim.AdamW's ``decoupled_weight_decay``
    (True), so that torch's AdamW (FSDP2, torchtitan) loads it, which asks for every key of
    its own groups."""
    if "use_muon" in group and not group["use_muon"]:
        return {**group, "decoupled_weight_decay": True}
    return group


def check_decoupled(saved: dict, group: dict, where: str) -> None:
    """Refuse a saved group of ``torch.optim.Adam`` (L2 in the gradient,
    ``decoupled_weight_decay=False``) for ``matrixfsdp.Muon``'s AdamW group ``group``."""
    if "use_muon" in group and not group["use_muon"] and saved.get("decoupled_weight_decay") is False:
        raise ValueError(f"{where}: the state's param group was saved by torch.optim.Adam "
                         "(decoupled_weight_decay=False, L2 in the gradient); this group steps "
                         "AdamW (decoupled decay)")


def _leaves(obj: Any):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def _empty_state(opt: torch.optim.Optimizer, p: torch.Tensor, group: dict, live: Any,
                 initial_state: InitialState | None) -> dict:
    """The state of ``p``, which this rank holds none of, as empty ``RowShard`` s of the
    keys its holders keep: from this rank's own (empty) state of it, ``Muon``'s first-step
    state, or the state of a parameter of ``group`` this rank holds."""
    like = p
    if not live and initial_state is not None:
        live = {}
        initial_state(live, p, group)
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
    for i, (s, g) in enumerate(zip(saved, groups)):
        check_decoupled(s, g, f"matrixfsdp: {type(opt).__name__}.load_state_dict: param group {i}")
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
