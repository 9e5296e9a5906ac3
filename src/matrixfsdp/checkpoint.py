"""Checkpoints keyed by parameter name.

* :func:`full_state_dict` / :func:`load_full_state_dict`: full tensors on every rank, for
  plain files and Hugging Face (``matrixfsdp.save_pretrained``).
* :func:`get_state_dict` / :func:`set_state_dict`: for ``torch.distributed.checkpoint``
  (DCP). Values are :class:`~matrixfsdp.dcp.RowShard` s, each carrying its place in the full
  tensor: every element is written once (a matrix and its momentum by the owner, row shards
  and their AdamW moments by the rank holding them), and a load at another world size reads
  the pieces this rank's new placement needs. The optimizer state is keyed by parameter
  name, as in torch's ``get_state_dict``.
* :func:`~matrixfsdp.checkpoint_io.save_checkpoint` and the other directory helpers live
  in :mod:`matrixfsdp.checkpoint_io`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .dcp import RowShard
from .layout import local_rows
from .optim import PLAN_KEYS, Muon, _scalar_dtype
from .param import placement_of
from .plan import Placement
from .root import Root
from .runtime import get_root


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter name -> full tensor (and buffers), on every rank.

    A collective: every rank must call it (under HSDP it first broadcasts the matrices
    stepped since the last forward, so every replica returns the same). Names are those of
    the unsharded model, so the result loads into a plain ``nn.Module`` with
    ``load_state_dict``.
    """
    root = get_root(model)
    root.sync_replicas()  # HSDP: every replica holds the stepped matrices (no-op otherwise)
    out: dict[str, torch.Tensor] = {}
    for unit in root.units:
        for pl, full in zip(unit.layout.placements, unit.storage.full_tensors(root.comm)):
            out[pl.spec.name] = full
    # The module's order and names, tied parameters under each of their names (as
    # ``model.state_dict()`` holds them).
    ordered = {name: out[root.aliases.get(name, name)]
               for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, buf in persistent_buffers(model):
        ordered[name] = buf.detach().clone()
    return ordered


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) for the buffers ``model.state_dict()`` holds: non-persistent ones
    (rotary ``inv_freq``, causal masks) are left out, as torch does."""
    return [(f"{prefix}.{name}" if prefix else name, buf)
            for prefix, mod in model.named_modules() for name, buf in mod._buffers.items()
            if buf is not None and name not in mod._non_persistent_buffers_set]


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors (``full_state_dict``'s, or a plain model's ``state_dict()``) into
    this rank's shards and the buffers; no communication, every rank needs ``state``. The
    model part of :func:`set_state_dict`: tied parameters under either name, a meta-built
    model's shards initialised. Raises ``ValueError`` naming a missing, unexpected or
    misshapen entry."""
    _load_model(model, get_root(model), state, strict=True)


# ---- torch.distributed.checkpoint ---------------------------------------------------------
# Optimizer state per parameter, by kind: what ``Muon._muon_step`` / ``_adamw_step`` keep.
STATE_KEYS = {True: ("momentum_buffer",), False: ("step", "exp_avg", "exp_avg_sq")}


@dataclass
class _Entry:
    name: str
    tensor: torch.Tensor
    module: nn.Module
    attr: str
    is_param: bool


def _entries(model: nn.Module) -> list[_Entry]:
    """What ``model.state_dict()`` holds, in its order: parameters (tied ones under every
    name) and persistent buffers, walked as ``Module.state_dict`` walks them."""
    out: list[_Entry] = []

    def visit(mod: nn.Module, prefix: str) -> None:
        for attr, p in mod._parameters.items():
            if p is not None:
                out.append(_Entry(prefix + attr, p, mod, attr, True))
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set:
                out.append(_Entry(prefix + attr, b, mod, attr, False))
        for name, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.")
    visit(model, "")
    return out


def _placement(p: torch.Tensor, name: str) -> Placement:
    pl = placement_of(p)
    if pl is None:
        raise ValueError(f"matrixfsdp: parameter '{name}' is not a MatrixFSDP shard (a state dict "
                         "is taken between steps, with the model planned by fully_shard)")
    return pl


