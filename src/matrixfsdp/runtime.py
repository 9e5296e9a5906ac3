"""``fully_shard``: units, their sharded storage, and the hooks that move parameters.

One :class:`Unit` per ``fully_shard`` call. The unit owns:

* ``local``: this rank's segment of the unit's flat buffer (1-D). The parameters
  registered on the modules (what ``model.parameters()`` and the optimizer see) are views
  into it: whole Muon matrices on their owner, row slices of even parameters everywhere.
* ``flat`` / ``even``: the unsharded buffers. ``flat`` is the rank-major gather target;
  whole matrices are views into it, the other parameters are copied out into ``even``.
  Resharding frees both storages (``resize_(0)``) and keeps the tensor objects, so the
  tensors autograd saved in forward are refilled in place by the backward gather.

Lifecycle of one training step, per unit::

    pre-forward   gather-v (if resharded), swap unsharded params onto the modules
    post-forward  swap sharded params back, free unsharded storage if resharding
    pre-backward  gather-v again (if it was freed)             [hook on the outputs]
    post-backward reduce-v grads to where the params live, free [autograd fn on inputs]
    end of backward: any unit whose post-backward did not fire runs it now, in a fixed
    order, so every rank issues the same collectives in the same order.

Planning is done once for all units, when the root is first used (forward,
``muon_param_groups``, ``Muon``, ``plan_report``, ``full_state_dict``): FSDP2 likewise
finds its root lazily. The root is the outermost unit; it contains every other one.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .comm import CommStats, gather_v, reduce_v
from .layout import UnitLayout, unit_layout
from .plan import MuonFilter, ParamSpec, Plan, is_muon_matrix, make_plan, unit_members

_PENDING: list[weakref.ref] = []  # units created by fully_shard and not planned yet


def _default_device_type() -> str:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator().type
    return "cpu"


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def _tensors_requiring_grad(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors_requiring_grad(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors_requiring_grad(x)]
    return []


def _replace_tensors(obj: Any, new: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return new.get(id(obj), obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_replace_tensors(x, new) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace_tensors(x, new) for x in obj)
    if isinstance(obj, dict):
        return {k: _replace_tensors(v, new) for k, v in obj.items()}
    return obj


def _alias(storage_owner: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor on ``storage_owner``'s storage with a version counter of its own.

    The gather writes into ``storage_owner`` in place between forward and backward; a
    plain view would share its version counter and autograd would reject the saved
    tensors, while the data it reads is exactly the data it saved.
    """
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    t = torch.empty(0, dtype=storage_owner.dtype, device=storage_owner.device)
    return t.set_(storage_owner.untyped_storage(), offset, shape, stride)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, unit: Unit, *inputs: torch.Tensor):
        ctx.unit = unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.unit.post_backward()
        return (None, *grads)


class Root:
    """State shared by all units of one model: the plan, the group, the counters."""

    def __init__(self, module: nn.Module, units: list[Unit], plan: Plan, mesh: DeviceMesh):
        self.module = module
        self.units = units  # pre-order: the root unit first
        self.plan = plan
        self.mesh = mesh
        self.group = mesh.get_group()
        self.rank = dist.get_rank(self.group)
        self.world_size = mesh.size()
        self.stats = CommStats()
        self._callback_queued = False

    def queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        for unit in reversed(self.units):
            if unit.in_graph and not unit.post_backward_done:
                unit.post_backward()
        for unit in self.units:
            unit.in_graph = unit.pre_backward_done = unit.post_backward_done = False
            unit.reshard()
        self._callback_queued = False


