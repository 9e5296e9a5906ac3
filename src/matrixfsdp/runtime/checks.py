"""Set-up checks: silent divergence caught before the first step.

* :func:`check_same_init`: ranks whose models were initialised differently (another seed)
  would each shard their own values, and training would mix them silently. One small
  all-gather of two int64 digests per parameter finds the first parameter that differs;
  ``sync=True`` broadcasts rank 0's values instead. Runs on the full (unsharded) tensors,
  so at ``fully_shard`` time, before the shards are cut. Meta tensors (a model built on the
  meta device and initialised by ``matrixfsdp.init_weights``) are skipped.
* :func:`check_unsharded_trainable` / :func:`check_optimizer_params`: a trainable parameter
  outside every unit (a module added after ``fully_shard``) gets no gradient reduce, so each
  rank would train its own copy.
* :func:`check_same_setup` / :func:`check_same_optimizer`: the model's shapes, dtypes,
  buffers and mixed-precision policies, and an optimizer's settings, alike on every rank
  (compared once at set-up; a checkpoint's names are checked by ``state/entries.py``).
* :func:`agree_on_local_checks`: what one rank's own checks found (a unit of mixed dtypes
  on that rank only) raised on every rank of the mesh, naming the rank, before the first
  collective that rank would miss.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_gather_object
from .param import replaced_by, root_of, sharded_param
from .unit import Unit

_SHOWN = 5


def _digest(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the bits of ``t`` (all elements; every other element), on its
    device: equal tensors give equal digests, differently seeded ones differ."""
    flat = t.detach().contiguous().view(-1)
    nbytes = flat.numel() * flat.element_size()
    bits = flat.view(torch.uint8)
    if nbytes % 4 == 0:
        bits = bits.view(torch.int32)
    elif nbytes % 2 == 0:
        bits = bits.view(torch.int16)
    return torch.stack([bits.sum(dtype=torch.int64), bits[1::2].sum(dtype=torch.int64)])


def check_same_init(named_params: Iterable[tuple[str, torch.Tensor]], group: Any = None, *,
                    sync: bool = False) -> int:
    """Raise ``ValueError`` on every rank of ``group`` (default: the world) naming the first
    parameter whose initial values differ between ranks; with ``sync=True`` copy rank 0's
    values into every rank's tensors instead (a broadcast per parameter). Meta tensors are
    skipped. A collective (two tiny all-gathers: the count, then ``2 x P`` int64 digests).
    Returns the number of parameters compared (or synced).

    Call it on the full tensors before sharding, e.g. ``check_same_init(
    model.named_parameters(), mesh_world_group)``.
    """
    named = [(n, p) for n, p in named_params if not p.is_meta]
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or not named:
        return len(named)
    if sync:
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for _, p in named:
                dist.broadcast(p.data, src=src, group=group)
        return len(named)
    device = named[0][1].device
    world = dist.get_world_size(group)
    count = torch.tensor([len(named)], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    if len({int(c) for c in counts}) > 1:
        raise ValueError("matrixfsdp: ranks hold different numbers of parameters at set-up ("
                         + ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(counts))
                         + "); every rank must build the same model")
    mine = torch.stack([_digest(p) for _, p in named])
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    for i, (name, _) in enumerate(named):
        differ = [r for r in range(1, world) if not torch.equal(rows[r][i], rows[0][i])]
        if differ:
            raise ValueError(
                f"matrixfsdp: parameter '{name}' differs between ranks at set-up (ranks "
                f"{differ} hold other initial values than rank 0): seed every rank alike before "
                "building the model (torch.manual_seed), load the same weights everywhere, or "
                "ask for rank 0's values to be copied to every rank (sync=True)")
    return len(named)


