"""Initialisation of a model's units: collect their parameters, plan them all at once,
shard each unit.

Runs when the root's ``fully_shard`` returns, or at the first use of a model whose root
could not be told apart from a block (``fully_shard`` called on one module only). Each
original ``nn.Parameter`` object *becomes* its shard (its data is rebound to a view of the
unit's storage), so every parameter list, whenever it was read (an optimizer built before
or after ``fully_shard``, ``clip_grad_norm_(model.parameters())``), holds the shards.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .._compat import root_mesh
from ..diagnosis.agree import check_same_setup
from ..layout.planner import Collected, collect_params, make_plan
from ..layout.types import MuonFilter, Plan
from ..layout.units import unit_layout
from .checks import (
    agree_on_local_checks,
    check_same_init,
    guard_unit,
    model_setup,
    sync_buffers,
    unguard_unit,
)
from .collectives import CommStats
from .domain import Domain, mesh_device
from .hsdp import MeshGroups
from .mesh_checks import sliced_from_named_world
from .mixed_precision import Precision
from .param import (
    ShardedParam,
    mark_replaced,
    mark_sharded,
    mark_waiting,
    set_sharded_grad,
    unmark_sharded,
)
from .root import Root
from .storage import UnitStorage
from .tp import TPGroups, check_tp_mesh, global_placement, slice_shape, tp_param, tp_spec
from .unit import Unit


def module_unit(m: nn.Module) -> Unit | None:
    """The unit ``fully_shard`` made of ``m`` itself (None otherwise), read from ``m``'s own
    ``__dict__``: a ``torch.compile(block)`` wrapper forwards attribute look-ups to the
    block it wraps, so ``getattr`` would find one unit on both, twice in one model."""
    return m.__dict__.get("_mf_unit")


def is_unit(m: nn.Module) -> bool:
    return module_unit(m) is not None


def unit_modules(root_module: nn.Module) -> list[tuple[str, Unit]]:
    return [(name, module_unit(m)) for name, m in root_module.named_modules() if is_unit(m)]


def _collect(named_units: list[tuple[str, Unit]], muon_filter: MuonFilter | None) -> Collected:
    """The units' parameters through the planner's one collector (:func:`plan.collect_params`:
    tied tensors once, the same checks as ``matrixfsdp plan``), each unit told where its
    parameters are registered and the TP layout of each (DTensor parameters: planned as
    :func:`~matrixfsdp.runtime.tp.tp_spec` says)."""
    collected = collect_params([(n, u.module) for n, u in named_units], is_unit, muon_filter)
    specs = iter(collected.specs)
    out_specs = []
    for (_, u), refs, params in zip(named_units, collected.refs, collected.params):
        u.refs = [(mod, attr) for mod, attr, _ in refs]
        u.ref_param = [i for _, _, i in refs]
        u.tp_params = []
        for p in params:
            spec = next(specs)
            info = tp_param(spec.name, p)
            u.tp_params.append(info)
            out_specs.append(tp_spec(spec, info))
    collected.specs = out_specs
    return collected


def _tp_mesh(units: list[Unit], specs: list, mesh: DeviceMesh) -> DeviceMesh | None:
    """The one tensor-parallel mesh of the model (None without TP): that of its tp-split
    matrices and of any DTensor parameter whose mesh reaches ranks outside the root's
    ``mesh`` (a tp-sharded embedding: its pieces differ across tp ranks that no unit
    averages over). An expert-parallel mesh lies inside the root's dp x ep mesh. Every
    DTensor parameter's mesh must be orthogonal to its unit's."""
    inside = set(mesh.mesh.flatten().tolist())
    meshes = {}
    spec = iter(specs)
    for u in units:
        for info in u.tp_params:
            split = next(spec).tp > 1
            if info is None or info.mesh.size() == 1:
                continue
            check_tp_mesh(info.mesh, u.mesh)
            if split or not set(info.mesh.mesh.flatten().tolist()) <= inside:
                meshes.setdefault(_mesh_key(info.mesh), info.mesh)
    if len(meshes) > 1:
        raise NotImplementedError(
            "matrixfsdp: the model's tensor-parallel parameters live on several tp meshes "
            f"({list(meshes.values())}); one tensor-parallel mesh per model is supported")
    return next(iter(meshes.values()), None)


def shard_unit(u: Unit, ui: int, params: list[nn.Parameter], root: Root,
               device: torch.device, sync: bool = False) -> None:
    """Give unit ``u`` its storage, its unsharded parameters, and turn each original
    parameter into this rank's shard (registered at every place it was).

    A parameter on another device than the mesh's (a model built on CPU) is copied into
    the shard from where it is: only this rank's rows cross, FSDP2's one-call-at-a-time
    set-up at a finer grain. With ``sync`` (``sync_module_states``) the unit's parameters
    first move to the mesh's device for rank 0's broadcast, one unit alive at a time."""
    T, tp_rank = (root.tp.size, root.tp.rank) if root.tp else (1, 0)
    u.layout, u.root = unit_layout(u.domain.plan, ui, T, tp_rank), root
    dtype = params[0].dtype if params else torch.float32
    u.precision = Precision.resolve(u.mp_policy, dtype)
    u.storage = UnitStorage(u.layout, u.domain.shard_rank, dtype, u.precision, device, root.tp)
    # A model built on the meta device gets uninitialised shards on the mesh device,
    # filled later by ``matrixfsdp.init_weights``: no rank ever holds the full model.
    u.needs_init = any(p.device.type == "meta" for p in params)
    if not u.needs_init:
        values = [to_device(p, device) for p in params] if sync else params
        if sync:  # rank 0's values, over the unit's own domain (the experts' differ across ep)
            check_same_init([(f"{u.name}[{i}]", v.to_local() if isinstance(v, DTensor) else v)
                             for i, v in enumerate(values)], u.domain.groups.world, sync=True)
        u.storage.copy_in(values)
        del values  # a unit's moved copies die here, before the next unit moves
    u.sharded, u.unsharded = [], []
    for i, (p, info) in enumerate(zip(params, u.tp_params)):
        view = u.storage.unsharded_view(i)
        up = nn.Parameter(view, requires_grad=p.requires_grad) if info is None else \
            info.wrap(view, p.requires_grad)  # TP: forward sees the plan's DTensor
        empty = not p.numel()
        if info is None:
            rebind(p, u.storage.shard_view(i))  # the original object is the shard from now on
        else:  # a DTensor cannot become a plain tensor: the shard is a new object (FSDP2's way)
            shard = nn.Parameter(u.storage.shard_view(i), requires_grad=p.requires_grad)
            mark_replaced(p, shard)
            p = shard
        if empty:  # nothing to reduce: its empty grad goes to the shard
            up.register_post_accumulate_grad_hook(_EmptyGradToShard(p))
        u.unsharded.append(up)
        mark_sharded(p, ShardedParam(global_placement(u.layout.placements[i], info), u, i))
        u.sharded.append(p)
    u.register(u.sharded)
    guard_unit(u)  # a submodule called outside its unit's forward raises (never wrong rows)
    for name, buf in u.module.named_buffers():
        if buf.device != device and buf.device.type != "meta":
            raise ValueError(f"matrixfsdp: buffer '{name}' of unit '{u.name}' is on "
                             f"{buf.device}, the mesh on {device}; move the model first")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The one place set-up moves a tensor of the model to the mesh's device (a copy when
    it is elsewhere; the tensor itself otherwise): parameters and buffers that are not
    sharded here, and a unit's parameters under ``sync_module_states``."""
    if t.device == device or t.is_meta or isinstance(t, DTensor):
        return t.detach()
    return t.detach().to(device)


