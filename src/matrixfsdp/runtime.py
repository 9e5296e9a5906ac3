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

import functools
import math
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .comm import CommStats, LinkDelay, Pending, gather_v, reduce_v
from .debug import (
    BACKWARD_GATHER,
    FORWARD_GATHER,
    REDUCE,
    REPLICATE_BROADCAST,
    REPLICATE_REDUCE,
    CollectiveCheck,
)
from .hsdp import MeshGroups, broadcast_from_owners, reduce_across_replicas
from .layout import UnitLayout, local_rows, unit_layout
from .mixed_precision import MixedPrecisionPolicy, Precision, tensors_in, tree_map_tensors
from .overlap import Schedule
from .param import ShardedParam, mark_pending, mark_sharded, pending_unit, replacement, sharded_param
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
    return [t for t in tensors_in(obj) if t.requires_grad]


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
    """Identity on the inputs of one call of a unit; its backward runs when the gradients
    of that call's inputs are done, i.e. when that call's backward is over."""

    @staticmethod
    def forward(ctx, unit: Unit, *inputs: torch.Tensor):
        ctx.unit = unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.unit.call_backward_done()
        return (None, *grads)


def _refuse_state_dict(module: nn.Module, *args, **kwargs) -> None:
    # Kept refusing (rather than returning RowShards, as FSDP2 returns DTensors): callers of
    # state_dict() (torch.save, save_pretrained, EMA copies, load_state_dict into another
    # model) expect full tensors they can compute with; each rank holds no such tensor, and
    # the optimizer needs matrixfsdp.get_state_dict anyway. See docs/checkpoint.md.
    raise RuntimeError(
        f"matrixfsdp: state_dict()/load_state_dict() on the sharded {type(module).__name__} would "
        "hold this rank's local shards under the full parameter names (torch.distributed."
        "checkpoint would keep one rank's rows, save_pretrained a broken file). Use "
        "matrixfsdp.full_state_dict(model) / matrixfsdp.load_full_state_dict(model, state) "
        "(full tensors by name, on every rank), or for torch.distributed.checkpoint "
        "matrixfsdp.get_state_dict(model, optimizer) / matrixfsdp.set_state_dict (each rank's "
        "pieces with their place in the full tensors; loads at any world size)")


