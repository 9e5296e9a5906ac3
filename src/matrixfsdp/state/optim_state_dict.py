"""Optimizer state by parameter name, for any optimizers, for ``torch.distributed.checkpoint``.

``matrixfsdp.get_state_dict(model, optimizers)`` / ``set_state_dict`` take one optimizer or a
list (``matrixfsdp.Muon``; any optimizer on :func:`~matrixfsdp.matrix_params`; an element-wise
one on :func:`~matrixfsdp.shard_params`), merged as torch's ``get_state_dict`` merges them:
``{"state": {name: {key: value}}, "param_groups": [every optimizer's groups, in order]}``.

Each state value is placed by what its parameter is on this rank:

* a **whole matrix** this rank steps: every tensor, of any shape (momentum, Shampoo's
  preconditioners, SOAP's eigenbases, in lists or dicts), is saved whole by this rank, the
  owner, as a :class:`~matrixfsdp.tensors.row_shard.RowShard` at offset 0 that no other rank proposes; a
  load at another world size reads it whole on the matrix's new owner, whatever its shape.
  Other values (ints, floats, sets) are written by the owner too;
* a **row shard** (element-wise state): a tensor shaped like the shard is placed like its
  rows (DCP reshards it); a 0-d tensor or a plain value (``step``) is equal on every rank
  holding rows and saved replicated. Any other shape is refused, naming it.

Param groups: an optimizer whose parameter lists differ between ranks (one on
``matrix_params``: each rank holds its own matrices) saves its groups' hyperparameters
without ``params`` (and without ``_``-prefixed private keys); on load its groups are matched
by position. Every other optimizer saves ``params`` as names, checked on load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layout.types import Placement
from ..optim.matrix import is_placeholder
from ..optim.muon import Muon, _dtype, _step_tensor
from ..optim.plan_stamp import PLAN_KEYS
from ..optim.state_dict_hooks import check_decoupled, torch_keyed
from ..runtime.param import placement_of, sharded_param
from ..runtime.storage import local_rows
from ..tensors.pieces import local_piece, saved_value, whole_here
from ..tensors.row_shard import RowShard, check_global

Optimizers = torch.optim.Optimizer | list[torch.optim.Optimizer] | tuple[torch.optim.Optimizer, ...]


def as_list(optimizers: Optimizers | None) -> list[torch.optim.Optimizer]:
    """``optimizers`` as a list (None: empty); anything but optimizers is a ``TypeError``."""
    opts = [] if optimizers is None else (
        list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers])
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"matrixfsdp: expected a torch.optim.Optimizer or a list of them, got "
                            f"{type(o).__name__}")
    return opts


def _placement(p: torch.Tensor) -> Placement:
    pl = placement_of(p)
    if pl is None:
        raise ValueError(f"matrixfsdp: an optimizer holds a parameter of shape {tuple(p.shape)} that "
                         "is not a MatrixFSDP shard (build optimizers after the root fully_shard, "
                         "from model.parameters(), matrix_params or shard_params)")
    check_global(p)
    return pl


def _per_rank(opt: torch.optim.Optimizer) -> bool:
    """Whether this optimizer's parameter lists may differ between ranks: it holds whole
    matrices without their placeholders (built on ``matrix_params``), or is a stand-in."""
    if isinstance(opt, Muon):
        return False
    params = [p for g in opt.param_groups for p in g["params"]]
    return any(is_placeholder(p) or (placement_of(p) is not None and placement_of(p).owner is not None)
               for p in params)


@torch.no_grad()
def init_state(opt: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer the state its first step creates, so a checkpoint can be
    loaded into it: ``Muon.init_state``; for any other optimizer with no state at all, what
    torch's ``get_state_dict`` does: one step with zero gradients and lr 0 (lr and
    gradients restored afterwards). As in torch, that step counts: group-level counters it
    creates (pytorch-optimizer's ``group["step"]``) stay, so that a checkpoint's values load
    into them; call this to load, or after the first real step."""
    if isinstance(opt, Muon):
        opt.init_state()
        return
    params = [p for g in opt.param_groups for p in g["params"]
              if p.requires_grad and p.numel() and not is_placeholder(p)]
    if not params or any(opt.state.get(p) for p in params):
        return
    lrs = [g.get("lr") for g in opt.param_groups]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        opt.step()
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        for g, lr in zip(opt.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr


def refuse_unloadable(opt: torch.optim.Optimizer) -> None:
    """Refuse, before anything is saved, an optimizer whose checkpoint would not load back:
    heavyball's (3.2.1) keep their state as ``{0: {...}}`` beside a Python ``set``
    (``is_initialized``) that no state dict carries, so a resumed step fails inside
    heavyball, its PSGD refuses the zero-gradient step that creates state to load into
    ("Grad or HVP is all 0s"), and DCP's load meets tensors of another size."""
    cls = type(opt)
    if cls.__module__.split(".")[0] == "heavyball":
        raise ValueError(
            f"matrixfsdp: heavyball's {cls.__name__} cannot be checkpointed: its state does not "
            "load back (heavyball keeps it beside an is_initialized set that no state dict "
            "carries: a resumed step fails inside heavyball). To save a run, use an optimizer "
            "whose state round-trips (torch's, pytorch-optimizer's, emerging-optimizers'), or "
            "save the model alone: mf.get_state_dict(model). Whether its steps equal one "
            "process's depends on the optimizer: heavyball's SOAP does, its PSGD (Kron, PRO), "
            "Muon and Scion do not (docs/optimizers.md#how-to-choose)")


def optim_state_dict(optimizers: list[torch.optim.Optimizer], root: Any) -> dict[str, Any]:
    """The merged ``{"state", "param_groups"}`` of ``optimizers`` (module docstring); an
    optimizer whose state would not load back is refused first (:func:`refuse_unloadable`)."""
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for opt in optimizers:
        refuse_unloadable(opt)
    for opt in optimizers:
        init_state(opt)
        per_rank = _per_rank(opt)
        for group in opt.param_groups:
            names = []
            for p in group["params"]:
                if is_placeholder(p):
                    continue
                pl = _placement(p)
                names.append(pl.spec.name)
                held = opt.state.get(p)
                if not held or not p.requires_grad or not p.numel() or not sharded_param(p).steps_here():
                    continue  # no state here (frozen, no rows, another replica steps it)
                if pl.spec.name in state:
                    raise ValueError(f"matrixfsdp.get_state_dict: parameter '{pl.spec.name}' is in "
                                     "two optimizers")
                state[pl.spec.name] = {k: saved_value(v, p, pl, str(k)) for k, v in held.items()}
            hyper = torch_keyed({k: v for k, v in group.items() if k not in ("params", "param_names")
                                 and not (per_rank and isinstance(k, str) and k.startswith("_"))})
            groups.append(hyper if per_rank else {**hyper, "params": names})
    return {"state": state, "param_groups": groups}


def _copy_into(old: Any, src: torch.Tensor) -> torch.Tensor:
    """``src`` into ``old`` where it fits (nothing to do where DCP loaded in place), else a copy."""
    if isinstance(old, torch.Tensor) and old.shape == src.shape:
        if not (src.numel() and old.data_ptr() == src.data_ptr() and old.dtype == src.dtype
                and old.stride() == src.stride()):
            old.copy_(src)
        return old
    return src.detach().clone()


def _loaded_value(v: Any, old: Any, p: torch.Tensor, pl: Placement, rank: int, where: str) -> Any:
    """One saved value as this rank's state holds it (inverse of :func:`saved_value`)."""
    if isinstance(v, dict):
        old = old if isinstance(old, dict) else {}
        return {k: _loaded_value(x, old.get(k), p, pl, rank, f"{where}.{k}") for k, x in v.items()}
    if isinstance(v, list):
        old = old if isinstance(old, list) and len(old) == len(v) else [None] * len(v)
        return [_loaded_value(x, o, p, pl, rank, f"{where}.{i}") for i, (x, o) in enumerate(zip(v, old))]
    if not isinstance(v, torch.Tensor):
        return v
    if isinstance(v, RowShard) and v.shape == pl.spec.shape and len(v.shape) and \
            (v.local.shape == p.shape or not whole_here(p, pl)):
        src = local_piece(v, pl, rank, where)
    elif isinstance(v, RowShard):
        src = v.local
    elif v.dim() and v.shape == pl.spec.shape and not whole_here(p, pl):
        src = local_rows(v, pl, rank)  # a full tensor (dcp_to_torch_save): this rank's rows
    else:
        src = v
    out = _copy_into(old, src)
    if isinstance(old, torch.Tensor) and out is not old:
        out = out.to(dtype=old.dtype, device=old.device)
    elif old is None and out.dim():
        out = out.to(device=p.device)
    return out


def _match_groups(opt: torch.optim.Optimizer, saved_groups: list[dict], first: int) -> list[dict]:
    """The hyperparameters of each of ``opt``'s groups from its saved groups (positions
    ``first..``), checked: the same parameter names where saved, the same ``use_muon``."""
    per_rank = _per_rank(opt)
    updates = []
    for j, group in enumerate(opt.param_groups):
        i, saved = first + j, saved_groups[first + j]
        if "params" in saved and not per_rank:
            here = [_placement(p).spec.name for p in group["params"] if not is_placeholder(p)]
            names = list(saved["params"])
            if set(here) != set(names) or len(here) != len(names):
                other = sorted(set(here) ^ set(names))
                raise ValueError(f"matrixfsdp.set_state_dict: parameter group {i} differs from the "
                                 f"optimizer's (e.g. '{other[0] if other else names[0]}')")
        check_decoupled(saved, group, f"matrixfsdp.set_state_dict: parameter group {i}")
        if "use_muon" in group and bool(saved.get("use_muon", group["use_muon"])) != bool(group["use_muon"]):
            raise ValueError(f"matrixfsdp.set_state_dict: parameter group {i} has use_muon="
                             f"{saved['use_muon']} in the state, {group['use_muon']} here")
        updates.append({k: _dtype(v) if k == "ns_dtype" else v for k, v in saved.items()
                        if k not in ("params", "param_names") and k not in PLAN_KEYS})
    return updates


def load_optim_state(optimizers: list[torch.optim.Optimizer], root: Any, osd: dict[str, Any],
                     model: nn.Module) -> None:
    """Load ``osd`` (``optim_state_dict``'s, after ``dcp.load``; or full tensors) into the
    optimizers: hyperparameters by group, state by name where this rank steps the parameter
    (whole matrices on their owner, rows where held), dropped elsewhere. Every check runs
    before anything is written."""
    saved_groups = osd["param_groups"]
    total = sum(len(o.param_groups) for o in optimizers)
    if len(saved_groups) != total:
        raise ValueError(f"matrixfsdp.set_state_dict: the state has {len(saved_groups)} parameter "
                         f"groups, the optimizer{'s' if len(optimizers) > 1 else ''} {total}")
    where: dict[str, tuple[torch.optim.Optimizer, torch.Tensor]] = {}
    updates, first = [], 0
    for opt in optimizers:
        updates.append(_match_groups(opt, saved_groups, first))
        first += len(opt.param_groups)
        for g in opt.param_groups:
            for p in g["params"]:
                if not is_placeholder(p):
                    where[_placement(p).spec.name] = (opt, p)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)} | \
        {p.placement.spec.name for u in root.units for p in map(sharded_param, u.sharded)}
    unknown = [n for n in osd["state"] if n not in where and n not in names]
    if unknown:
        raise ValueError(f"matrixfsdp.set_state_dict: the optimizer state holds '{unknown[0]}', "
                         "which the optimizer does not hold")
    for opt, ups in zip(optimizers, updates):
        for group, hyper in zip(opt.param_groups, ups):
            group.update(hyper)
    for name, (opt, p) in where.items():
        saved, held = osd["state"].get(name), opt.state.get(p, {})
        pl = placement_of(p)
        if not saved or not p.numel() or not sharded_param(p).steps_here():
            opt.state.pop(p, None)  # nothing saved, none of it here, or another replica steps it
            continue
        opt.state[p] = {k: _loaded_value(v, held.get(k), p, pl, sharded_param(p).shard_rank,
                                         f"optimizer state '{k}' of '{name}'") for k, v in saved.items()}
        step = opt.state[p].get("step")
        if isinstance(opt, Muon) and step is not None and not torch.is_tensor(step):
            opt.state[p]["step"] = _step_tensor(float(step), p, _group_of(opt, p))


def _group_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    return next(g for g in opt.param_groups if any(q is p for q in g["params"]))