@torch.no_grad()
def move_buffers(module: nn.Module, device: torch.device) -> None:
    """FSDP2's rule for what it does not shard: ``module``'s buffers on another device than
    the mesh's (a model built on CPU, sharded over a CUDA mesh) move there, each object kept
    (``torch.utils.swap_tensors``: a reference taken before still sees it); meta tensors
    (initialised later, on the mesh's device) and DTensors (on their own mesh) stay. The
    parameters move one unit at a time, into their shards (:func:`shard_unit`)."""
    for t in module.buffers():
        moved = to_device(t, device)
        if moved.device != t.device:
            info = dict(t.__dict__)
            torch.utils.swap_tensors(t, moved)
            t.__dict__.update(info)


def rebind(p: nn.Parameter, data: torch.Tensor) -> None:
    """Make parameter object ``p`` hold ``data`` (a view kept as is), gradient cleared.
    ``.data`` cannot move a tensor off the meta device, so the tensors are swapped."""
    with torch.no_grad():
        p.grad = None
        if p.device == data.device:
            p.data = data
        else:
            info = dict(p.__dict__)
            torch.utils.swap_tensors(p, nn.Parameter(data, requires_grad=p.requires_grad))
            p.__dict__.update(info)


def check_apply(unit: Unit, fn) -> None:
    """Before torch's ``Module._apply`` (``to_empty``, ``.to``, ``.float()``, ...) on a
    sharded unit: refuse, before anything moves, a function that would move the shards to
    another device or dtype than the unit's storage (probed on an empty slice of it);
    ``to_empty`` or ``.to`` onto the device and dtype they have is rebound afterwards by
    :func:`rebind_after_apply`."""
    local = unit.storage.local
    try:
        probe = fn(local[:0])
    except Exception:  # noqa: BLE001 (a function that cannot take the probe: torch's own error follows)
        return
    if isinstance(probe, torch.Tensor) and (probe.device != local.device or probe.dtype != local.dtype):
        raise ValueError(
            f"matrixfsdp: unit '{unit.name}' is sharded in {local.dtype} on {local.device}; "
            f"moving or casting it to {probe.dtype} on {probe.device} after fully_shard is not "
            "supported. Move or cast the model before fully_shard (or compute in another dtype "
            "with a MixedPrecisionPolicy); to_empty(device=...) / .to(...) onto the device and "
            "dtype of the shards work")


