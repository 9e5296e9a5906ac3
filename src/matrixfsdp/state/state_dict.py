"""Checkpoints keyed by parameter name.

* :func:`full_state_dict` / :func:`load_full_state_dict`: full tensors on every rank, for
  plain files and Hugging Face (``matrixfsdp.save_pretrained``).
* :func:`get_state_dict` / :func:`set_state_dict`: for ``torch.distributed.checkpoint``
  (DCP). Values are :class:`~matrixfsdp.tensors.row_shard.RowShard` s, each carrying its place in the full
  tensor: every element is written once (a matrix and its momentum by the owner, row shards
  and their AdamW moments by the rank holding them), and a load at another world size reads
  the pieces this rank's new placement needs. The optimizer state is keyed by parameter
  name, as in torch's ``get_state_dict``.
* :func:`~matrixfsdp.state.files.save_checkpoint` and the other directory helpers live
  in :mod:`matrixfsdp.state.files`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layout.types import Placement
from ..runtime.module import get_root
from ..runtime.param import placement_of, sharded_param
from ..runtime.root import Root
from ..tensors.pieces import local_piece
from ..tensors.row_shard import RowShard, check_global
from .entries import check_names, state_entries
from .optim_state_dict import Optimizers, as_list, load_optim_state, optim_state_dict


@torch.no_grad()
def full_state_dict(model: nn.Module, *, cpu_offload: bool = False,
                    every_rank: bool = False) -> dict[str, torch.Tensor]:
    """Parameter name -> full tensor (and buffers).

    A collective: every rank must call it (under HSDP it first broadcasts the matrices
    stepped since the last forward, so every replica returns the same). Names are those of
    the unsharded model, so the result loads into a plain ``nn.Module`` with
    ``load_state_dict``. Without ``cpu_offload`` every rank gets the full tensors on the
    device they were gathered on. With ``cpu_offload`` (torch's ``StateDictOptions`` name,
    and its meaning with ``full_state_dict=True``) each unit's full tensors move to the CPU
    as soon as they are gathered, so the device holds one unit's at a time, never the whole
    model (an export from GPUs), and only the model's rank 0 keeps them: the others return
    an empty dict, so a node of 8 ranks holds one host copy of the model, not 8
    (``every_rank=True``: every rank keeps its copy).
    """
    root = get_root(model)
    root.sync_replicas()  # HSDP: every replica holds the stepped matrices (no-op otherwise)
    keep = not cpu_offload or every_rank or root.groups.world_rank == 0
    out: dict[str, torch.Tensor] = {}
    for unit in root.units:
        for pl, full in zip(unit.layout.placements,
                            unit.storage.full_tensors(unit.domain.comm, unit.tp_params)):
            if keep:
                out[pl.spec.name] = full.cpu() if cpu_offload else full
    if not keep:  # gathered with the others (a collective), dropped at once
        return {}
    # The module's order and names, tied parameters under each of their names (as
    # ``model.state_dict()`` holds them). Found by the parameter itself, not by name: a
    # ``torch.compile(block)`` wrapper registered after fully_shard adds ``_orig_mod.`` to
    # the module's names, not to the plan's.
    plan_name = {id(q): pl.spec.name for u in root.units for pl, q in
                 zip(u.layout.placements, u.unsharded)}
    ordered = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        info = sharded_param(p)
        key = info.name if info is not None else plan_name.get(id(p), root.aliases.get(name, name))
        ordered[name] = out[key]
    for e in state_entries(model):
        if not e.is_param:
            ordered[e.name] = e.tensor.detach().to("cpu", copy=True) if cpu_offload else \
                e.tensor.detach().clone()
    return ordered


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors (``full_state_dict``'s, or a plain model's ``state_dict()``) into
    this rank's shards and the buffers; no communication, every rank needs ``state``. The
    model part of :func:`set_state_dict`: tied parameters under either name, a meta-built
    model's shards initialised. Raises ``ValueError`` naming a missing, unexpected or
    misshapen entry."""
    _load_model(model, get_root(model), state, strict=True)


# ---- torch.distributed.checkpoint ---------------------------------------------------------
def _placement(p: torch.Tensor, name: str) -> Placement:
    pl = placement_of(p)
    if pl is None:
        raise ValueError(f"matrixfsdp: parameter '{name}' is not a MatrixFSDP shard (a state dict "
                         "is taken between steps, with the model planned by fully_shard)")
    check_global(p)
    return pl


