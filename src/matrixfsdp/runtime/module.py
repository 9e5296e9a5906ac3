"""Units made, FSDP2's module methods, and the functions that find a model's root.

The runtime in FSDP2's shape, one concern a file:

* :mod:`~matrixfsdp.runtime.param`: what is known about one sharded parameter;
* :mod:`~matrixfsdp.runtime.storage`: a unit's storage and its data movement (unshard, reshard,
  copy-in, copy-out, reduce);
* :mod:`~matrixfsdp.runtime.unit`: a unit's hooks and the step's bookkeeping;
* :mod:`~matrixfsdp.runtime.root`: what a model's units share, and the end of backward;
* :mod:`~matrixfsdp.runtime.lazy_init`: collect, plan and shard all units at once;
* this file: :func:`make_unit`, which makes units and shards them when the root's call
  returns, FSDP2's module methods, and the look-ups the rest of the library uses.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ..diagnosis.debug import FORWARD_GATHER
from ..layout.planner import unit_members
from ..layout.report import format_report
from ..layout.types import Plan
from .collectives import CommStats
from .lazy_init import (
    check_apply,
    is_unit,
    module_unit,
    plan_and_shard,
    rebind_after_apply,
    undo_sharding,
    unit_modules,
)
from .mesh_checks import check_args
from .param import mark_waiting, sharded_param, waiting_for
from .root import Root
from .tp import refuse_compile_under_tp
from .unit import ShardOptions, Unit

_UNSHARDED_UNITS: list[weakref.ref] = []  # units made by fully_shard, not sharded yet


def _default_device_type() -> str:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator().type
    return "cpu"


def default_mesh() -> DeviceMesh:
    """All ranks, 1-D, on the current accelerator (or CPU)."""
    if not dist.is_initialized():
        raise ValueError("matrixfsdp: fully_shard needs torch.distributed initialised "
                         "or an explicit mesh")
    return init_device_mesh(_default_device_type(), (dist.get_world_size(),))


def _check_callable(module: nn.Module) -> None:
    if is_unit(module):
        raise ValueError(f"matrixfsdp: fully_shard was already called on this "
                         f"{type(module).__name__}")
    for name, p in module.named_parameters():
        info = sharded_param(p)
        if info is not None and not any(m is info.root.module for m in module.modules()):
            raise ValueError(
                f"matrixfsdp: fully_shard({type(module).__name__}) after its parameter '{name}' "
                f"was sharded as part of root '{type(info.root.module).__name__}', which this "
                "module does not contain. Call fully_shard on every block and then on the root")


def _make_root(unit: Unit) -> Root:
    global _UNSHARDED_UNITS
    for _, inner in unit_modules(unit.module):  # sharded as a root of its own before this call
        if inner.root is not None:
            undo_sharding(inner.root)
    root = plan_and_shard(unit)
    _UNSHARDED_UNITS = [r for r in _UNSHARDED_UNITS if r() is not None and r().root is None]
    return root


def make_unit(module: nn.Module, options: ShardOptions) -> nn.Module:
    """The runtime's half of ``matrixfsdp.fully_shard`` (the public function, in
    :mod:`matrixfsdp.fully_shard`, with the arguments' documentation): make ``module`` one
    unit, and, when this is the root's call, plan and shard every unit under it."""
    _check_callable(module)
    mesh = options.mesh or default_mesh()
    check_args(mesh, options.reshard_after_forward, options.offload_policy,
               options.independent_replicas, options.tp_ownership)
    unit = Unit(module, mesh, options)
    # in the module's own __dict__: a torch.compile wrapper's setattr would forward it to
    # the wrapped block (module_unit)
    module.__dict__["_mf_unit"] = unit
    make_fsdp_module(module)
    for mod, attr, _ in unit_members(module, "", is_unit):
        mark_waiting(mod._parameters[attr], unit)
    # Under ``module.compile()`` / ``torch.compile(module)`` the hooks run eagerly, as
    # FSDP2's do: the compiled graph is the module's forward alone, one per block, and the
    # gathers, parameter swaps and autograd bookkeeping stay plain Python (docs/compile.md).
    module.register_forward_pre_hook(torch.compiler.disable(unit.pre_forward), with_kwargs=True)
    module.register_forward_hook(torch.compiler.disable(unit.post_forward), with_kwargs=True)
    if any(isinstance(p, DTensor) for p in module.parameters()):  # runs second: traced
        module.register_forward_pre_hook(refuse_compile_under_tp, prepend=True)
    module.register_forward_pre_hook(torch.compiler.disable(_shard_at_first_use), prepend=True)
    _UNSHARDED_UNITS.append(weakref.ref(unit))
    if len(unit_modules(module)) > 1 and _outermost_pending(unit) is unit:
        _make_root(unit)  # an outer call: the root (FSDP2 shards at each call; we plan here)
    return module


def _shard_at_first_use(module: nn.Module, args) -> None:
    unit = module._mf_unit
    if unit.root is None:
        _make_root(_outermost_pending(unit))


def _outermost_pending(unit: Unit) -> Unit:
    """The outermost not-yet-sharded unit whose module contains ``unit``'s module."""
    best = unit
    for ref in _UNSHARDED_UNITS:
        other = ref()
        if other is not None and other.root is None and other is not best:
            if any(m is best.module for m in other.module.modules()):
                best = other
    return best


