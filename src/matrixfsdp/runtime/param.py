"""One parameter under MatrixFSDP: where it lives and which unit moves it.

FSDP2 keeps an ``FSDPParam`` per parameter; this is ours. Every module that needs to know
something about a sharded parameter (the optimizer, clipping, checkpoints, init) asks
:func:`sharded_param` and reads the answer; nothing else reads attributes off tensors.

* a **sharded** parameter (what ``model.parameters()`` holds after ``fully_shard``) maps
  to its :class:`ShardedParam`: the plan's :class:`~matrixfsdp.layout.types.Placement`, its index
  in its unit, and the unit (whose ``root`` holds the groups, plan and counters);
* a parameter of a unit not sharded yet maps to that unit (:func:`waiting_for`).

Between backward and the optimizer step a shard's ``.grad`` is a :class:`ShardedGrad`: a
plain tensor in every respect but its norms. A norm of one gradient raises: it would be this
rank's piece only, which is how ``torch.nn.utils.clip_grad_norm_`` goes silently wrong. The
norms of a list of gradients (``torch._foreach_norm``, what ``get_total_norm(foreach=True)``
and torchtitan's ``clip_grad_norm_`` call) are FSDP2's: each a DTensor holding this rank's
piece's norm, placed ``_NormPartial`` over the model's ranks, so that ``full_tensor()`` (or
any arithmetic) gives the global norm, every element counted once. Every rank holds a
gradient of each parameter some rank has one for (empty where it holds nothing of it), so
such lists have one length on every rank. The step pre-hook hands the optimizer plain
tensors again.

Sharding keeps the ``nn.Parameter`` objects: each original becomes its shard (its data
rebound to a view of the unit's storage), so a parameter list read at any time is right.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from .._compat import FOREACH_NORM, norm_partial, plain_torch_function
from ..layout.types import Placement
from .tp import TPParam, TPSplit

_INFO = "_mf_param"  # on a shard: its ShardedParam
_WAITING_FOR = "_mf_waiting_for"  # on a parameter not sharded yet: the unit that will shard it


@dataclass(eq=False)
class ShardedParam:
    """What MatrixFSDP knows about one sharded parameter."""

    placement: Placement
    unit: Any  # its Unit (unit.py, which imports this file: typing it would close a circle)
    index: int  # in the unit's parameter list

    @property
    def name(self) -> str:
        """The fully qualified name under the root (the plan's name; tied ones share it)."""
        return self.placement.spec.name

    @property
    def root(self) -> Any:
        """The model's Root (None until the model is sharded)."""
        return self.unit.root

    @property
    def tp(self) -> TPParam | None:
        """Its tensor-parallel layout, or None."""
        return self.unit.tp_params[self.index] if self.unit.tp_params else None

    @property
    def tp_split(self) -> TPSplit | None:
        """A tp rank's slice of a Muon matrix its tp group owns (``tp_ownership="group"``):
        what its optimizer step needs (:class:`~matrixfsdp.runtime.tp.TPSplit`); else None."""
        pl, root = self.placement, self.unit.root
        if not pl.tp_group or root is None or root.tp is None:
            return None
        return TPSplit(pl.spec.shape, pl.spec.tp_dim, root.tp.step)

    @property
    def tp_replicated(self) -> bool:
        """Under tensor parallelism: whether every tp rank holds the same copy of this
        piece (a plain or ``Replicate`` parameter), rather than a piece of its own."""
        tp = self.tp
        return self.root.tp is not None and (tp is None or tp.shard_dim is None)

    @property
    def is_matrix(self) -> bool:
        """A Muon matrix (or expert stack), stepped whole where this rank holds it."""
        return self.placement.spec.muon

    def steps_here(self) -> bool:
        """Whether this rank's copy gets a gradient and is stepped (HSDP: a 2-D matrix only
        in the replica that owns it)."""
        return self.unit.domain.groups.steps_here(self.placement)

    @property
    def shard_rank(self) -> int:
        """This rank in the shard group of its unit's mesh (where its placement is read)."""
        return self.unit.domain.shard_rank


def sharded_param(p: Any) -> ShardedParam | None:
    """The :class:`ShardedParam` of a sharded parameter, None for any other tensor."""
    return getattr(p, _INFO, None)


def placement_of(p: Any) -> Placement | None:
    """Where a sharded parameter lives (None for any other tensor)."""
    info = getattr(p, _INFO, None)
    return info.placement if info is not None else None


def waiting_for(p: Any) -> Any:
    """The unit that will shard parameter ``p`` (None once sharded, or never)."""
    unit = getattr(p, _WAITING_FOR, None)
    return unit if unit is not None and unit.root is None else None


def root_of(p: Any) -> Any:
    """The Root of a sharded parameter's model (None for any other tensor)."""
    info = getattr(p, _INFO, None)
    return info.root if info is not None else None


def mark_waiting(p: torch.Tensor, unit: Any) -> None:
    setattr(p, _WAITING_FOR, unit)


def mark_sharded(p: torch.Tensor, info: ShardedParam) -> None:
    setattr(p, _INFO, info)


_REPLACED_BY = "_mf_replaced_by"  # on a DTensor parameter (TP): the shard that replaced it


def mark_replaced(p: torch.Tensor, shard: torch.Tensor) -> None:
    """``p`` (a tensor-parallel DTensor parameter) was replaced in the model by ``shard``."""
    setattr(p, _REPLACED_BY, shard)


def replaced_by(p: Any) -> torch.Tensor | None:
    """The shard that replaced DTensor parameter ``p`` at ``fully_shard`` (None otherwise)."""
    return getattr(p, _REPLACED_BY, None)


def unmark_sharded(p: torch.Tensor, unit: Any) -> None:
    """``p`` holds its full tensor again and waits for ``unit`` to shard it."""
    if hasattr(p, _INFO):
        delattr(p, _INFO)
    setattr(p, _WAITING_FOR, unit)


# torch's norm entry points (clip_grad_norm_ and get_total_norm use the first two).
_NORMS = frozenset({FOREACH_NORM, torch.linalg.vector_norm, torch.linalg.norm,
                    torch.linalg.matrix_norm, torch.norm, torch.Tensor.norm})
_USE_OURS = ("Use mf.clip_grad_norm_(model.parameters(), max_norm) or mf.total_grad_norm("
             "model.parameters()) (torch's signatures, the global norm, one all-reduce)")


class ShardedGrad(torch.Tensor):
    """The gradient of a sharded parameter, as backward leaves it: element-wise ops (scaling,
    ``clip_grad_value_``, ``zero_``) work as on any tensor and return plain tensors; the
    norm of one gradient raises, naming the parameter, the rank and the global-norm
    functions to use instead; the norms of a list (``torch._foreach_norm``) are partial
    DTensors whose reduction is the global norm (module docstring)."""

    param_name: str
    rank: int
    info: ShardedParam

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is FOREACH_NORM:
            return _partial_norms(*args, **kwargs)
        if func in _NORMS:
            grad = next(t for t in _tensors((*args, *kwargs.values()))
                        if isinstance(t, ShardedGrad))
            raise RuntimeError(
                f"matrixfsdp: a norm ({getattr(func, '__name__', func)}) over the gradient of "
                f"sharded parameter '{grad.param_name}' on rank {grad.rank} would see only "
                "this rank's piece of it, so torch.nn.utils.clip_grad_norm_ / get_total_norm "
                "would give each rank its own norm and clip by its own factor. "
                f"{_USE_OURS}; or pass foreach=True (a list's norms are partial DTensors, as "
                "FSDP2's); for this rank's local value, take p.grad.as_subclass(torch.Tensor) "
                "first")
        # a norm torch left a DTensor (clip_grads_with_norm_ on get_total_norm's result):
        # its value, the same on every rank
        args, kwargs = _replicated(args), {k: _replicated(v) for k, v in kwargs.items()}
        with plain_torch_function():
            return func(*args, **kwargs)


def _tensors(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _tensors(a)
        elif isinstance(a, torch.Tensor):
            yield a


def _replicated(a: Any) -> Any:
    """A DTensor that holds one value on every rank (``Replicate``), or a pending reduction
    (``Partial``: reduced now, a collective every rank makes at the same op), as that value."""
    if isinstance(a, (list, tuple)):
        return type(a)(_replicated(x) for x in a)
    if isinstance(a, DTensor) and all(isinstance(p, (Replicate, Partial)) for p in a.placements):
        return a.full_tensor()
    return a


_NORM_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> its mesh
_WORLD_RANKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> its ranks


def _world_ranks(root: Any) -> frozenset[int]:
    """The global ranks of the model's data-parallel group (every rank of its root mesh)."""
    ranks = _WORLD_RANKS.get(root)
    if ranks is None:
        ranks = _WORLD_RANKS[root] = frozenset(dist.get_process_group_ranks(root.groups.world))
    return ranks


def _norm_mesh(root: Any, device_type: str) -> DeviceMesh:
    """A 1-D mesh over every rank of the model's data-parallel group (its world group, HSDP's
    replicas included): where the partial norms reduce (under tensor parallelism, after
    :func:`_partial_norms` summed them over the tp group). Made once per model, from the
    group, no collective. Every rank joins the reduction, one that holds no element of any
    parameter included: each parameter some rank has a gradient for has one on every rank
    (an empty one where the rank holds nothing of it,
    :func:`~matrixfsdp.runtime.reduce.attach_grads`), so every rank's list has the same
    length and its norms are partial DTensors too.

    Expert parallelism: the experts' units have a mesh of their own inside the root's (each
    rank holds its own experts, whole or in rows, and no other rank holds them), so the
    root's ranks count every expert element once, as ``mf.clip_grad_norm_`` does; a unit
    whose mesh reaches ranks outside the root's is refused."""
    mesh = _NORM_MESHES.get(root)
    if mesh is None:
        world = _world_ranks(root)
        outside = [u.name for u in root.units if u.domain is not root.domains[0] and
                   not set(dist.get_process_group_ranks(u.domain.groups.world)) <= world]
        if outside:
            raise RuntimeError(f"matrixfsdp: the norms of gradients of unit '{outside[0]}', "
                               "whose mesh reaches ranks outside the model's root mesh, do not "
                               f"reduce over one group. {_USE_OURS}")
        mesh = _NORM_MESHES[root] = DeviceMesh.from_group(root.groups.world, device_type)
    return mesh


def _partial_norms(tensors, ord=2, dtype=None) -> list[torch.Tensor]:
    """``torch._foreach_norm`` over sharded gradients, as over FSDP2's: each norm a DTensor of
    this rank's piece's norm, placed ``_NormPartial(ord)`` over the model's ranks. A piece
    the model holds alike on several ranks counts once: HSDP's replicas of a row shard on
    replica 0 only, a tp-replicated piece (a plain or ``Replicate`` parameter under tensor
    parallelism) once over its tp group (:func:`_over_tp`); a matrix counts on the
    rank that steps it (elsewhere its gradient is empty, or under HSDP a copy of zeros).

    Gradients of several models (the parts of one pipeline stage's rank, each its own root:
    looped schedules) reduce together when their roots span the same ranks: one mesh, the
    first root's, carries them all, as FSDP2's parts share torchtitan's dp mesh."""
    grads = list(tensors)
    plain = next((g for g in grads if not isinstance(g, ShardedGrad)), None)
    if plain is not None:
        raise RuntimeError(
            f"matrixfsdp: the norms of a list mixing sharded and plain gradients (one of shape "
            f"{tuple(plain.shape)}): a plain gradient would count once per rank. {_USE_OURS}")
    if not grads:
        return []
    roots = {id(g.info.root): g.info.root for g in grads}
    first = grads[0].info.root
    if any(_world_ranks(r) != _world_ranks(first) for r in roots.values()):
        raise RuntimeError(f"matrixfsdp: the norms of gradients of several models on different "
                           f"ranks (e.g. '{grads[0].param_name}') do not reduce over one group. "
                           f"{_USE_OURS}")
    p = float(ord)
    if not p > 0:
        raise ValueError(f"matrixfsdp: norm_type must be > 0 or inf, got {ord}")
    # decided from the plan: alike everywhere. Every root's mesh is made (each checks that
    # no unit of it reaches outside its ranks); they reduce over the first root's
    meshes = [_norm_mesh(r, grads[0].device.type) for r in roots.values()]
    mesh = meshes[0]
    counted = [i for i, g in enumerate(grads) if g.numel() and g.info.steps_here() and (
        g.info.unit.domain.groups.replica == 0 or g.info.placement.owner is not None)]
    with plain_torch_function():
        some = FOREACH_NORM([grads[i].as_subclass(torch.Tensor) for i in counted], ord,
                            dtype=dtype) if counted else []  # a rank holding nothing: zeros
        norms = [torch.zeros((), dtype=dtype or g.dtype, device=g.device) for g in grads]
    for i, n in zip(counted, some):
        norms[i] = n
    for key, root in roots.items():  # each norm over its tp group first
        if root.tp is not None:
            mine = [i for i, g in enumerate(grads) if id(g.info.root) == key]
            tp = _over_tp(torch.stack([norms[i] for i in mine]), [grads[i] for i in mine],
                          root.tp, p)
            for i, n in zip(mine, tp.unbind()):
                norms[i] = n
    placement = norm_partial(p)
    return [DTensor.from_local(n, mesh, [placement], run_check=False) for n in norms]


def _over_tp(norms: torch.Tensor, grads: list, tp: Any, p: float) -> torch.Tensor:
    """Tensor parallelism: each of this rank's piece norms as the norm over its tp group's
    pieces (one all-reduce of the list over the tp group: every tp rank's list is alike),
    a piece every tp rank holds alike (a plain or ``Replicate`` parameter) counted once."""
    if math.isinf(p):
        dist.all_reduce(norms, op=dist.ReduceOp.MAX, group=tp.step.group)
        return norms
    powers = norms.pow(p)
    same = torch.tensor([g.info.tp_replicated for g in grads], device=norms.device)
    powers = torch.where(same, powers / tp.size, powers)
    dist.all_reduce(powers, op=dist.ReduceOp.SUM, group=tp.step.group)
    return powers.pow(1.0 / p)


def set_sharded_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Make ``grad`` the ``.grad`` of shard ``p``: a :class:`ShardedGrad` view of it where
    the mesh has more than one rank (on one rank a local norm is the global one)."""
    info = sharded_param(p)
    spread = info is not None and info.root is not None and (
        info.unit.domain.size > 1 or info.root.world_size > 1 or info.root.tp is not None)
    if spread and not isinstance(grad, ShardedGrad):
        grad = grad.as_subclass(ShardedGrad)
        grad.param_name, grad.rank = info.name, info.unit.domain.groups.world_rank
        grad.info = info
    p.grad = grad


def release_grads(params) -> None:
    """Before an optimizer step: each shard's ``.grad`` back to a plain tensor (same data)."""
    for p in params:
        if isinstance(p.grad, ShardedGrad):
            p.grad = p.grad.as_subclass(torch.Tensor)