def get_state_dict(model: nn.Module, optimizers: Optimizers | None = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` for ``torch.distributed.checkpoint``, keyed by name.

    * ``model``: every name of ``model.state_dict()`` (tied parameters under each name);
      parameters as :class:`~matrixfsdp.tensors.row_shard.RowShard` views of this rank's shards (the
      fp32 masters under a mixed-precision policy), persistent buffers as the full tensors
      every rank holds (replicated: DCP writes one copy).
    * ``optim`` (if ``optimizers`` are given: one optimizer or a list), shaped like torch's
      ``get_state_dict`` (several optimizers merged into one):
      ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``.
      ``matrixfsdp.Muon``: ``momentum_buffer`` placed like the matrix (written by its owner;
      under HSDP by its owner world rank only), AdamW's ``exp_avg`` / ``exp_avg_sq`` placed
      like the rows and ``step``, a 0-d tensor equal on every rank holding rows
      (replicated). Any other optimizer: on whole matrices (``matrix_params``) all its state,
      of any shape, saved whole by the owner; on row shards its element-wise state placed
      like the rows (see :mod:`matrixfsdp.state.optim_state_dict`). Frozen parameters have no
      state. State a fresh optimizer lacks is created first (``Muon.init_state``; for other
      optimizers a step with zero gradients and lr 0, as torch does), so it can be loaded into.

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
    for e in state_entries(model):
        if e.is_param:
            if id(e.tensor) not in shards:
                _placement(e.tensor, e.name)
                shards[id(e.tensor)] = RowShard.of_param(e.tensor, e.tensor)
            state[e.name] = shards[id(e.tensor)]
        elif e.tensor.is_meta:  # a model built on meta: DCP loads into a real tensor
            state[e.name] = torch.empty(e.tensor.shape, dtype=e.tensor.dtype,
                                        device=root.units[0].local.device)
        else:
            state[e.name] = e.tensor.detach()
    out: dict[str, Any] = {"model": state}
    if optimizers is not None:
        out["optim"] = optim_state_dict(as_list(optimizers), root)
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, skipped where ``src`` already is ``dst`` (loaded in place)."""
    if src.numel() and dst.data_ptr() == src.data_ptr() and dst.shape == src.shape \
            and dst.dtype == src.dtype and dst.stride() == src.stride():
        return
    dst.copy_(src)


@torch.no_grad()
def set_state_dict(model: nn.Module, optimizers: Optimizers | None, state: dict[str, Any], *,
                   strict: bool = True) -> None:
    """Load ``state`` (``{"model": ..., "optim": ...}``) into the model and the optimizers
    (one or a list, as given to :func:`get_state_dict`).

    Values may be the :class:`~matrixfsdp.tensors.row_shard.RowShard` s of :func:`get_state_dict` on this
    model (typically after ``dcp.load`` filled them; where they view the live tensors nothing
    is copied) or full tensors (as in ``torch.load`` of a file written by
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``): each rank keeps its
    rows. The optimizers' hyperparameters (lr, betas, ...) are restored from ``param_groups``,
    group by group in order (checked by parameter name where the names were saved); state is
    set where this rank steps the parameter (a whole matrix's, of any shape, on its owner,
    wherever it was saved) and dropped elsewhere. ``strict``: every name of
    ``model.state_dict()`` must be in ``state["model"]`` and nothing else. No communication.

    Raises ``ValueError`` naming the parameter on a missing or unexpected name, a shape, a
    placement made for another world size, or parameter groups that differ.
    """
    root = get_root(model)
    if "model" not in state:
        raise ValueError("matrixfsdp.set_state_dict: the state has no 'model' entry")
    _load_model(model, root, state["model"], strict)
    if optimizers is not None:
        if "optim" not in state:
            raise ValueError("matrixfsdp.set_state_dict: the state has no 'optim' entry")
        load_optim_state(as_list(optimizers), root, state["optim"], model)


def _load_model(model: nn.Module, root: Root, sd: dict[str, Any], strict: bool) -> None:
    entries = state_entries(model)
    if strict:
        check_names((e.name for e in entries), sd, "the state given to set_state_dict")
    loaded: set[int] = set()
    for e in entries:
        if e.name not in sd:
            continue
        value = sd[e.name]
        if e.is_param:
            src = local_piece(value, _placement(e.tensor, e.name),
                              sharded_param(e.tensor).shard_rank, f"parameter '{e.name}'")
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