class Root:
    """State shared by all units of one model: the plan, the group, the counters, and
    whether a backward pass is running (between the first pre-backward hook and the
    end-of-backward callback)."""

    def __init__(self, module: nn.Module, units: list[Unit], plan: Plan, mesh: DeviceMesh,
                 debug: bool = False, overlap: bool = True, groups: MeshGroups | None = None):
        self.module = module
        self.units = units  # pre-order: the root unit first
        self.plan = plan
        self.mesh = mesh
        # HSDP: ``group``/``rank`` are the shard group and this rank in it (where the
        # buffers are split); ``groups`` adds the replicate group and the whole world.
        self.groups = groups or MeshGroups.from_mesh(mesh)
        self.group = self.groups.shard
        self.rank = self.groups.shard_rank
        self.world_size = mesh.size()
        self.stats = CommStats()
        self.aliases: dict[str, str] = {}  # tied parameter name -> the name the plan uses
        self.in_backward = False
        self.need_check = True  # check_registered at the next root forward
        self.check = CollectiveCheck(self.groups.world, _mesh_device(mesh),
                                     [u.name for u in units]) \
            if debug and self.world_size > 1 else None
        self.schedule = Schedule(enabled=overlap, polling=self.check is None)
        self.delay: LinkDelay | None = None  # a slower network, for tests and the bench

    def check_registered(self) -> None:
        """Raise if a parameter no longer views this root's storage: ``model.to_empty``,
        ``.to(device or dtype)``, ``.half()`` after ``fully_shard`` replace the tensors (or
        their storage), and training would silently go on with the old ones."""
        for u in self.units:
            base = u.local.untyped_storage().data_ptr()
            for (mod, attr), i in zip(u.refs, u.ref_param):
                p, sp = mod._parameters.get(attr), u.sharded[i]
                if (p is not sp and p is not u.unsharded[i]) or \
                        (sp.numel() and sp.untyped_storage().data_ptr() != base):
                    raise RuntimeError(
                        f"matrixfsdp: parameter '{sharded_param(sp).name}' no longer views "
                        "MatrixFSDP's storage: model.to_empty / .to / .half / load_state_dict("
                        "assign=True) after fully_shard replaced it. Move or cast the model "
                        "before fully_shard (or use a MixedPrecisionPolicy); for a model built "
                        "on meta, call matrixfsdp.init_weights(model) instead of to_empty")

    def before_collective(self, unit: Unit, phase: int, layout: UnitLayout | None = None) -> None:
        if self.check is not None:
            self.check(unit.index, phase, *((layout.numel, layout.digest) if layout else (0, 0)))

    def start_broadcasts(self) -> None:
        """HSDP: start broadcasting every matrix a replica stepped to the other replicas
        (each unit's gather waits for its own)."""
        for u in self.units:
            u.start_broadcast()

    def sync_replicas(self) -> None:
        """HSDP: broadcast every matrix a replica stepped to the other replicas now, rather
        than at its unit's next gather (before reading parameters outside forward)."""
        self.start_broadcasts()
        for u in self.units:
            u.sync_replicas()

    def queue_final_callback(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        # Units whose last call's post-backward did not fire (the root, whose input is token
        # ids; a call whose inputs need no grad) reduce here, in a fixed order, so every
        # rank issues the same collectives in the same order.
        for unit in reversed(self.units):
            unit.post_backward()
        self.schedule.finish_reduces()  # every .grad is in place before backward() returns
        for unit in self.units:  # a unit this forward did not use: its broadcast ends here
            unit.finish_broadcast()
        for unit in self.units:
            unit.end_backward()
        self.schedule.end_step()
        self.in_backward = False
        self.need_check = True
        if self.check is not None:
            self.check.step += 1


class Unit:
    """One communication unit: the parameters of one ``fully_shard`` call.

    Backward bookkeeping: ``calls`` counts this step's forward calls whose inputs were
    routed through :class:`_PostBackward`; the unit reduces its gradients when as many of
    those have fired in this backward pass (all calls done), or at the end of the pass.
    A unit called k times per step (weight sharing, a loop over one block, two forwards
    before one backward) therefore reduces once, after its k-th call's backward. Any
    gradient left on the unsharded parameters at the end of a pass is reduced then, so
    several backward passes before a step accumulate exactly as in torch.
    """

    def __init__(self, module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool | None,
                 muon_filter: MuonFilter | None, mp_policy: MixedPrecisionPolicy | None,
                 debug: bool = False, overlap: bool = True):
        self.module = module
        self.debug = debug
        self.overlap = overlap
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.muon_filter = muon_filter
        self.mp_policy = mp_policy
        self.root: Root | None = None
        self.name = ""
        self.index = 0  # in root.units
        self.forward_prefetch: list[Unit] | None = None  # None: the recorded order decides
        self.backward_prefetch: list[Unit] | None = None
        self._gather: Pending | None = None  # a gather in flight (prefetched)
        self._broadcast: Pending | None = None  # HSDP: a broadcast from owners in flight
        # filled by _materialize
        self.refs: list[tuple[nn.Module, str]] = []  # where parameters are registered
        self.ref_param: list[int] = []  # refs[k] holds parameter ref_param[k] (tied: repeats)
        self.layout: UnitLayout | None = None
        self.precision: Precision | None = None
        self.sharded: list[nn.Parameter] = []
        self.unsharded: list[nn.Parameter] = []
        self.local = self.flat = self.even = None
        self._even_index: dict[int, int] = {}  # parameter index -> offset in ``even``
        self.needs_init = False  # built on meta: shards allocated, not yet initialised
        # per step / per backward pass
        self.is_unsharded = False
        self.calls = 0  # forward calls this step that will report their backward
        self.calls_done = 0  # of those, done in the current backward pass
        self.new_step = False  # a backward pass ended since the last forward
        self.in_backward = False  # unsharded for backward, post-backward not yet run
        self.needs_broadcast = False  # HSDP: replicas stepped their matrices since the gather
        self.has_replica_owned = False  # HSDP: some matrix of this unit is stepped by one replica

    # ---- parameter movement -------------------------------------------------------------
    @torch.no_grad()
    def prefetch(self, phase: int) -> None:
        """Start this unit's gather without waiting for it (a no-op if it is gathered or
        on its way)."""
        if self.is_unsharded or self._gather is not None:
            return
        root, lay = self.root, self.layout
        for buf in (self.flat, self.even):
            nbytes = buf.numel() * buf.element_size()
            if buf.untyped_storage().size() != nbytes:
                buf.untyped_storage().resize_(nbytes)
        if lay.numel:  # a unit may hold no parameter of its own (all in child units)
            self.sync_replicas()  # HSDP: the matrices stepped last step, before they travel
            root.before_collective(self, phase, lay)
            segment = self.local.to(self.precision.param)  # a copy only under a policy
            self._gather = gather_v(segment, self.flat, lay.seg_sizes, root.group, root.stats,
                                    async_op=True, delay=root.delay)
        else:
            self._gather = Pending(None)

    @torch.no_grad()
    def unshard(self) -> None:
        if self.is_unsharded:
            return
        self.prefetch(BACKWARD_GATHER if self.in_backward else FORWARD_GATHER)
        self._gather.wait()
        self._gather = None
        lay = self.layout
        # Copy-out into ``even`` itself: writing through the unsharded parameters would
        # bump the version counters autograd checks.
        for i, offset in self._even_index.items():
            spec = lay.placements[i].spec
            dst = self.even[offset:offset + spec.numel].view(spec.rows, spec.row_numel)
            for pc in lay.pieces[i]:
                dst[pc.row_start:pc.row_stop].view(-1).copy_(
                    self.flat[pc.offset:pc.offset + pc.numel])
        self.is_unsharded = True

    @torch.no_grad()
    def start_broadcast(self) -> None:
        """HSDP: start sending the matrices each replica stepped to the other replicas."""
        if self.needs_broadcast:
            root = self.root
            root.before_collective(self, REPLICATE_BROADCAST, self.layout)
            self._broadcast = broadcast_from_owners(self.local, self.layout.replica_runs[root.rank],
                                                    root.groups, root.stats, delay=root.delay)
            self.needs_broadcast = False

    def finish_broadcast(self) -> None:
        if self._broadcast is not None:
            self._broadcast.wait()
            self._broadcast = None

    def sync_replicas(self) -> None:
        """HSDP: the matrices each replica stepped are on every replica when this returns."""
        self.start_broadcast()
        self.finish_broadcast()

    def reshard(self) -> None:
        if self._gather is not None:  # never free a buffer a gather still writes into
            self._gather.wait()
            self._gather = None
        elif not self.is_unsharded:
            return
        for buf in (self.flat, self.even):
            buf.untyped_storage().resize_(0)
        self.is_unsharded = False

    def _register(self, params: list[nn.Parameter]) -> None:
        for (mod, attr), i in zip(self.refs, self.ref_param):
            mod._parameters[attr] = params[i]

    def _use_unsharded(self) -> None:
        for sp, up in zip(self.sharded, self.unsharded):  # a shard frozen after planning
            if up.requires_grad != sp.requires_grad:
                up.requires_grad_(sp.requires_grad)
        self._register(self.unsharded)

    # ---- hooks ----------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        root = self.root or _materialize(_outermost_pending(self))
        if self.root is None:
            raise RuntimeError(f"matrixfsdp: unit '{type(module).__name__}' was not planned; "
                               "its root module was planned without it")
        if self.needs_init:
            raise RuntimeError(f"matrixfsdp: unit '{self.name}' was built on the meta device and "
                               "its shards are not initialised; call matrixfsdp.init_weights(model)")
        if self.new_step:
            self.calls, self.new_step = 0, False
        if self.index == 0:
            if root.need_check:  # once per training step (each eval forward)
                root.check_registered()
                root.need_check = not torch.is_grad_enabled()
            if root.schedule.enabled:  # HSDP: every broadcast travels while forward runs
                root.start_broadcasts()
        recompute = root.in_backward and self.in_backward
        self.unshard()
        if not root.in_backward:
            if not recompute:
                root.schedule.record(self)
            for unit in root.schedule.forward_targets(self):
                unit.prefetch(FORWARD_GATHER)
        self._use_unsharded()
        if recompute:
            # Activation checkpointing recomputes this unit's forward inside its backward
            # (non-reentrant): the parameters are unsharded for backward already and this
            # recomputed graph is only read for its saved tensors.
            return args, kwargs
        args, kwargs = self.precision.cast_forward_inputs(args, kwargs)
        if torch.is_grad_enabled():
            tensors = _tensors_requiring_grad((args, kwargs))
            if tensors:
                self.calls += 1
                outs = _PostBackward.apply(self, *tensors)
                outs = outs if isinstance(outs, tuple) else (outs,)
                new = {id(t): o for t, o in zip(tensors, outs)}
                args, kwargs = tree_map_tensors(lambda t: new.get(id(t), t), (args, kwargs))
        return args, kwargs

    def _post_forward(self, module, args, kwargs, output):
        root = self.root
        if root.in_backward and self.in_backward:
            return output  # recomputation (see _pre_forward): stay unsharded for backward
        self._register(self.sharded)
        output = self.precision.cast_output(output)
        outs = _tensors_requiring_grad(output) if torch.is_grad_enabled() else []
        for t in outs:
            t.register_hook(self._pre_backward_hook)
        # Inside backward (reentrant checkpointing recomputes here) the parameters are
        # needed again right away: keep them.
        if (self.reshard_after_forward or not outs) and not root.in_backward:
            self.reshard()
        return output

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        self.root.queue_final_callback()
        if not self.in_backward:
            self.in_backward = True
            self.root.schedule.poll()  # HSDP: start the replicate-dim reduces that can start
            self.unshard()
            for unit in self.root.schedule.backward_targets(self):
                unit.prefetch(BACKWARD_GATHER)
            # Registered for backward too: code that re-runs the forward inside backward
            # (activation checkpointing, transformers' included) must see full parameters.
            self._use_unsharded()

    def call_backward_done(self) -> None:
        self.calls_done += 1
        if self.calls_done >= self.calls:
            self.post_backward()

    @torch.no_grad()
    def post_backward(self) -> None:
        """Reduce the gradients accumulated on the unsharded parameters (if any) to where
        each parameter lives, add them to the shards' ``.grad``, and reshard."""
        grads = [p.grad for p in self.unsharded]
        for p in self.unsharded:
            p.grad = None
        if any(g is not None for g in grads):
            self._reduce(grads)
        self.reshard()
        self._register(self.sharded)
        self.in_backward = False

    def _reduce(self, grads: list[torch.Tensor | None]) -> None:
        root, prec = self.root, self.precision
        # Frozen parameters do not travel (as in FSDP2): the reduce has the layout of the
        # trainable ones. Every rank must freeze the same parameters (debug mode checks).
        lay, index = self.layout.subset(tuple(p.requires_grad for p in self.sharded))
        if not lay.numel:
            return
        full = self.flat.new_empty(lay.numel, dtype=prec.reduce)
        if any(grads[i] is None for i in index):  # unused in this pass
            full.zero_()
        for j, i in enumerate(index):
            g = grads[i]
            if g is None:
                continue
            g2 = g.reshape(g.shape[0], -1) if g.dim() else g.reshape(1, 1)
            for pc in lay.pieces[j]:
                full[pc.offset:pc.offset + pc.numel].view(pc.row_stop - pc.row_start, -1).copy_(
                    g2[pc.row_start:pc.row_stop])
        self.reshard()  # the unsharded params are not needed any more
        out = full.new_empty(lay.seg_sizes[root.rank])
        root.before_collective(self, REDUCE, lay)
        pending = reduce_v(full, out, lay.seg_sizes, root.group, root.stats, async_op=True,
                           delay=root.delay)

        def attach() -> None:  # once the reduce is done: this rank's pieces become .grad
            grad = out.to(prec.orig) if prec.reduce != prec.orig else out
            offset = 0
            for j, pc in lay.local_pieces(root.rank):
                p = self.sharded[index[j]]
                view = grad[offset:offset + pc.numel].view(p.shape)
                offset += pc.numel
                if not root.groups.steps_here(sharded_param(p).placement):
                    continue  # HSDP: another replica steps it
                if p.grad is None:
                    p.grad = view
                else:
                    p.grad.add_(view)
        if lay.replica_runs is None:
            root.schedule.add_reduce(pending.then(attach))
            return

        def across_replicas() -> None:  # HSDP: then average over the replicas too
            root.before_collective(self, REPLICATE_REDUCE, lay)
            root.schedule.add_follow_up(reduce_across_replicas(
                out, lay.replica_runs[root.rank], root.groups, root.stats, delay=root.delay
            ).then(attach))
        root.schedule.add_reduce(pending.then(across_replicas))

    def end_backward(self) -> None:
        """After every unit's final ``post_backward`` (which resharded it): a new pass."""
        self.calls_done = 0
        self.new_step = True


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


def _grad_to_empty_shard(shard: nn.Parameter, param: nn.Parameter) -> None:
    """Post-accumulate-grad hook of an empty unsharded parameter (a zero-size dim): its
    gradient holds no element, so the shard gets an empty gradient, as in torch."""
    param.grad = None
    if shard.grad is None:
        shard.grad = torch.zeros_like(shard)


# torch optimizers whose update of an element depends on other elements: right on a whole
# matrix (a Muon matrix on its owner), wrong on a row shard (Muon's Newton-Schulz,
# Adafactor's row/column statistics), or on any shard at all (L-BFGS's global dot products).
_ROW_SENSITIVE = tuple(getattr(torch.optim, n) for n in ("Muon", "Adafactor") if hasattr(torch.optim, n))
_GLOBAL = (torch.optim.LBFGS,)
_guard_registered = False


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """A global optimizer step pre-hook (torch's public registry), for every optimizer:

    * an optimizer that is not element-wise stepping row shards, or L-BFGS on any shard,
      would compute on one rank's piece and differ from one process silently: refused by
      ``matrix_optim.check_optimizer_step`` (from placements, alike on every rank) before
      anything below runs.
    * HSDP: a step changes the matrices one replica owns, on that replica only, so their
      units must broadcast them before the next gather. Marked here, where replicas start
      to differ: every rank steps the same parameters (placeholders included), so every
      rank marks the same units, whatever ran between backward and step."""
    from .matrix_optim import check_optimizer_step  # (it imports nothing of the runtime's)
    check_optimizer_step(optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            info = sharded_param(p)
            if info is not None and info.unit.has_replica_owned:
                info.unit.finish_broadcast()  # one in flight (a unit forward skipped) ends first
                info.unit.needs_broadcast = True


def _collect_params(named_units: list[tuple[str, Unit]], muon_filter: MuonFilter | None
                    ) -> tuple[list[list[nn.Parameter]], list[ParamSpec], dict[str, str]]:
    """Each unit's parameters (and where they are registered), checked, and their specs.

    A tensor registered at several places (tied weights) is one parameter of one unit:
    planned, gathered and reduced once, registered at every place. Returns the parameters
    per unit, the specs for the planner, and {other name: planned name} of tied ones.
    """
    units = [u for _, u in named_units]
    seen: dict[int, tuple[int, str, int]] = {}  # id -> (unit index, first name, index)
    aliases: dict[str, str] = {}
    specs: list[ParamSpec] = []
    originals: list[list[nn.Parameter]] = []
    for ui, (uname, u) in enumerate(named_units):
        prefix = f"{uname}." if uname else ""
        u.refs, u.ref_param = [], []
        params: list[nn.Parameter] = []
        originals.append(params)
        first = None
        for mod, attr, fqn in _owned_params(u.module, prefix):
            p = mod._parameters[attr]
            u.refs.append((mod, attr))
            if id(p) in seen:
                other_unit, other, index = seen[id(p)]
                if other_unit != ui:
                    raise NotImplementedError(
                        f"matrixfsdp: parameter '{fqn}' (unit '{u.name}') is the same tensor as "
                        f"'{other}' (unit '{units[other_unit].name}'); tied parameters must live "
                        "in one unit: leave one of the two modules out of its own fully_shard "
                        "call so that both belong to the unit that contains them")
                u.ref_param.append(index)
                aliases[fqn] = other
                continue
            seen[id(p)] = (ui, fqn, len(params))
            u.ref_param.append(len(params))
            params.append(p)
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
            if is_muon and p.dim() not in (2, 3):
                raise ValueError(f"matrixfsdp: muon_filter selected parameter '{fqn}' of shape "
                                 f"{tuple(p.shape)}; Muon needs 2-D matrices or 3-D "
                                 "(experts, m, n) stacks of expert matrices")
            specs.append(ParamSpec(fqn, tuple(p.shape), p.element_size(), ui, is_muon))
    return originals, specs, aliases


def _shard_unit(u: Unit, ui: int, params: list[nn.Parameter], plan: Plan, root: Root,
                rank: int, device: torch.device) -> None:
    """Give unit ``u`` its storage (this rank's segment ``local``, the gather targets ``flat``
    and ``even``), its sharded and unsharded parameters, and register the shards."""
    lay = unit_layout(plan, ui)
    u.layout, u.root = lay, root
    u.has_replica_owned = lay.has_replica_owned
    dtype = params[0].dtype if params else torch.float32
    u.precision = prec = Precision.resolve(u.mp_policy, dtype)
    with torch.no_grad():
        u.local = torch.empty(lay.seg_sizes[rank], dtype=dtype, device=device)
        u.flat = torch.empty(lay.numel, dtype=prec.param, device=device)
        u._even_index, even_numel = {}, 0
        for i, p in enumerate(params):
            if not lay.whole_on_one_rank(i):
                u._even_index[i] = even_numel
                even_numel += p.numel()
        u.even = torch.empty(even_numel, dtype=prec.param, device=device)
        # A model built on the meta device gets uninitialised shards on the mesh device,
        # filled later by ``matrixfsdp.init_weights``: no rank ever holds the full model.
        u.needs_init = any(p.device.type == "meta" for p in params)
        offset = 0
        for i, pc in lay.local_pieces(rank):
            if not u.needs_init:
                u.local[offset:offset + pc.numel].copy_(
                    local_rows(params[i].detach(), lay.placements[i], rank).reshape(-1))
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
        mark_sharded(p, sp, ShardedParam(pl, u, i))
        u.sharded.append(sp)
        if i in u._even_index:
            full = _alias(u.even, u._even_index[i], tuple(p.shape))
        else:
            start = lay.pieces[i][0].offset if lay.pieces[i] else 0
            full = _alias(u.flat, start, tuple(p.shape))
        up = nn.Parameter(full, requires_grad=p.requires_grad)
        if not pl.spec.numel:  # nothing to reduce: its empty grad goes to the shard
            up.register_post_accumulate_grad_hook(functools.partial(_grad_to_empty_shard, sp))
        u.unsharded.append(up)
    u._register(u.sharded)
    u.flat.untyped_storage().resize_(0)
    u.even.untyped_storage().resize_(0)
    for name, buf in list(u.module.named_buffers()):
        if buf.device != device and buf.device.type != "meta":
            raise ValueError(f"matrixfsdp: buffer '{name}' of unit '{u.name}' is on "
                             f"{buf.device}, the mesh on {device}; move the model first")
    for mod in {id(m): m for m in [u.module, *(m for m, _ in u.refs)]}.values():
        mod.register_state_dict_pre_hook(_refuse_state_dict)
        mod.register_load_state_dict_pre_hook(_refuse_state_dict)


def _materialize(root_unit: Unit) -> Root:
    """Plan all units under ``root_unit`` at once and shard their parameters."""
    mesh = root_unit.mesh
    P = mesh.size()  # all ranks of the mesh; buffers are split over its shard dim
    groups = MeshGroups.from_mesh(mesh)
    rank = groups.shard_rank
    device = _mesh_device(mesh)
    named_units = _unit_modules(root_unit.module)
    units = [u for _, u in named_units]
    for index, (name, u) in enumerate(named_units):
        u.name, u.index = name or "<root>", index
        if u.root is not None:
            raise ValueError(f"matrixfsdp: unit '{name}' was already planned as part of another root")
        if u.mesh is not mesh and (u.mesh.mesh.tolist() != mesh.mesh.tolist()
                                   or u.mesh.device_type != mesh.device_type):
            raise ValueError(f"matrixfsdp: unit '{name}' uses a different mesh than the root "
                             f"({u.mesh} vs {mesh}); one model needs one mesh")
    if dist.is_initialized() and dist.get_world_size() > P:
        warnings.warn(
            f"matrixfsdp: the mesh covers {P} of the {dist.get_world_size()} ranks; gradients are "
            f"averaged over these {P} ranks only and nothing synchronises them with the other "
            "ranks. Right if those train other parts of the model (pipeline stages); wrong if "
            "they are data-parallel replicas (e.g. mesh2d['shard'] passed for HSDP): replicas "
            "would train apart silently. For HSDP pass the 2-D mesh itself, "
            "fully_shard(module, mesh=mesh2d) with mesh2d = init_device_mesh(device, "
            "(replicas, shard), mesh_dim_names=('replicate', 'shard')); see docs/hsdp.md",
            stacklevel=2)
    root_unit.reshard_after_forward = bool(root_unit.reshard_after_forward)
    for u in units[1:]:
        u.reshard_after_forward = True if u.reshard_after_forward is None else u.reshard_after_forward
    muon_filter = root_unit.muon_filter

    originals, specs, aliases = _collect_params(named_units, muon_filter)
    plan = make_plan(specs, P, [u.name for u in units], shard_size=groups.shard_size)
    root = Root(root_unit.module, units, plan, mesh, debug=root_unit.debug,
                overlap=root_unit.overlap, groups=groups)
    root.aliases = aliases

    for ui, u in enumerate(units):
        _shard_unit(u, ui, originals[ui], plan, root, rank, device)
    global _PENDING, _guard_registered
    _PENDING = [r for r in _PENDING if r() is not None and r().root is None]
    if not _guard_registered:
        register_optimizer_step_pre_hook(_before_optimizer_step)
        _guard_registered = True
    return root


def default_mesh() -> DeviceMesh:
    """All ranks, 1-D, on the current accelerator (or CPU)."""
    if not dist.is_initialized():
        raise ValueError("matrixfsdp: fully_shard needs torch.distributed initialised "
                         "or an explicit mesh")
    return init_device_mesh(_default_device_type(), (dist.get_world_size(),))


def fully_shard(module: nn.Module, *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | None = None,
                muon_filter: MuonFilter | None = None,
                mp_policy: MixedPrecisionPolicy | None = None, debug: bool = False,
                overlap: bool = True) -> nn.Module:
    """Make ``module`` one communication unit, like FSDP2's ``fully_shard``.

    Call it on every block, bottom-up, then on the root. The unit holds the module's
    parameters that no child unit holds. All units are planned together when the root is
    first used: Muon matrices (by default the 2-D weights inside the non-root units, except
    embeddings) go whole to one owner rank each; all other parameters are split by rows
    over the ranks.

    Args:
        mesh: a 1-D device mesh over the data-parallel ranks (default: all ranks on the
            current accelerator, or CPU), or a 2-D ``(replicate, shard)`` mesh for HSDP
            (as FSDP2: sharded over dim 1, replicated over dim 0; each Muon matrix is
            stepped by one replica and broadcast to the others, see docs/hsdp.md).
        reshard_after_forward: free the unsharded parameters after forward and gather
            them again in backward. None: True for blocks, False for the root.
        muon_filter: ``(fqn, param) -> bool`` deciding which parameters are Muon matrices;
            read from the root call. FQNs are relative to the root module.
        mp_policy: torch's ``torch.distributed.fsdp.MixedPrecisionPolicy`` for this unit:
            gather and compute in ``param_dtype``, average gradients in ``reduce_dtype``;
            shards, their gradients and the optimizer state keep the parameters' dtype.
        debug: read from the root call. Before every gather and reduce, all ranks compare
            (step, unit, phase) and raise the same error naming each rank's position if
            they differ, or after 30 s if a rank never arrives (one small extra collective
            per collective; see docs/troubleshooting.md).
        overlap: read from the root call. Gather the next unit while this one computes
            (forward and backward) and reduce gradients asynchronously (docs/overlap.md).
            False: every collective completes where it is issued.
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
    mesh = mesh or default_mesh()
    if mesh.ndim not in (1, 2):
        raise NotImplementedError(
            f"matrixfsdp: fully_shard needs a 1-D mesh or a 2-D (replicate, shard) mesh for "
            f"HSDP, got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}")
    unit = Unit(module, mesh, reshard_after_forward, muon_filter, mp_policy, debug, overlap)
    module._mf_unit = unit
    for mod, attr, _ in _owned_params(module, ""):
        mark_pending(mod._parameters[attr], unit)
    # Under ``module.compile()`` / ``torch.compile(module)`` the hooks run eagerly, as
    # FSDP2's do: the compiled graph is the module's forward alone, one per block, and the
    # gathers, parameter swaps and autograd bookkeeping stay plain Python (docs/compile.md).
    module.register_forward_pre_hook(torch.compiler.disable(unit._pre_forward), with_kwargs=True)
    module.register_forward_hook(torch.compiler.disable(unit._post_forward), with_kwargs=True)
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
        unit = pending_unit(p)
        if unit is not None:
            _materialize(_outermost_pending(unit))
    return [replacement(p) or p for p in params]


def _unit_of(module: nn.Module) -> Unit:
    unit = getattr(module, "_mf_unit", None)
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