def check_unsharded_trainable(model: nn.Module, unsharded: set[int] = frozenset()) -> None:
    """Raise ``ValueError`` naming a trainable parameter of the sharded ``model`` that no
    unit holds (a module added or a parameter replaced after ``fully_shard``): its gradient
    would never be averaged over the ranks, so each rank would train its own copy.
    ``unsharded``: ids of the units' unsharded parameters (registered while a unit is
    gathered, e.g. between ``unshard()`` and ``reshard()``), which are the units' own."""
    for name, p in model.named_parameters():
        if p.requires_grad and sharded_param(p) is None and id(p) not in unsharded:
            raise ValueError(
                f"matrixfsdp: parameter '{name}' {tuple(p.shape)} is trainable but belongs to no "
                "MatrixFSDP unit (added after fully_shard?): its gradient would not be averaged "
                "over the ranks and each rank would train its own copy. Build the whole model "
                "before fully_shard, or freeze it (requires_grad_(False))")


def _name_of(p: torch.Tensor, hint: torch.Tensor | None) -> str:
    root = root_of(hint) if hint is not None else None
    if root is not None:
        for name, q in root.module.named_parameters():
            if q is p:
                return f"'{name}' {tuple(p.shape)}"
    return f"of shape {tuple(p.shape)}"