@torch.no_grad()
def rebind_after_apply(unit: Unit) -> None:
    """After torch's ``Module._apply`` on a sharded unit: every parameter it replaced (a new
    tensor under ``to_empty``, ``param.data = ...`` or a new ``nn.Parameter``) is copied into
    this library's storage and the shard object, viewing it again, registered back at every
    place it was; a unit built on meta counts as materialised (its own init, or a seed
    checkpoint, fills it next, as under FSDP2)."""
    for (mod, attr), i in zip(unit.refs, unit.ref_param):
        shard, now = unit.sharded[i], mod._parameters.get(attr)
        if now is None:
            continue
        view = unit.storage.shard_view(i)
        data = now.detach()
        if now is not shard or (view.numel() and data.data_ptr() != view.data_ptr()):
            if view.numel() and data.data_ptr() != view.data_ptr():
                view.copy_(data)
            grad = shard.grad
            rebind(shard, view)
            shard.grad = grad
            mod._parameters[attr] = shard
    unit.needs_init = False


class _EmptyGradToShard:
    """Post-accumulate-grad hook of an empty unsharded parameter (a zero-size dim): its
    gradient holds no element, so the shard gets an empty gradient, as in torch."""

    def __init__(self, shard: nn.Parameter):
        self.shard = shard

    def __call__(self, param: nn.Parameter) -> None:
        param.grad = None
        if self.shard.grad is None:
            set_sharded_grad(self.shard, torch.zeros_like(self.shard))


def _mesh_key(mesh: DeviceMesh) -> tuple:
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape), mesh.device_type)


def _check_units(named_units: list[tuple[str, Unit]], root_unit: Unit) -> None:
    """Name and number the units; each on the root's mesh, or (expert parallelism) on
    another mesh of the same root mesh whose ranks the root's mesh covers."""
    mesh = root_unit.mesh
    ranks = set(mesh.mesh.flatten().tolist())
    for index, (name, u) in enumerate(named_units):
        u.name, u.index = name or "<root>", index
        if u.root is not None:
            raise ValueError(f"matrixfsdp: unit '{name}' was already sharded as part of another root")
        if u.mesh is mesh or _mesh_key(u.mesh) == _mesh_key(mesh):
            continue
        same_root = _mesh_key(root_mesh(u.mesh)) == _mesh_key(root_mesh(mesh))
        if not same_root or u.mesh.device_type != mesh.device_type or \
                not set(u.mesh.mesh.flatten().tolist()) <= ranks:
            raise ValueError(
                f"matrixfsdp: unit '{name}' uses the mesh {u.mesh}, the root {mesh}: units may use "
                "different meshes only as FSDP2 + expert parallelism does (sub-meshes of one mesh, "
                "each inside the root's ranks, e.g. the experts on mesh['dp_shard_mod_ep'] and the "
                "rest on the flattened dp x ep); otherwise one model needs one mesh")


def _warn_partial_mesh(P: int) -> None:
    if dist.is_initialized() and dist.get_world_size() > P:
        warnings.warn(
            f"matrixfsdp: the mesh covers {P} of the {dist.get_world_size()} ranks; gradients are "
            f"averaged over these {P} ranks only and nothing synchronises them with the other "
            "ranks. Right if those train other parts of the model (pipeline stages)",
            stacklevel=3)


def _domains(units: list[Unit], specs: list, stats: CommStats) -> list[Domain]:
    """One :class:`Domain` per distinct unit mesh, the root unit's first; each plans its
    own units' parameters, and every unit learns its domain."""
    by_mesh: dict[tuple, list[int]] = {}
    for ui, u in enumerate(units):
        by_mesh.setdefault(_mesh_key(u.mesh), []).append(ui)
    names = [u.name for u in units]
    domains = []
    for members in by_mesh.values():
        mesh = units[members[0]].mesh
        groups = MeshGroups.from_mesh(mesh)
        mine = set(members)
        plan = make_plan([s for s in specs if s.unit in mine], mesh.size(), names,
                         shard_size=groups.shard_size, tp_ownership=units[0].tp_ownership)
        domain = Domain.of(mesh, groups, plan, stats)
        for ui in members:
            units[ui].domain = domain
        domains.append(domain)
    return domains