def get_root(module: nn.Module) -> Root:
    """The root of ``module``'s model (sharding it now if needed)."""
    unit = module_unit(module)
    if unit is None:
        raise ValueError(f"matrixfsdp: {type(module).__name__} is not a fully_shard unit; call "
                         "matrixfsdp.fully_shard on its blocks and then on it")
    if unit.root is None:
        _make_root(_outermost_pending(unit))
    return unit.root


def plan_of(module: nn.Module) -> Plan:
    return get_root(module).plan


def plan_report(module: nn.Module, max_rows: int = 32) -> str:
    """Who owns what: per rank, matrices owned, bytes held, NS cost, and the balance."""
    return format_report(plan_of(module), max_rows=max_rows)


def comm_stats(module: nn.Module) -> CommStats:
    """The :class:`~matrixfsdp.runtime.collectives.CommStats` counting this model's collectives."""
    return get_root(module).stats


def plan_params(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Shard the roots of any not-yet-sharded units these parameters belong to (the
    parameter objects stay the same: each becomes its shard)."""
    for p in params:
        unit = waiting_for(p)
        if unit is not None:
            _make_root(_outermost_pending(unit))
    return params


def _unit_of(module: nn.Module) -> Unit:
    unit = module_unit(module)
    if unit is None:
        raise ValueError(f"matrixfsdp: {type(module).__name__} is not a fully_shard unit")
    return unit


def set_modules_to_forward_prefetch(module: nn.Module, modules: list[nn.Module]) -> None:
    """When ``module``'s forward starts, start the gathers of ``modules`` too (FSDP2's
    method of that name, as a function). All are ``fully_shard`` units of one model. The
    default, without a call: the unit that ran next in the previous step's forward."""
    _unit_of(module).forward_prefetch = [_unit_of(m) for m in modules]


def set_modules_to_backward_prefetch(module: nn.Module, modules: list[nn.Module]) -> None:
    """When ``module``'s backward starts, start the gathers of ``modules`` too. The
    default: the unit that ran before it in the previous step's forward."""
    _unit_of(module).backward_prefetch = [_unit_of(m) for m in modules]


# ---- FSDP2's module methods -----------------------------------------------------------
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
    unit.pin()
    unit._use_unsharded()


def _units(module: nn.Module, recurse: bool) -> list[Unit]:
    get_root(module)  # shard now if the model was not sharded yet
    if not recurse:
        return [module._mf_unit]
    return [module_unit(m) for m in module.modules() if is_unit(m)]


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

    def _apply(self, fn, recurse: bool = True):
        """torch's ``Module._apply`` (``to_empty``, ``.to``, ``.float()``, ``.cpu()``, ...), as
        under FSDP2: the shards are registered first; a move or cast to another device or
        dtype than the shards' is refused before anything moves; afterwards every parameter
        torch replaced views this library's storage again (a meta-built model, then
        ``to_empty(device)``, is materialised: its own init or a seed checkpoint fills it)."""
        unit = module_unit(self)
        if unit is None or unit.root is None:  # not sharded (yet): torch's own
            return super()._apply(fn, recurse)
        unit.reshard()
        unit.register(unit.sharded)
        check_apply(unit, fn)
        out = super()._apply(fn, recurse)
        rebind_after_apply(unit)
        return out

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
            u.reshard_after_forward, u.reshard_default = reshard_after_forward, False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """False: keep the unsharded parameters after backward (no gather in the next
        forward). The optimizer step reshards them first (it changes the shards)."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        for u in _units(self, recurse):
            u.reshard_after_backward = reshard_after_backward

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """How many units' gradient send buffers may be in flight at once (FSDP2's dial,
        default 1): before a unit's gradients are copied into a new buffer, the oldest
        reduces are finished until fewer than this remain. One cap for the whole model,
        as FSDP2's: the largest any unit was given."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) \
                or max_input_buffers < 1:
            raise ValueError("matrixfsdp: set_reduce_scatter_max_input_buffers("
                             f"{max_input_buffers!r}): an int >= 1")
        for u in _units(self, recurse):
            u.max_input_buffers = max_input_buffers
            if u.root is not None:
                u.root.schedule.max_reduces = max(
                    v.max_input_buffers or 1 for v in u.root.units)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's summed gradients by ``factor`` instead of averaging them
        over its mesh (FSDP2's method, not recursive: torchtitan passes the whole
        data-parallel degree for experts, whose tokens come from every rank). Under HSDP
        the sum runs over both dims before the division."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"matrixfsdp: set_gradient_divide_factor({factor!r}): a positive number")
        _units(self, False)[0].divide_factor = float(factor)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 code; nothing to do: every backward here ends with its
        gradients reduced and in place (FSDP2 uses the flag to skip that wait)."""
        _check_bool("is_last_backward", is_last_backward)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """When this module's forward starts, start the gathers of ``modules`` too."""
        set_modules_to_forward_prefetch(self, modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """When this module's backward starts, start the gathers of ``modules`` too."""
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
        _shard_at_first_use(self, args)
        unit = self._mf_unit
        args, kwargs = unit.pre_forward(self, args, kwargs)
        return unit.post_forward(self, args, kwargs, orig(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))