def check_optimizer_params(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``ValueError`` if ``optimizer`` steps MatrixFSDP shards and also a trainable
    parameter outside every unit (its gradient is this rank's alone). Optimizers over no
    shard at all are not MatrixFSDP's business and pass."""
    shard, outside = None, None
    for group in optimizer.param_groups:
        for p in group["params"]:
            if replaced_by(p) is not None:
                raise ValueError(
                    f"matrixfsdp: {type(optimizer).__name__} holds a tensor-parallel DTensor "
                    f"parameter {tuple(p.shape)} that fully_shard replaced by its shard (as "
                    "FSDP2 replaces every parameter): it would never be stepped. Build the "
                    "optimizer after fully_shard")
            if sharded_param(p) is not None:
                shard = shard if shard is not None else p
            elif p.requires_grad and outside is None:
                outside = p
    if shard is not None and outside is not None:
        raise ValueError(
            f"matrixfsdp: {type(optimizer).__name__} holds parameter {_name_of(outside, shard)}, "
            "which belongs to no MatrixFSDP unit (added after fully_shard?): its gradient is "
            "not averaged over the ranks, so each rank would train its own copy. Build the "
            "whole model before fully_shard")


class OutsideForwardGuard:
    """Forward pre-hook on a module holding parameters of ``unit`` (not the unit's own
    module): refuse a call while those are registered as shards."""

    def __init__(self, unit: Unit, module_name: str, attrs: list[tuple[str, int]]):
        self.unit, self.module_name, self.attrs = unit, module_name, attrs

    def __call__(self, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling():
            return  # inside a compiled block: its unit's hooks ran (eagerly) already
        unit = self.unit
        for attr, i in self.attrs:
            p = module._parameters.get(attr)
            if p is not None and p is unit.sharded[i]:
                info = sharded_param(p)
                raise RuntimeError(
                    f"matrixfsdp: {type(module).__name__} '{self.module_name}' was called "
                    f"outside the forward of its unit '{unit.name}': its parameter "
                    f"'{info.name}' is this rank's shard (shape {tuple(p.shape)} of "
                    f"{tuple(info.placement.spec.shape)}) and would give wrong results. Call it "
                    "from the model's forward, or register the method that calls it with "
                    "matrixfsdp.register_fsdp_forward_method(unit_module, 'method'), or "
                    "gather around the call: unit_module.unshard() ... unit_module.reshard()")


def guard_unit(unit: Unit) -> None:
    """Install :class:`OutsideForwardGuard` on every module holding ``unit``'s parameters
    other than the unit's own module (which gathers in its own forward hook)."""
    by_module: dict[int, tuple[nn.Module, list[tuple[str, int]]]] = {}
    for (mod, attr), i in zip(unit.refs, unit.ref_param):
        if mod is not unit.module:
            by_module.setdefault(id(mod), (mod, []))[1].append((attr, i))
    for mod, attrs in by_module.values():
        name = sharded_param(unit.sharded[attrs[0][1]]).name.rpartition(".")[0]
        unit.guards.append(mod.register_forward_pre_hook(OutsideForwardGuard(unit, name, attrs)))


def unguard_unit(unit: Unit) -> None:
    for h in unit.guards:
        h.remove()
    unit.guards.clear()


# ---- the optimizer step: element-wise optimizers only on row shards ---------------------
# Optimizers whose update of each element reads only that element's gradient and state
# (plus scalars equal on every rank): exact on a row shard. matrixfsdp.Muon registers itself.
_ELEMENTWISE: set[type] = {
    getattr(torch.optim, n) for n in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax",
                                      "NAdam", "RAdam", "ASGD", "Rprop", "SparseAdam")
    if hasattr(torch.optim, n)}
# Optimizers that read every parameter at once (L-BFGS: dot products over all of them).
_GLOBAL: tuple[type, ...] = (torch.optim.LBFGS,)


def register_elementwise(cls: type) -> type:
    """Declare ``cls`` (a ``torch.optim.Optimizer`` subclass) element-wise, so that it may
    step row shards: each element's update reads only that element's gradient and state
    and scalars equal on every rank. Returns ``cls`` (usable as a class decorator).
    Classes are matched exactly: a subclass of an element-wise class is not assumed to be
    one (it may override ``step``), register it too."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_elementwise takes a torch.optim.Optimizer subclass, got {cls!r}")
    _ELEMENTWISE.add(cls)
    return cls


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s class is on the element-wise allow-list."""
    return type(optimizer) in _ELEMENTWISE


def check_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``RuntimeError`` if ``optimizer`` would step a MatrixFSDP row shard as if it
    were the whole tensor: an optimizer not on the element-wise allow-list (see
    :func:`register_elementwise`) holding a trainable parameter that the plan spreads over
    several ranks (an even row shard, or an expert stack split by experts), or L-BFGS on any
    sharded parameter at world size > 1. Called before the step moves anything.

    Decided from placements and ``requires_grad`` only (never from gradients, which only
    owners hold), so every rank holding the same optimizer raises alike. Whole matrices on
    their owners (:func:`matrix_params`) are fine for any optimizer."""
    if is_elementwise(optimizer):
        return
    glob = isinstance(optimizer, _GLOBAL)
    for group in optimizer.param_groups:
        for p in group["params"]:
            info = sharded_param(p)
            if info is None or not p.requires_grad or not info.placement.spec.numel:
                continue
            pl = info.placement
            world = len(pl.row_ranges) * info.unit.domain.groups.replicas
            if glob and world > 1:
                raise RuntimeError(
                    f"matrixfsdp: {type(optimizer).__name__} reads all parameters at once, but "
                    f"parameter '{pl.spec.name}' {pl.spec.shape} is spread over {world} ranks: it "
                    f"would compute from this rank's piece {tuple(p.shape)} and differ from one "
                    "process. Use matrixfsdp.Muon, or any optimizer on matrixfsdp.matrix_params")
            if not glob and not pl.whole_on_one_rank:
                raise RuntimeError(
                    f"matrixfsdp: {type(optimizer).__name__} is not an element-wise optimizer, and "
                    f"parameter '{pl.spec.name}' {pl.spec.shape} is sharded by rows over the ranks: "
                    f"it would step it from this rank's piece {tuple(p.shape)} as if it were the "
                    "whole tensor and differ from one process. Give it "
                    "matrixfsdp.matrix_params(model) (the whole matrices this rank owns) and an "
                    "element-wise optimizer (AdamW, SGD, ...) matrixfsdp.shard_params(model), or "
                    "use matrixfsdp.Muon; if this class is element-wise, "
                    "matrixfsdp.register_elementwise(it)")


# ---- set-up that must be the same on every rank -----------------------------------------
def _shown(value: Any) -> str:
    return str(value).replace("torch.", "")


_OPTIONAL = "matrix optimizer "  # items a rank may lack (a rank that owns no matrix)


def agree_on_local_checks(problem: Exception | None, mesh: Any) -> None:
    """Raise, on every rank of ``mesh``, the first error (lowest rank) that a rank's own
    set-up checks found (``problem`` on this rank, None if none): the same type and
    message everywhere, naming that rank. One all-gather per mesh dim, at set-up only.
    Before, the rank that found it raised alone and the others went on into the next
    collective, where they saw "Connection closed by peer"."""
    if not dist.is_initialized() or mesh.size() == 1:
        if problem is not None:
            raise problem
        return
    found = {dist.get_rank(): (type(problem).__name__, str(problem))} if problem is not None else {}
    for dim in range(mesh.ndim):  # every rank of the mesh: along one dim, then the next
        merged: dict[int, tuple[str, str]] = {}
        for seen in all_gather_object(found, mesh.get_group(dim)):
            merged.update(seen)
        found = merged
    if not found:
        return
    rank = min(found)
    kind, text = found[rank]
    error = {"ValueError": ValueError, "NotImplementedError": NotImplementedError,
             "TypeError": TypeError}.get(kind, RuntimeError)
    raise error(f"{text} (found on rank {rank} of the mesh {mesh.mesh.tolist()}; every rank of it "
                "raises this)") from problem


def check_same_setup(items: list[tuple[str, Any]], group: Any, what: str) -> None:
    """Raise ``ValueError`` on every rank of ``group`` naming the first of ``items``
    (``(description, value)``, in the same order on every rank) whose value differs
    between ranks, with each rank's value; ``what`` says what was set up ("the model",
    "the Muon optimizer"). Items whose description starts with "matrix optimizer " are
    compared among the ranks that have them (an optimizer over ``matrix_params``, which a
    rank owning no matrix may not have). One gather of the list: call it once, at
    set-up, never in a step. Values must compare with ``==`` (no tensors)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    every = all_gather_object(items, group)
    keys = [dict(ranks_items) for ranks_items in every]
    mine = dict(items)
    for key in dict.fromkeys(k for ranks_items in every for k, _ in ranks_items):
        values = [k.get(key, "(missing)") for k in keys]
        have = [v for v in values if not (key.startswith(_OPTIONAL) and v == "(missing)")]
        if any(v != have[0] for v in have):
            by_value: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(_shown(v), []).append(r)
            seen = "; ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} "
                             f"{', '.join(map(str, rs))}" for v, rs in by_value.items())
            raise ValueError(f"matrixfsdp: ranks set up {what} differently: {key}: {seen}. Every "
                             "rank must build the same model and optimizer"
                             + ("" if key in mine else " (this rank lacks it)"))


