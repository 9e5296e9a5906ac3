"""Any optimizer under MatrixFSDP: whole matrices on their owners, element-wise on shards.

Every Muon matrix lives whole on one owner rank, whose gradient is the full average over
ranks, so *any* optimizer that updates each matrix on its own (Shampoo, SOAP, NorMuon,
AdaMuon, Adafactor, ``torch.optim.Muon``) runs on the owner exactly as on one process, with
no communication:

* :func:`matrix_params`: the whole 2-D matrices this rank steps;
* :func:`shard_params`: this rank's trainable row shards (everything else), for an
  element-wise optimizer (AdamW, SGD, ...), the only kind that is exact on a row's slice;
* :func:`matrix_optimizer`: builds the optimizer on :func:`matrix_params`; on a rank that
  owns no matrix it gets one empty placeholder instead (no gradient, so every optimizer
  skips it), so user code needs no special case and the param groups (hyperparameters,
  group-level step counters) stay alike on every rank;

An optimizer that is not element-wise, given row shards, is refused before its step moves
anything (:func:`~matrixfsdp.optim.policy.check_optimizer_step`, from its step pre-hook).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..runtime.module import get_root
from ..runtime.param import placement_of, sharded_param
from .policy import check_same_optimizer

# Placeholders matrix_optimizer hands a rank that owns no matrix: id -> weak reference (a
# WeakSet would compare tensors with ==).
_PLACEHOLDERS: dict[int, weakref.ref] = {}


def is_placeholder(p: torch.Tensor) -> bool:
    """Whether ``p`` is the empty stand-in :func:`matrix_optimizer` gives a rank owning no matrix."""
    ref = _PLACEHOLDERS.get(id(p))
    return ref is not None and ref() is p


def matrix_params(model: nn.Module) -> list[nn.Parameter]:
    """The whole 2-D matrices this rank steps: the trainable Muon matrices it owns (under
    HSDP: owns in its replica and steps), in plan order. Each is the full ``(m, n)`` matrix,
    whose ``.grad`` after backward is the full gradient averaged over ranks, so any
    per-matrix optimizer on them is exact. Possibly empty (see :func:`matrix_optimizer`).

    Expert stacks ``(experts, m, n)`` are split by experts over the ranks, so an optimizer
    that treats a 3-D tensor as one (SOAP, Shampoo) would differ from one process: refused
    with a ``ValueError`` naming the stack (step them with ``matrixfsdp.Muon``, which
    treats each expert as its own matrix); so is a matrix its tp group owns (each tp rank
    holds a slice: ``tp_ownership="group"``)."""
    out = []
    for unit in get_root(model).units:
        for p in unit.sharded:
            info = sharded_param(p)
            spec = info.placement.spec
            if not (spec.muon and p.requires_grad):
                continue
            if spec.is_experts:
                raise ValueError(
                    f"matrixfsdp.matrix_params: '{spec.name}' {spec.shape} is an expert stack, "
                    "split by experts over the ranks; a matrix optimizer would precondition "
                    "this rank's slice as one tensor. Step expert stacks with matrixfsdp.Muon")
            if info.placement.tp_group:
                raise ValueError(
                    f"matrixfsdp.matrix_params: '{spec.name}' {spec.shape} is owned by its tp "
                    f"group, each tp rank holding a slice of it (tp_ownership=\"group\"); a "
                    "matrix optimizer would step one slice as a matrix. Shard with "
                    "tp_ownership=\"rank\" (each matrix whole on one rank), or step it with "
                    "matrixfsdp.Muon, which runs its Newton-Schulz over the group")
            if info.steps_here() and p.numel():
                out.append(p)
    return out


def shard_params(model: nn.Module) -> list[nn.Parameter]:
    """This rank's trainable row shards: every trainable parameter that is not a Muon
    matrix (the same list, in plan order, on every rank; a rank holding no rows of one
    holds an empty tensor, which optimizers skip). Give them an element-wise optimizer."""
    return [p for unit in get_root(model).units for p in unit.sharded
            if p.requires_grad and not placement_of(p).spec.muon]


def matrix_optimizer(cls: Callable[..., torch.optim.Optimizer], model: nn.Module,
                     **kwargs: Any) -> torch.optim.Optimizer:
    """``cls(matrix_params(model), **kwargs)``, on every rank alike.

    A rank that owns no matrix gets ``cls([placeholder], **kwargs)``: the same optimizer
    class with one empty ``(0, 0)`` parameter that never has a gradient, so its ``step``
    changes nothing while its param groups keep the same keys and group-level counters as
    every other rank's (lr schedulers, ``zero_grad`` and :func:`matrixfsdp.get_state_dict`
    work unchanged). ``cls`` may be any callable taking the parameter list first, e.g.
    ``lambda ps, **kw: NorMuon([dict(params=ps, use_muon=True)], **kw)``.

    An owner's gradient is a view into its unit's flat buffer, at any element offset; BLAS
    kernels (matmul, eigh) may round differently on a buffer that is not 64-byte aligned
    (measured: 1.2e-7 on pytorch-optimizer's Shampoo's first step), so before each step the
    optimizer gets an aligned copy of such a gradient (:func:`align_grads`, a step pre-hook):
    the step is then bit for bit the one-process step."""
    params = matrix_params(model)
    if not params:
        device = get_root(model).units[0].local.device
        placeholder = nn.Parameter(torch.empty(0, 0, device=device))
        key = id(placeholder)
        _PLACEHOLDERS[key] = weakref.ref(placeholder, lambda _: _PLACEHOLDERS.pop(key, None))
        params = [placeholder]
    optimizer = cls(params, **kwargs)
    # owners hold different matrices (a rank owning none, a placeholder): settings only
    check_same_optimizer(optimizer, with_params=False, root=get_root(model))
    optimizer.register_step_pre_hook(lambda opt, args, kw: align_grads(opt))
    return optimizer


_ALIGN = 64  # bytes: what torch's CPU allocator (and CUDA's, 256) hands out at least


def align_grads(optimizer: torch.optim.Optimizer) -> None:
    """Replace each gradient of ``optimizer``'s parameters that does not start on a 64-byte
    boundary by an aligned copy (one matrix-sized copy each; aligned ones are untouched)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is not None and g.numel() and g.data_ptr() % _ALIGN:
                p.grad = g.clone(memory_format=torch.contiguous_format)
