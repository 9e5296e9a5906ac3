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

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..planning.planner import Collected, collect_params, make_plan, unit_members
from ..planning.types import MuonFilter, Plan
from .checks import (
    check_same_init,
    check_same_setup,
    guard_unit,
    model_setup,
    sync_buffers,
    unguard_unit,
)
from .hsdp import MeshGroups
from .layout import unit_layout
from .mixed_precision import Precision
from .param import ShardedParam, mark_sharded, set_sharded_grad, unmark_sharded
from .root import Root, mesh_device
from .storage import UnitStorage
from .unit import Unit


def is_unit(m: nn.Module) -> bool:
    return getattr(m, "_mf_unit", None) is not None


def unit_modules(root_module: nn.Module) -> list[tuple[str, Unit]]:
    return [(name, m._mf_unit) for name, m in root_module.named_modules() if is_unit(m)]


def _collect(named_units: list[tuple[str, Unit]], muon_filter: MuonFilter | None) -> Collected:
    """The units' parameters through the planner's one collector (:func:`plan.collect_params`:
    tied tensors once, the same checks as ``matrixfsdp plan``), each unit told where its
    parameters are registered; DTensor parameters (tensor parallelism) refused first."""
    for uname, u in named_units:
        for mod, attr, fqn in unit_members(u.module, f"{uname}." if uname else "", is_unit):
            p = mod._parameters[attr]
            if isinstance(p, DTensor):
                raise NotImplementedError(
                    f"matrixfsdp: parameter '{fqn}' is a DTensor (placements {p.placements}): "
                    "composing with tensor parallelism (parallelize_module, then fully_shard) is "
                    "not supported yet; shard a model of plain tensors")
    collected = collect_params([(n, u.module) for n, u in named_units], is_unit, muon_filter)
    for (_, u), refs in zip(named_units, collected.refs):
        u.refs = [(mod, attr) for mod, attr, _ in refs]
        u.ref_param = [i for _, _, i in refs]
    return collected


def shard_unit(u: Unit, ui: int, params: list[nn.Parameter], plan: Plan, root: Root,
               device: torch.device) -> None:
    """Give unit ``u`` its storage, its unsharded parameters, and turn each original
    parameter into this rank's shard (registered at every place it was)."""
    u.layout, u.root = unit_layout(plan, ui), root
    dtype = params[0].dtype if params else torch.float32
    u.precision = Precision.resolve(u.mp_policy, dtype)
    u.storage = UnitStorage(u.layout, root.shard_rank, dtype, u.precision, device)
    # A model built on the meta device gets uninitialised shards on the mesh device,
    # filled later by ``matrixfsdp.init_weights``: no rank ever holds the full model.
    u.needs_init = any(p.device.type == "meta" for p in params)
    if not u.needs_init:
        u.storage.copy_in(params)
    u.sharded, u.unsharded = [], []
    for i, p in enumerate(params):
        up = nn.Parameter(u.storage.unsharded_view(i), requires_grad=p.requires_grad)
        if not p.numel():  # nothing to reduce: its empty grad goes to the shard
            up.register_post_accumulate_grad_hook(_EmptyGradToShard(p))
        u.unsharded.append(up)
        rebind(p, u.storage.shard_view(i))  # the original object is the shard from now on
        mark_sharded(p, ShardedParam(u.layout.placements[i], u, i))
        u.sharded.append(p)
    u.register(u.sharded)
    guard_unit(u)  # a submodule called outside its unit's forward raises (never wrong rows)
    for name, buf in u.module.named_buffers():
        if buf.device != device and buf.device.type != "meta":
            raise ValueError(f"matrixfsdp: buffer '{name}' of unit '{u.name}' is on "
                             f"{buf.device}, the mesh on {device}; move the model first")


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