def model_setup(named_params: list[tuple[str, torch.Tensor]], module: nn.Module,
                units: list[tuple[str, Any]], buffer_values: bool = True) -> list[tuple[str, Any]]:
    """What must agree across ranks before a model is sharded: each parameter's shape,
    dtype and ``requires_grad``, each persistent buffer's shape, dtype and (unless
    ``buffer_values`` is False: they are about to be copied from rank 0) values, as a
    digest, and each unit's mixed-precision policy; in the model's order."""
    items: list[tuple[str, Any]] = []
    for name, p in named_params:
        items += [(f"parameter '{name}' shape", tuple(p.shape)),
                  (f"parameter '{name}' dtype", p.dtype),
                  (f"parameter '{name}' requires_grad", p.requires_grad)]
    for prefix, mod in module.named_modules():
        for attr, b in mod._buffers.items():
            if b is None or attr in mod._non_persistent_buffers_set:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            items += [(f"buffer '{name}' shape", tuple(b.shape)), (f"buffer '{name}' dtype", b.dtype)]
            if buffer_values and not b.is_meta:  # a few values as they are, more as a digest
                items.append((f"buffer '{name}' values", tuple(b.flatten().tolist())) if b.numel() <= 8
                             else (f"buffer '{name}' values (digest)", tuple(_digest(b).tolist())))
    for name, policy in units:
        items.append((f"unit '{name}' mixed precision policy", repr(policy)))
    return items