class Unit:
    """One communication unit: the parameters of one ``fully_shard`` call."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool | None,
                 muon_filter: MuonFilter | None):
        self.module = module
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.muon_filter = muon_filter
        self.root: Root | None = None
        self.name = ""
        # filled by _materialize
        self.refs: list[tuple[nn.Module, str]] = []
        self.layout: UnitLayout | None = None
        self.sharded: list[nn.Parameter] = []
        self.unsharded: list[nn.Parameter] = []
        self.local = self.flat = self.even = None
        self._even_index: dict[int, int] = {}  # parameter index -> offset in ``even``
        self.needs_init = False  # built on meta: shards allocated, not yet initialised
        # per-step flags
        self.is_unsharded = False
        self.in_graph = self.pre_backward_done = self.post_backward_done = False

    # ---- parameter movement -------------------------------------------------------------
    @torch.no_grad()
    def unshard(self) -> None:
        if self.is_unsharded:
            return
        root, lay = self.root, self.layout
        for buf in (self.flat, self.even):
            nbytes = buf.numel() * buf.element_size()
            if buf.untyped_storage().size() != nbytes:
                buf.untyped_storage().resize_(nbytes)
        if lay.numel:  # a unit may hold no parameter of its own (all in child units)
            gather_v(self.local, self.flat, lay.seg_sizes, root.group, root.stats)
        # Copy-out into ``even`` itself: writing through the unsharded parameters would
        # bump the version counters autograd checks.
        for i, offset in self._even_index.items():
            spec = lay.placements[i].spec
            dst = self.even[offset:offset + spec.numel].view(spec.rows, spec.row_numel)
            for pc in lay.pieces[i]:
                dst[pc.row_start:pc.row_stop].view(-1).copy_(
                    self.flat[pc.offset:pc.offset + pc.numel])
        self.is_unsharded = True

    def reshard(self) -> None:
        if not self.is_unsharded:
            return
        for buf in (self.flat, self.even):
            buf.untyped_storage().resize_(0)
        self.is_unsharded = False

    def _register(self, params: list[nn.Parameter]) -> None:
        for (mod, attr), p in zip(self.refs, params):
            mod._parameters[attr] = p

    # ---- hooks ----------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        root = self.root or _materialize(_outermost_pending(self))
        if self.root is None:
            raise RuntimeError(f"matrixfsdp: unit '{type(module).__name__}' was not planned; "
                               "its root module was planned without it")
        if root.units[0] is self and torch.is_grad_enabled():
            for u in root.units:
                u.pre_backward_done = u.post_backward_done = False
        if self.needs_init:
            raise RuntimeError(f"matrixfsdp: unit '{self.name}' was built on the meta device and "
                               "its shards are not initialised; call matrixfsdp.init_weights(model)")
        self.unshard()
        self._register(self.unsharded)
        if torch.is_grad_enabled():
            tensors = _tensors_requiring_grad((args, kwargs))
            if tensors:
                outs = _PostBackward.apply(self, *tensors)
                outs = outs if isinstance(outs, tuple) else (outs,)
                new = {id(t): o for t, o in zip(tensors, outs)}
                args, kwargs = _replace_tensors((args, kwargs), new)
        return args, kwargs

    def _post_forward(self, module, args, kwargs, output):
        self._register(self.sharded)
        outs = _tensors_requiring_grad(output) if torch.is_grad_enabled() else []
        for t in outs:
            t.register_hook(self._pre_backward_hook)
        self.in_graph = self.in_graph or bool(outs)
        if self.reshard_after_forward or not outs:
            self.reshard()
        return output

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        if self.pre_backward_done:
            return
        self.pre_backward_done = True
        self.root.queue_final_callback()
        self.unshard()

    @torch.no_grad()
    def post_backward(self) -> None:
        if self.post_backward_done:
            return
        self.post_backward_done = True
        grads = [p.grad for p in self.unsharded]
        for p in self.unsharded:
            p.grad = None
        if all(g is None for g in grads):
            self.reshard()
            return
        root, lay = self.root, self.layout
        if any(g is None for g in grads):
            full = self.flat.new_zeros(lay.numel)
        else:
            full = self.flat.new_empty(lay.numel)
        for i, g in enumerate(grads):
            if g is None:
                continue
            g2 = g.reshape(g.shape[0], -1) if g.dim() else g.reshape(1, 1)
            for pc in lay.pieces[i]:
                full[pc.offset:pc.offset + pc.numel].view(pc.row_stop - pc.row_start, -1).copy_(
                    g2[pc.row_start:pc.row_stop])
        self.reshard()  # the unsharded params are not needed any more
        out = self.local.new_empty(self.local.numel())
        reduce_v(full, out, lay.seg_sizes, root.group, root.stats)
        offset = 0
        for i, pc in lay.local_pieces(root.rank):
            p = self.sharded[i]
            view = out[offset:offset + pc.numel].view(p.shape)
            offset += pc.numel
            if p.grad is None:
                p.grad = view
            else:
                p.grad.add_(view)


def _is_unit(m: nn.Module) -> bool:
    return getattr(m, "_mf_unit", None) is not None


def _owned_params(module: nn.Module, prefix: str) -> list[tuple[nn.Module, str, str]]:
    return unit_members(module, prefix, _is_unit)


def _outermost_pending(unit: Unit) -> Unit:
    """The outermost not-yet-planned unit whose module contains ``unit``'s module."""
    best = unit
    for ref in _PENDING:
        other = ref()
        if other is not None and other.root is None and other is not best:
            if any(m is best.module for m in other.module.modules()):
                best = other
    return best