def get_state_dict(model: nn.Module, optimizer: Muon | None = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` for ``torch.distributed.checkpoint``, keyed by name.

    * ``model``: every name of ``model.state_dict()`` (tied parameters under each name);
      parameters as :class:`~matrixfsdp.dcp.RowShard` views of this rank's shards (the
      fp32 masters under a mixed-precision policy), persistent buffers as the full tensors
      every rank holds (replicated: DCP writes one copy).
    * ``optim`` (if ``optimizer`` is given), shaped like torch's ``get_state_dict``:
      ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``. Muon
      parameters hold ``momentum_buffer``, placed like the matrix (written by its owner;
      under HSDP by its owner world rank only, the other replicas propose nothing);
      AdamW ones ``exp_avg`` / ``exp_avg_sq`` placed like the rows, and ``step``, a 0-d
      tensor equal on every rank holding rows (replicated). Frozen parameters have no state.
      State the optimizer lacks is created first (``Muon.init_state``: zeros, as the first
      step would create them), so a fresh optimizer can be loaded into.

    Under HSDP the matrices stepped since the last forward are first broadcast to the
    other replicas (a collective then), so replicas propose identical pieces and DCP keeps
    one of each.

    Values view the live tensors: ``dcp.load(state, checkpoint_id=...)`` writes into the
    model and the optimizer in place, from a checkpoint saved at any world size; then call
    :func:`set_state_dict` (it restores the hyperparameters and checks every placement).
    No communication (except the HSDP broadcast above).
    """
    root = get_root(model)
    root.sync_replicas()  # HSDP: every replica holds the stepped matrices (no-op otherwise)
    shards: dict[int, RowShard] = {}
    state: dict[str, Any] = {}
    for e in _entries(model):
        if e.is_param:
            if id(e.tensor) not in shards:
                shards[id(e.tensor)] = RowShard.of(e.tensor, _placement(e.tensor, e.name), root.rank)
            state[e.name] = shards[id(e.tensor)]
        elif e.tensor.is_meta:  # a model built on meta: DCP loads into a real tensor
            state[e.name] = torch.empty(e.tensor.shape, dtype=e.tensor.dtype,
                                        device=root.units[0].local.device)
        else:
            state[e.name] = e.tensor.detach()
    out: dict[str, Any] = {"model": state}
    if optimizer is not None:
        out["optim"] = _optim_state(optimizer, root)
    return out


def _optim_state(optimizer: Muon, root: Root) -> dict[str, Any]:
    if not isinstance(optimizer, Muon):
        raise TypeError(f"matrixfsdp.get_state_dict: expected a matrixfsdp.Muon, got "
                        f"{type(optimizer).__name__}")
    optimizer.init_state()
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            pl = _placement(p, f"of shape {tuple(p.shape)}")
            name = pl.spec.name
            names.append(name)
            if not p.requires_grad or not pl.spec.numel:
                continue  # frozen, or empty: no state anywhere
            held = optimizer.state.get(p, {})
            entry: dict[str, Any] = {}
            for key in STATE_KEYS[bool(group["use_muon"])]:
                t = held.get(key)
                if key == "step":
                    if t is not None:  # only where this rank holds rows
                        entry[key] = t
                    continue
                if not root.groups.steps_here(pl):  # HSDP: another replica writes it
                    t = p.new_empty((0, *p.shape[1:]))
                elif t is None:  # this rank holds no element of it (init_state made the rest)
                    t = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                entry[key] = RowShard.of(t, pl, root.rank)
            state[name] = entry
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups}


def _local_rows(value: Any, pl: Placement, rank: int, what: str) -> torch.Tensor:
    """This rank's piece of ``value`` (a RowShard of this placement, or a full tensor)."""
    spec = pl.spec
    shape = pl.local_shape(rank)
    if isinstance(value, RowShard):
        start = pl.row_ranges[rank][0]
        want = (start, *[0] * (len(spec.shape) - 1)) if spec.shape else ()
        if tuple(value.shape) != spec.shape or tuple(value.local.shape) != tuple(shape) or \
                (math.prod(shape) and value.offsets != want):
            raise ValueError(
                f"matrixfsdp.set_state_dict: {what} holds rows {value.offsets[:1]} +"
                f"{tuple(value.local.shape)} of {tuple(value.shape)}, but rank {rank} holds "
                f"{shape} at row {start} of {spec.shape}: the state was made for another placement. "
                "Build it with matrixfsdp.get_state_dict on this model, then dcp.load into it")
        return value.local
    if isinstance(value, torch.Tensor):
        if tuple(value.shape) != spec.shape:
            raise ValueError(f"matrixfsdp.set_state_dict: {what} has shape {tuple(value.shape)}, "
                             f"the model {spec.shape}")
        return local_rows(value, pl, rank)
    raise TypeError(f"matrixfsdp.set_state_dict: {what} is a {type(value).__name__}, not a tensor")


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, skipped where ``src`` already is ``dst`` (loaded in place)."""
    if src.numel() and dst.data_ptr() == src.data_ptr() and dst.shape == src.shape \
            and dst.dtype == src.dtype and dst.stride() == src.stride():
        return
    dst.copy_(src)


@torch.no_grad()
def set_state_dict(model: nn.Module, optimizer: Muon | None, state: dict[str, Any], *,
                   strict: bool = True) -> None:
    """Load ``state`` (``{"model": ..., "optim": ...}``) into the model and the optimizer.

    Values may be the :class:`~matrixfsdp.dcp.RowShard` s of :func:`get_state_dict` on this
    model (typically after ``dcp.load`` filled them; where they view the live tensors nothing
    is copied) or full tensors (as in ``torch.load`` of a file written by
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``): each rank keeps its
    rows. The optimizer's hyperparameters (lr, betas, ...) are restored from ``param_groups``,
    matched to this optimizer's groups by parameter name; state is set where this rank holds
    elements (momentum on the owner only) and dropped elsewhere. ``strict``: every name of
    ``model.state_dict()`` must be in ``state["model"]`` and nothing else. No communication.

    Raises ``ValueError`` naming the parameter on a missing or unexpected name, a shape, a
    placement made for another world size, or parameter groups that differ.
    """
    root = get_root(model)
    if "model" not in state:
        raise ValueError("matrixfsdp.set_state_dict: the state has no 'model' entry")
    _load_model(model, root, state["model"], strict)
    if optimizer is not None:
        if "optim" not in state:
            raise ValueError("matrixfsdp.set_state_dict: the state has no 'optim' entry")
        _load_optim(optimizer, root, state["optim"])


def _load_model(model: nn.Module, root: Root, sd: dict[str, Any], strict: bool) -> None:
    entries = _entries(model)
    names = {e.name for e in entries}
    missing = [e.name for e in entries if e.name not in sd]
    unexpected = [k for k in sd if k not in names]
    if strict and (missing or unexpected):
        raise ValueError(f"matrixfsdp.set_state_dict: missing names {missing[:5]}, unexpected names "
                         f"{unexpected[:5]}" + (" (and more)" if len(missing) + len(unexpected) > 10 else ""))
    loaded: set[int] = set()
    for e in entries:
        if e.name not in sd:
            continue
        value = sd[e.name]
        if e.is_param:
            src = _local_rows(value, _placement(e.tensor, e.name), root.rank, f"parameter '{e.name}'")
            _copy(e.tensor, src)
            loaded.add(id(e.tensor))
        elif e.tensor.is_meta:  # a model built on meta: the buffer gets the loaded tensor
            e.module._buffers[e.attr] = value.detach().to(
                device=root.units[0].local.device, dtype=e.tensor.dtype, copy=True)
        else:
            if tuple(value.shape) != tuple(e.tensor.shape):
                raise ValueError(f"matrixfsdp.set_state_dict: buffer '{e.name}' has shape "
                                 f"{tuple(value.shape)}, the model {tuple(e.tensor.shape)}")
            _copy(e.tensor, value)
    if all(id(p) in loaded for u in root.units for p in u.sharded):
        for u in root.units:  # a model built on meta is initialised now
            u.needs_init = False


def _load_optim(optimizer: Muon, root: Root, osd: dict[str, Any]) -> None:
    if not isinstance(optimizer, Muon):
        raise TypeError(f"matrixfsdp.set_state_dict: expected a matrixfsdp.Muon, got "
                        f"{type(optimizer).__name__}")
    where: dict[str, tuple[dict, torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            where[_placement(p, f"of shape {tuple(p.shape)}").spec.name] = (group, p)
    saved_groups = osd["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"matrixfsdp.set_state_dict: the state has {len(saved_groups)} parameter "
                         f"groups, the optimizer {len(optimizer.param_groups)}")
    updates = []
    for i, saved in enumerate(saved_groups):
        names = list(saved["params"])
        unknown = [n for n in names if n not in where]
        if unknown:
            raise ValueError(f"matrixfsdp.set_state_dict: parameter group {i} of the state holds "
                             f"'{unknown[0]}', which the optimizer does not hold")
        group = where[names[0]][0] if names else optimizer.param_groups[i]
        here = [_placement(p, "").spec.name for p in group["params"]]
        if set(here) != set(names) or len(here) != len(names):
            other = sorted(set(here) ^ set(names))
            raise ValueError(f"matrixfsdp.set_state_dict: parameter group {i} differs from the "
                             f"optimizer's (e.g. '{other[0] if other else names[0]}')")
        if bool(saved.get("use_muon", group["use_muon"])) != bool(group["use_muon"]):
            raise ValueError(f"matrixfsdp.set_state_dict: parameter group {i} has use_muon="
                             f"{saved['use_muon']} in the state, {group['use_muon']} here")
        updates.append((group, {k: v for k, v in saved.items() if k != "params" and k not in PLAN_KEYS}))
    unknown = [n for n in osd["state"] if n not in where]
    if unknown:
        raise ValueError(f"matrixfsdp.set_state_dict: the optimizer state holds '{unknown[0]}', "
                         "which the optimizer does not hold")
    for group, hyper in updates:
        group.update(hyper)
    for name, (group, p) in where.items():
        saved = osd["state"].get(name)
        held = optimizer.state.get(p, {})
        if not saved or not p.numel() or not root.groups.steps_here(placement_of(p)):
            optimizer.state.pop(p, None)  # nothing saved, this rank holds none of it, or
            continue  # (HSDP) another replica steps it
        new: dict[str, Any] = {}
        for key, value in saved.items():
            old = held.get(key)
            if key == "step":
                step = torch.as_tensor(value).detach()
                if old is not None and old.shape == step.shape:
                    _copy(old, step)
                    new[key] = old
                else:
                    new[key] = (step.to(torch.float32, device=p.device) if group.get("fused")
                                else step.to(_scalar_dtype(), copy=True))
                continue
            src = _local_rows(value, placement_of(p), root.rank, f"optimizer state '{key}' of '{name}'")
            if old is not None and old.shape == src.shape and old.dtype == p.dtype:
                _copy(old, src)
                new[key] = old
            else:
                new[key] = src.to(dtype=p.dtype, device=p.device, copy=True)
        optimizer.state[p] = new
