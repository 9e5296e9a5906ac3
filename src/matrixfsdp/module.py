"""FSDP2's module methods on every module given to ``fully_shard``.

As FSDP2 does, ``fully_shard`` swaps the module's class for a dynamic subclass of
(:class:`FSDPModule`, its class), so ``isinstance(model, mf.FSDPModule)`` holds and the
methods below have FSDP2's names and signatures. ``FSDPModule`` is our own class, not
torch's: torch's functions that see a ``torch.distributed.fsdp.FSDPModule`` read FSDP2's
internal state (DTensor parameters, param groups) that a MatrixFSDP module does not have.

Also here: :func:`register_fsdp_forward_method`, and the guard that refuses a submodule
of a unit called outside that unit's forward (its registered parameters are this rank's
shards: it would compute with the wrong rows).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from torch import nn

from .debug import FORWARD_GATHER
from .param import sharded_param

if TYPE_CHECKING:
    from .unit import Unit

_CLASSES: dict[type, type] = {}


class UnshardHandle:
    """What :meth:`FSDPModule.unshard` returns with ``async_op=True``: :meth:`wait` ends
    the gather and registers the unsharded parameters on the module."""

    def __init__(self, unit: Unit | None):
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            _finish_unshard(self._unit)
            self._unit = None


def _finish_unshard(unit: Unit) -> None:
    unit.unshard()
    unit.pinned = True
    unit._use_unsharded()


def _units(module: nn.Module, recurse: bool) -> list[Unit]:
    from .runtime import get_root
    get_root(module)  # shard now if the model was not sharded yet
    if not recurse:
        return [module._mf_unit]
    return [m._mf_unit for m in module.modules() if getattr(m, "_mf_unit", None) is not None]


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(
            f"matrixfsdp: {name}={value!r}: only True or False are supported (FSDP2's int, "
            "resharding to a smaller group after forward, is not implemented here)")


class FSDPModule:
    """Mixed into the class of every module given to ``fully_shard`` (FSDP2's methods)."""

    def __new__(cls, *args, **kwargs):
        # Containers build new instances of their own class (ModuleList slicing): build
        # the original class, as FSDP2 does.
        orig = cls.__mro__[2]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's unit (not recursive) and register its full parameters on
        the module until :meth:`reshard` (forward keeps them). ``async_op``: return an
        :class:`UnshardHandle` whose ``wait()`` ends the gather. A collective: every rank
        calls it."""
        unit = _units(self, False)[0]
        if async_op:
            unit.prefetch(FORWARD_GATHER)
            return UnshardHandle(unit)
        _finish_unshard(unit)
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and register the shards (not recursive)."""
        unit = _units(self, False)[0]
        unit.reshard()
        unit.register(unit.sharded)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: backward keeps the gradients unsharded and accumulating (in the reduce
        dtype) and issues no reduce; the first backward with True reduces them all."""
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        for u in _units(self, recurse):
            u.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free the unsharded parameters after forward (gather again in backward)."""
        _check_bool("reshard_after_forward", reshard_after_forward)
        for u in _units(self, recurse):
            u.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """False: keep the unsharded parameters after backward (no gather in the next
        forward). The optimizer step reshards them first (it changes the shards)."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        for u in _units(self, recurse):
            u.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 code; nothing to do: every backward here ends with its
        gradients reduced and in place (FSDP2 uses the flag to skip that wait)."""
        _check_bool("is_last_backward", is_last_backward)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """When this module's forward starts, start the gathers of ``modules`` too."""
        from .runtime import set_modules_to_forward_prefetch
        set_modules_to_forward_prefetch(self, modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """When this module's backward starts, start the gathers of ``modules`` too."""
        from .runtime import set_modules_to_backward_prefetch
        set_modules_to_backward_prefetch(self, modules)


def make_fsdp_module(module: nn.Module) -> None:
    """Swap ``module``'s class for the (FSDPModule, class) subclass, once."""
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _CLASSES[cls]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run like ``forward`` (FSDP2's function): its unit is
    gathered before and resharded after (per ``reshard_after_forward``), and its backward
    reduces the gradients. A no-op if ``module`` was not given to ``fully_shard``."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"matrixfsdp: {type(module).__name__} has no method {method_name!r}")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        from .runtime import _shard_at_first_use
        _shard_at_first_use(self, args)
        unit = self._mf_unit
        args, kwargs = unit.pre_forward(self, args, kwargs)
        return unit.post_forward(self, args, kwargs, orig(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))


class OutsideForwardGuard:
    """Forward pre-hook on a module holding parameters of ``unit`` (not the unit's own
    module): refuse a call while those are registered as shards."""

    def __init__(self, unit: Unit, module_name: str, attrs: list[tuple[str, int]]):
        self.unit, self.module_name, self.attrs = unit, module_name, attrs

    def __call__(self, module: nn.Module, args) -> None:
        import torch
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