def _unit_modules(root_module: nn.Module) -> list[tuple[str, Unit]]:
    return [(name, m._mf_unit) for name, m in root_module.named_modules()
            if getattr(m, "_mf_unit", None) is not None]


def _materialize(root_unit: Unit) -> Root:
    """Plan all units under ``root_unit`` at once and shard their parameters."""
    mesh = root_unit.mesh
    P = mesh.size()
    rank = mesh.get_local_rank()
    device = _mesh_device(mesh)
    named_units = _unit_modules(root_unit.module)
    units = [u for _, u in named_units]
    for name, u in named_units:
        u.name = name or "<root>"
        if u.root is not None:
            raise ValueError(f"matrixfsdp: unit '{name}' was already planned as part of another root")
        if u.mesh is not mesh and (u.mesh.mesh.tolist() != mesh.mesh.tolist()
                                   or u.mesh.device_type != mesh.device_type):
            raise ValueError(f"matrixfsdp: unit '{name}' uses a different mesh than the root "
                             f"({u.mesh} vs {mesh}); one model needs one mesh")
    root_unit.reshard_after_forward = bool(root_unit.reshard_after_forward)
    for u in units[1:]:
        u.reshard_after_forward = True if u.reshard_after_forward is None else u.reshard_after_forward
    muon_filter = root_unit.muon_filter

    # Collect and check parameters, per unit.
    seen: dict[int, str] = {}
    specs: list[ParamSpec] = []
    originals: list[list[nn.Parameter]] = []
    for ui, (uname, u) in enumerate(named_units):
        prefix = f"{uname}." if uname else ""
        refs = _owned_params(u.module, prefix)
        u.refs = [(m, a) for m, a, _ in refs]
        params = [m._parameters[a] for m, a, _ in refs]
        originals.append(params)
        first = None
        for (mod, _, fqn), p in zip(refs, params):
            if id(p) in seen:
                raise NotImplementedError(
                    f"matrixfsdp: parameter '{fqn}' is the same tensor as '{seen[id(p)]}' (tied "
                    "or shared parameters are not supported yet); untie them before fully_shard")
            seen[id(p)] = fqn
            if not p.is_floating_point():
                raise ValueError(f"matrixfsdp: parameter '{fqn}' has dtype {p.dtype}; only "
                                 "floating-point parameters can be sharded")
            if first is None:
                first = (fqn, p)
            elif p.dtype != first[1].dtype or p.device != first[1].device:
                raise ValueError(
                    f"matrixfsdp: unit '{u.name}' mixes parameters '{first[0]}' "
                    f"({first[1].dtype}, {first[1].device}) and '{fqn}' ({p.dtype}, {p.device}); "
                    "all parameters of one unit need the same dtype and device")
            is_muon = is_muon_matrix(fqn, p, mod, ui == 0, muon_filter)
            if is_muon and p.dim() != 2:
                raise ValueError(f"matrixfsdp: muon_filter selected parameter '{fqn}' of shape "
                                 f"{tuple(p.shape)}; Muon needs 2-D parameters")
            specs.append(ParamSpec(fqn, tuple(p.shape), p.element_size(), ui, is_muon))
    plan = make_plan(specs, P, [u.name for u in units])
    root = Root(root_unit.module, units, plan, mesh)

    for ui, u in enumerate(units):
        lay = unit_layout(plan, ui)
        u.layout, u.root = lay, root
        params = originals[ui]
        dtype = params[0].dtype if params else torch.float32
        with torch.no_grad():
            u.local = torch.empty(lay.seg_sizes[rank], dtype=dtype, device=device)
            u.flat = torch.empty(lay.numel, dtype=dtype, device=device)
            u._even_index, even_numel = {}, 0
            for i, p in enumerate(params):
                if not lay.whole_on_one_rank(i):
                    u._even_index[i] = even_numel
                    even_numel += p.numel()
            u.even = torch.empty(even_numel, dtype=dtype, device=device)
            # A model built on the meta device gets uninitialised shards on the mesh device,
            # filled later by ``matrixfsdp.init_weights``: no rank ever holds the full model.
            u.needs_init = any(p.device.type == "meta" for p in params)
            offset = 0
            for i, pc in lay.local_pieces(rank):
                if not u.needs_init:
                    src = params[i].detach().reshape(params[i].shape[0] if params[i].dim() else 1, -1)
                    u.local[offset:offset + pc.numel].copy_(src[pc.row_start:pc.row_stop].reshape(-1))
                offset += pc.numel
        u.sharded, u.unsharded = [], []
        local_offsets = {i: 0 for i in range(len(params))}
        offset = 0
        for i, pc in lay.local_pieces(rank):
            local_offsets[i] = offset
            offset += pc.numel
        for i, (p, pl) in enumerate(zip(params, lay.placements)):
            shape = pl.local_shape(rank)
            n = math.prod(shape)
            sp = nn.Parameter(u.local[local_offsets[i]:local_offsets[i] + n].view(shape),
                              requires_grad=p.requires_grad)
            sp._mf_placement = pl
            sp._mf_unit = u
            u.sharded.append(sp)
            if i in u._even_index:
                full = _alias(u.even, u._even_index[i], tuple(p.shape))
            else:
                start = lay.pieces[i][0].offset if lay.pieces[i] else 0
                full = _alias(u.flat, start, tuple(p.shape))
            up = nn.Parameter(full, requires_grad=p.requires_grad)
            u.unsharded.append(up)
            p._mf_replaced = sp
        u._register(u.sharded)
        u.flat.untyped_storage().resize_(0)
        u.even.untyped_storage().resize_(0)
        for name, buf in list(u.module.named_buffers()):
            if buf.device != device and buf.device.type != "meta":
                raise ValueError(f"matrixfsdp: buffer '{name}' of unit '{u.name}' is on "
                                 f"{buf.device}, the mesh on {device}; move the model first")
    global _PENDING
    _PENDING = [r for r in _PENDING if r() is not None and r().root is None]
    return root