class _EmptyGradToShard:
    """Post-accumulate-grad hook of an empty unsharded parameter (a zero-size dim): its
    gradient holds no element, so the shard gets an empty gradient, as in torch."""

    def __init__(self, shard: nn.Parameter):
        self.shard = shard

    def __call__(self, param: nn.Parameter) -> None:
        param.grad = None
        if self.shard.grad is None:
            set_sharded_grad(self.shard, torch.zeros_like(self.shard))


def _check_units(named_units: list[tuple[str, Unit]], root_unit: Unit) -> None:
    mesh = root_unit.mesh
    for index, (name, u) in enumerate(named_units):
        u.name, u.index = name or "<root>", index
        if u.root is not None:
            raise ValueError(f"matrixfsdp: unit '{name}' was already sharded as part of another root")
        if u.mesh is not mesh and (u.mesh.mesh.tolist() != mesh.mesh.tolist()
                                   or u.mesh.device_type != mesh.device_type):
            raise ValueError(f"matrixfsdp: unit '{name}' uses a different mesh than the root "
                             f"({u.mesh} vs {mesh}); one model needs one mesh")


def _warn_partial_mesh(P: int) -> None:
    if dist.is_initialized() and dist.get_world_size() > P:
        warnings.warn(
            f"matrixfsdp: the mesh covers {P} of the {dist.get_world_size()} ranks; gradients are "
            f"averaged over these {P} ranks only and nothing synchronises them with the other "
            "ranks. Right if those train other parts of the model (pipeline stages)",
            stacklevel=3)


def materialize(root_unit: Unit) -> Root:
    """Plan all units under ``root_unit`` at once and shard their parameters."""
    mesh = root_unit.mesh
    groups = MeshGroups.from_mesh(mesh)
    named_units = unit_modules(root_unit.module)
    units = [u for _, u in named_units]
    _check_units(named_units, root_unit)
    _warn_partial_mesh(mesh.size())
    root_unit.reshard_after_forward = bool(root_unit.reshard_after_forward)
    for u in units[1:]:
        u.reshard_after_forward = True if u.reshard_after_forward is None else u.reshard_after_forward
    collected = _collect(named_units, root_unit.muon_filter)
    plan = make_plan(collected.specs, mesh.size(), [u.name for u in units],
                     shard_size=groups.shard_size)
    root = Root(root_unit.module, units, plan, mesh, groups, debug=root_unit.debug,
                overlap=root_unit.overlap)
    root.aliases = collected.aliases
    named = [(spec.name, p) for spec, p in
             zip(collected.specs, (p for ps in collected.params for p in ps))]
    sync = root_unit.sync_module_states
    # shapes, dtypes, buffers, policies first: a wider MLP on one rank is named as such,
    # never as "other initial values"
    check_same_setup(model_setup(named, root_unit.module, [(u.name, u.mp_policy) for u in units],
                                 buffer_values=not sync), groups.world, "the model")
    if sync:
        sync_buffers(root_unit.module, groups.world)
    check_same_init(named, groups.world, sync=sync)
    device = mesh_device(mesh)
    for ui, u in enumerate(units):
        shard_unit(u, ui, collected.params[ui], plan, root, device)
    return root


@torch.no_grad()
def unshard_root(root: Root) -> None:
    """Undo :func:`materialize` (a collective): every parameter object gets its full
    tensor back, every unit is pending again. For a root that an outer ``fully_shard``
    call now contains: the outer call plans all units together."""
    root.sync_replicas()
    for u in root.units:
        if u.needs_init:
            full = [torch.empty(pl.spec.shape, dtype=p.dtype, device="meta")
                    for p, pl in zip(u.sharded, u.layout.placements)]
        else:
            full = u.storage.full_tensors(root.comm)
        for p, f in zip(u.sharded, full):
            rebind(p, f)
            unmark_sharded(p, u)
        u.register(u.sharded)
        unguard_unit(u)
        u.root, u.storage, u.layout = None, None, None
        u.sharded, u.unsharded = [], []
        u.reset_step()
    root.close()