def sync_buffers(module: nn.Module, group: Any) -> None:
    """Copy rank 0's persistent buffers into every rank's (``sync_module_states=True``, as
    DDP's ``broadcast_buffers``): one broadcast per buffer."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for mod in module.modules():
            for attr, b in mod._buffers.items():
                if b is not None and attr not in mod._non_persistent_buffers_set and not b.is_meta:
                    dist.broadcast(b, src=src, group=group)


def _comparable(value: Any) -> Any:
    """A setting as every rank can compare it: numbers, strings, dtypes and tuples as they
    are, tensors as numbers, callables by name, anything else by its repr."""
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(_comparable(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if callable(value):
        return getattr(value, "__qualname__", type(value).__qualname__)
    return repr(value)


def optimizer_setup(optimizer: torch.optim.Optimizer, with_params: bool = True) -> list[tuple[str, Any]]:
    """An optimizer's settings, group by group: its class, its number of param groups,
    every option of every group (tensors as numbers) and, with ``with_params``, each
    group's parameters by name."""
    items: list[tuple[str, Any]] = [("optimizer class", type(optimizer).__qualname__),
                                    ("param groups", len(optimizer.param_groups))]
    for i, group in enumerate(optimizer.param_groups):
        for key in sorted(k for k in group if k not in ("params", "param_names")):
            value = group[key]
            items.append((f"param group {i} {key}", _comparable(value)))
        if with_params:
            names = [info.name if (info := sharded_param(p)) is not None else tuple(p.shape)
                     for p in group["params"]]
            items.append((f"param group {i} parameters", names))
    return items


_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers compared across ranks already
# root -> settings of optimizers built by hand on matrix_params and stepped since the last
# comparison (compared with the next optimizer a collective check runs for)
_BY_HAND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _root_of_optimizer(optimizer: torch.optim.Optimizer) -> Any:
    return next((info.root for g in optimizer.param_groups for p in g["params"]
                 if (info := sharded_param(p)) is not None), None)


def on_matrix_params(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds only whole Muon matrices this rank steps (one built on
    ``matrix_params``: its parameter lists differ between ranks by design, and a rank that
    owns no matrix may build none)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    infos = [sharded_param(p) for p in params]
    return bool(params) and all(
        i is not None and i.is_matrix and not i.placement.spec.is_experts and p.numel()
        and p.numel() == i.placement.spec.numel and i.steps_here() for p, i in zip(params, infos))


def check_same_optimizer(optimizer: torch.optim.Optimizer, with_params: bool = True,
                         root: Any = None) -> None:
    """Raise on every rank if ``optimizer``'s settings differ between the ranks of the
    model its parameters belong to (``root``, found from them if not given): one small
    collective, at construction, never in a step. Nothing to check for an optimizer over
    no sharded parameter. An optimizer on ``matrix_params`` is compared by its settings
    (class, group count, options), not by its parameters, which differ per rank.
    ``matrixfsdp.check_optimizer`` is this function."""
    root = root if root is not None else _root_of_optimizer(optimizer)
    if root is not None:
        items = optimizer_setup(optimizer, with_params and not on_matrix_params(optimizer))
        check_same_setup(_BY_HAND.pop(root, []) + items, root.groups.world,
                         f"the {type(optimizer).__name__} optimizer")
    _CHECKED.add(optimizer)


def check_optimizer_first_step(optimizer: torch.optim.Optimizer, root: Any) -> None:
    """An optimizer this library did not build and nobody checked (torch's AdamW over
    ``model.parameters()`` or ``mf.shard_params``): compared across ranks at its first step,
    before it moves anything, by the step pre-hook of ``root`` (the root of its first sharded
    parameter). That one step issues the check's small gather; ``check_optimizer`` after
    construction moves it out of the step.

    One built by hand on ``matrix_params`` issues no collective of its own: a rank that
    owns no matrix has none to step (``matrix_optimizer`` gives it a placeholder instead),
    and such a rank steps nothing of it, so training is exact either way. Its settings
    (class, group count, options) are compared, among the ranks that have it, with the next
    optimizer this hook checks (typically the AdamW on ``shard_params`` stepped after it)."""
    if optimizer in _CHECKED:
        return
    found = _root_of_optimizer(optimizer)
    if found is None:
        _CHECKED.add(optimizer)  # over no sharded parameter: nothing to compare, ever
    elif found is root and on_matrix_params(optimizer) and root.world_size > 1:
        name = f"{_OPTIONAL}{type(optimizer).__qualname__} (on matrix_params)"
        _BY_HAND.setdefault(root, []).extend(
            (f"{name} {key}", value) for key, value in optimizer_setup(optimizer, False))
        _CHECKED.add(optimizer)
    elif found is root:
        check_same_optimizer(optimizer, root=root)