def fully_shard(module: nn.Module, *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | None = None,
                muon_filter: MuonFilter | None = None) -> nn.Module:
    """Make ``module`` one communication unit, like FSDP2's ``fully_shard``.

    Call it on every block, bottom-up, then on the root. The unit holds the module's
    parameters that no child unit holds. All units are planned together when the root is
    first used: Muon matrices (by default the 2-D weights inside the non-root units, except
    embeddings) go whole to one owner rank each; all other parameters are split by rows
    over the ranks.

    Args:
        mesh: a 1-D device mesh over the data-parallel ranks (default: all ranks on the
            current accelerator, or CPU).
        reshard_after_forward: free the unsharded parameters after forward and gather
            them again in backward. None: True for blocks, False for the root.
        muon_filter: ``(fqn, param) -> bool`` deciding which parameters are Muon matrices;
            read from the root call. FQNs are relative to the root module.
    Returns:
        ``module``, with its parameters replaced by this rank's shards once planned.
    """
    if getattr(module, "_mf_unit", None) is not None:
        raise ValueError(f"matrixfsdp: fully_shard was already called on this "
                         f"{type(module).__name__}")
    for name, m in module.named_modules():
        u = getattr(m, "_mf_unit", None)
        if u is not None and u.root is not None:
            raise ValueError(
                f"matrixfsdp: fully_shard({type(module).__name__}) after submodule "
                f"'{name}' was already planned as part of root '{type(u.root.module).__name__}' "
                "(the model was used, or an optimizer built, before this call). Call "
                "fully_shard on every block and then on the root before anything else")
    if mesh is None:
        if not dist.is_initialized():
            raise ValueError("matrixfsdp: fully_shard needs torch.distributed initialised "
                             "or an explicit mesh")
        mesh = init_device_mesh(_default_device_type(), (dist.get_world_size(),))
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"matrixfsdp: fully_shard needs a 1-D mesh, got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)}; HSDP (2-D meshes) is not supported yet")
    unit = Unit(module, mesh, reshard_after_forward, muon_filter)
    module._mf_unit = unit
    for mod, attr, _ in _owned_params(module, ""):
        mod._parameters[attr]._mf_pending = unit
    module.register_forward_pre_hook(unit._pre_forward, with_kwargs=True)
    module.register_forward_hook(unit._post_forward, with_kwargs=True)
    _PENDING.append(weakref.ref(unit))
    return module


def get_root(module: nn.Module) -> Root:
    """The planned root of ``module`` (planning it now if needed)."""
    unit = getattr(module, "_mf_unit", None)
    if unit is None:
        raise ValueError(f"matrixfsdp: {type(module).__name__} is not a fully_shard unit; call "
                         "matrixfsdp.fully_shard on its blocks and then on it")
    if unit.root is None:
        _materialize(_outermost_pending(unit))
    return unit.root


def plan_of(module: nn.Module) -> Plan:
    return get_root(module).plan


def plan_params(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plan the roots of any not-yet-planned units these parameters belong to, and map
    each original parameter to the sharded one that replaced it (others pass through)."""
    for p in params:
        unit = getattr(p, "_mf_pending", None)
        if unit is not None and unit.root is None:
            _materialize(_outermost_pending(unit))
    return [getattr(p, "_mf_replaced", p) for p in params]
