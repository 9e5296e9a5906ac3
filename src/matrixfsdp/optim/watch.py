"""Each optimizer over a sharded model's parameters, watched from its own step pre-hook.

Before an optimizer moves anything, :func:`watch`'s hook on it (``register_step_pre_hook``,
torch's per-optimizer hook) refuses what would silently differ from one process
(:mod:`~matrixfsdp.optim.policy`: a non-element-wise optimizer on row shards, a parameter
outside every unit, settings that differ between ranks) and then lets the root of each
model whose parameters it holds do the step's bookkeeping
(:meth:`~matrixfsdp.runtime.root.Root.before_optimizer_step`: unsharded copies dropped, a
caught failure recovered, HSDP's replicas marked, plain gradients). The optimizer also gets
torch's state-dict behaviour under FSDP2 (:mod:`~matrixfsdp.optim.state_dict_hooks`).

``matrixfsdp.Muon`` is watched when it is built. An optimizer that the user builds over
``model.parameters()`` (torch's AdamW, torchtitan's container) is invisible to this library
until it steps: torch offers no hook on an optimizer's construction, only its process-wide
registry of step pre-hooks. So ``matrixfsdp.fully_shard`` registers one hook there
(:func:`watch_new_optimizers`, once per process, at the first ``fully_shard``, never at
import), whose only work is to find such optimizers: at each step of an optimizer not
watched yet it asks whether the optimizer holds a sharded (or about to be sharded)
parameter and, if so, watches it, so its own hook runs in that same step (torch runs the
process-wide hooks first, then the optimizer's). An optimizer over other tensors is left
alone (a look at its parameters' attributes per step, until it holds one of ours).
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..runtime.param import replaced_by, sharded_param, waiting_for
from ..runtime.root import Root
from .policy import check_optimizer_first_step, check_optimizer_params, check_optimizer_step
from .state_dict_hooks import InitialState, install_optimizer_hooks

_WATCHED: weakref.WeakSet = weakref.WeakSet()  # optimizers with their step pre-hook
_discovery = None  # the handle of the process-wide hook, once fully_shard registered it


def watch(optimizer: torch.optim.Optimizer, *, checks_itself: bool = False,
          initial_state: InitialState | None = None) -> None:
    """Give ``optimizer`` its step pre-hook and state-dict hooks (once per optimizer).

    ``checks_itself``: its class validated its parameter groups when it was built
    (``matrixfsdp.Muon``: Muon on whole matrices, AdamW on row shards), so the policy checks
    are skipped; ``initial_state``: the first-step state of a parameter, for the state dicts
    of ranks that hold none of it (``matrixfsdp.Muon``'s)."""
    if optimizer in _WATCHED:
        return
    _WATCHED.add(optimizer)
    optimizer.register_step_pre_hook(_bookkeeping if checks_itself else _checked_bookkeeping)
    install_optimizer_hooks(optimizer, initial_state)


def _roots(optimizer: torch.optim.Optimizer) -> list[Root]:
    """The roots of the sharded models whose parameters ``optimizer`` holds, in order."""
    roots: dict[int, Root] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            info = sharded_param(p)
            if info is not None and info.root is not None:
                roots.setdefault(id(info.root), info.root)
    return list(roots.values())


def _bookkeeping(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for root in _roots(optimizer):
        root.before_optimizer_step(optimizer)


def _checked_bookkeeping(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    check_optimizer_params(optimizer)
    roots = _roots(optimizer)
    if roots:  # a torch optimizer: its settings compared across ranks, once
        check_optimizer_first_step(optimizer, roots[0])
    check_optimizer_step(optimizer)
    for root in roots:
        root.before_optimizer_step(optimizer)


def _holds_ours(optimizer: torch.optim.Optimizer) -> bool:
    return any(sharded_param(p) is not None or waiting_for(p) is not None
               or replaced_by(p) is not None
               for group in optimizer.param_groups for p in group["params"])


def _discover(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer not in _WATCHED and _holds_ours(optimizer):
        watch(optimizer)


def watch_new_optimizers() -> None:
    """Register the process-wide discovery hook (module docstring), once per process."""
    global _discovery
    if _discovery is None:
        _discovery = register_optimizer_step_pre_hook(_discover)