def _merged(domains: list[Domain], specs: list) -> Plan:
    """Every unit's placements in one :class:`Plan` (the root domain's counts and sizes)."""
    first = domains[0].plan
    placements = {}
    for d in domains:
        placements.update(d.plan.placements)
    return replace(first, placements={s.name: placements[s.name] for s in specs})


def plan_and_shard(root_unit: Unit) -> Root:
    """Plan all units under ``root_unit`` at once and shard their parameters."""
    mesh = root_unit.mesh
    named_units = unit_modules(root_unit.module)
    units = [u for _, u in named_units]
    problem = None
    try:  # this rank's own checks (a unit of mixed dtypes, a parameter that cannot be sharded)
        _check_units(named_units, root_unit)
        collected = _collect(named_units, root_unit.muon_filter)
        tp_mesh = _tp_mesh(units, collected.specs, mesh)
    except (ValueError, NotImplementedError, TypeError) as e:
        problem = e
    agree_on_local_checks(problem, mesh)  # every rank stops here, naming the rank, or none
    move_buffers(root_unit.module, mesh_device(mesh))  # before the checks' collectives use them
    if not sliced_from_named_world(mesh):
        _warn_partial_mesh(mesh.size() * (tp_mesh.size() if tp_mesh is not None else 1))
    for u in units:  # the default, resolved anew: a unit that was a root before (a method of
        # FSDPModule called before the outer fully_shard plans it) is a block now
        if u.reshard_default:
            u.reshard_after_forward = u is not root_unit
    stats = CommStats()
    domains = _domains(units, collected.specs, stats)
    root = Root(root_unit.module, units, domains, _merged(domains, collected.specs), stats,
                debug=root_unit.debug, overlap=root_unit.overlap)
    root.aliases = collected.aliases
    root.schedule.max_reduces = max(u.max_input_buffers or 1 for u in units)
    if tp_mesh is not None:
        root.tp = TPGroups(tp_mesh, root.stats)
    params = [p for ps in collected.params for p in ps]
    named = [(spec.name, p.to_local() if isinstance(p, DTensor) else p)
             for spec, p in zip(collected.specs, params)]
    sync = root_unit.sync_module_states
    # shapes, dtypes, buffers, policies first: a wider MLP on one rank is named as such,
    # never as "other initial values"
    world = root.groups.world
    check_same_setup(model_setup(named, root_unit.module, [(u.name, u.mp_policy) for u in units],
                                 buffer_values=not sync), world, "the model")
    if sync:
        sync_buffers(root_unit.module, world)
    if not sync:  # digests where the tensors are (sync_module_states broadcasts per unit)
        domain_of = {spec.name: units[spec.unit].domain for spec in collected.specs}
        for d in domains:  # each over its own ranks: the experts differ across the ep dim
            check_same_init([(n, t) for n, t in named if domain_of[n] is d], d.groups.world)
    device = mesh_device(mesh)
    for ui, u in enumerate(units):
        shard_unit(u, ui, collected.params[ui], root, device, sync=sync)
    return root


@torch.no_grad()
def undo_sharding(root: Root) -> None:
    """Undo :func:`plan_and_shard` (a collective): every parameter object gets its full
    tensor back, every unit is pending again. For a root that an outer ``fully_shard``
    call now contains: the outer call plans all units together."""
    root.sync_replicas()
    for u in root.units:
        if u.needs_init:
            full = [torch.empty(slice_shape(pl.spec), dtype=p.dtype, device="meta")
                    for p, pl in zip(u.sharded, u.layout.placements)]
        else:  # a DTensor parameter's local tensor (a tp-split matrix: this tp rank's slice)
            full = u.storage.full_tensors(u.domain.comm)
        restored = []
        for p, f, info in zip(u.sharded, full, u.tp_params):
            if info is None:
                rebind(p, f)
                unmark_sharded(p, u)
            else:  # the DTensor again, as the TP plan made it (a new object, as at sharding)
                p = info.wrap(f, p.requires_grad)
                mark_waiting(p, u)
            restored.append(p)
        u.register(restored)
        unguard_unit(u)
        u.root, u.storage, u.layout = None, None, None
        u.sharded, u.unsharded = [], []
        u.reset_step()
