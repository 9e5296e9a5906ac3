"""What an optimizer may do with a sharded model's parameters, decided before it moves anything.

* :func:`check_optimizer_params`: an optimizer holding shards and also a trainable parameter
  outside every unit (its gradient is this rank's alone), or a tensor-parallel DTensor that
  ``fully_shard`` replaced.
* :func:`check_optimizer_step`: an optimizer that is not element-wise stepping row shards
  (it would treat this rank's rows as the whole tensor); :func:`register_elementwise` adds a
  class to the allow-list.
* :func:`check_same_optimizer` / :func:`check_optimizer_first_step`: an optimizer's
  settings alike on every rank (at construction, or at the first step of one this library
  did not build).

:func:`~matrixfsdp.optim.watch.watch` runs them from each optimizer's step pre-hook.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..diagnosis.agree import OPTIONAL, check_same_setup
from ..runtime.checks import coverage_flags
from ..runtime.param import replaced_by, root_of, sharded_param
from ..runtime.root import Root


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


# ---- the optimizer step: element-wise optimizers only on row shards ---------------------
# Optimizers whose update of each element reads only that element's gradient and state
# (plus scalars equal on every rank): exact on a row shard. (matrixfsdp.Muon checks its own
# groups: AdamW on row shards, Muon on whole matrices.)
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
                    f"matrixfsdp: {type(optimizer).__name__} is not on matrixfsdp's element-wise "
                    f"allow-list, and parameter '{pl.spec.name}' {pl.spec.shape} is sharded by rows "
                    f"over the ranks: an optimizer that reads more than each element's own values "
                    f"would step it from this rank's piece {tuple(p.shape)} as if it were the whole "
                    "tensor and differ from one process. Give it "
                    "matrixfsdp.matrix_params(model) (the whole matrices this rank owns) and an "
                    "element-wise optimizer (AdamW, SGD, ...) matrixfsdp.shard_params(model), or "
                    "use matrixfsdp.Muon; if this class is element-wise (as heavyball's AdamW or "
                    "a Lion are), declare it: matrixfsdp.register_elementwise(its class)")


# ---- settings alike on every rank -----------------------------------------------------------

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
            mats = _matrices(group["params"])
            if mats is not None:  # first: it says why the parameter lists below differ
                items.append((f"param group {i} Muon matrices ({_COMPLEMENT})", mats))
            names = [info.name if (info := sharded_param(p)) is not None else tuple(p.shape)
                     for p in group["params"]]
            items.append((f"param group {i} parameters", names))
    return items


_COMPLEMENT = ("each is an empty placeholder on the ranks that do not own it, so a group built "
               "on the complement of mf.matrix_params(model) differs from rank to rank: build "
               "it on mf.shard_params(model), the same list on every rank")


def _matrices(params: list[torch.Tensor]) -> str | None:
    """Which of the model's Muon matrices ``params`` holds: "all", or "all but [...]", the
    same on every rank whose list holds the same ones (None: it holds none)."""
    infos = [info for p in params if (info := sharded_param(p)) is not None and info.is_matrix]
    if not infos:
        return None
    every = [n for n, pl in infos[0].root.plan.placements.items() if pl.spec.muon]
    missing = sorted(set(every) - {info.name for info in infos})
    return "all" if not missing else f"all but {missing}"


_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers compared across ranks already
# root -> settings of optimizers built by hand on matrix_params and stepped since the last
# comparison (compared with the next optimizer a collective check runs for)


_BY_HAND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _root_of_optimizer(optimizer: torch.optim.Optimizer) -> Root | None:
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
                         root: Root | None = None) -> None:
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


def _check_first_step(optimizer: torch.optim.Optimizer, root: Root) -> None:
    """:func:`check_same_optimizer` at ``optimizer``'s first step, with whether each rank
    steps the matrices it owns (:func:`~matrixfsdp.runtime.checks.coverage_flags`) in the
    same all-reduce: settled there if every rank stepped one of its own, else judged at the
    next forward (:meth:`~matrixfsdp.runtime.root.Root.judged_matrix_coverage`)."""
    items = _BY_HAND.pop(root, []) + optimizer_setup(optimizer)
    seen = check_same_setup(items, root.groups.world, f"the {type(optimizer).__name__} optimizer",
                            any_of=coverage_flags(root.matrix_coverage()))
    _CHECKED.add(optimizer)
    root.judged_matrix_coverage(seen)


def check_optimizer_first_step(optimizer: torch.optim.Optimizer, root: Root) -> None:
    """An optimizer this library did not build and nobody checked (torch's AdamW over
    ``model.parameters()`` or ``mf.shard_params``): compared across ranks at its first step,
    before it moves anything, by the step pre-hook of ``root`` (the root of its first sharded
    parameter). That one step issues the check's small all-reduce; ``check_optimizer`` after
    construction moves it out of the step.

    One built by hand on ``matrix_params`` issues no collective of its own: a rank that
    owns no matrix has none to step (``matrix_optimizer`` gives it a placeholder instead),
    and such a rank steps nothing of it, so training is exact either way. Its settings
    (class, group count, options) are compared, among the ranks that have it, with the next
    optimizer this hook checks (typically the AdamW on ``shard_params`` stepped after it),
    which also settles, or leaves to the next forward, whether every rank steps the
    matrices it owns."""
    if optimizer in _CHECKED:
        return
    found = _root_of_optimizer(optimizer)
    if found is None:
        _CHECKED.add(optimizer)  # over no sharded parameter: nothing to compare, ever
    elif found is root and on_matrix_params(optimizer) and root.world_size > 1:
        name = f"{OPTIONAL}{type(optimizer).__qualname__} (on matrix_params)"
        _BY_HAND.setdefault(root, []).extend(
            (f"{name} {key}", value) for key, value in optimizer_setup(optimizer, False))
        _CHECKED.add(optimizer)
    elif found is root:
        _check_first_step(optimizer, root)
