"""A communication unit (one ``fully_shard`` call): its hooks and the step's bookkeeping.

FSDP2's ``FSDPState`` + the scheduling half of ``FSDPParamGroup``. The data movement is
:class:`~matrixfsdp.runtime.storage.UnitStorage`'s; this file decides *when*. Per training step::

    pre-forward    gather (if resharded), register the unsharded parameters
    post-forward   register the shards again, free the unsharded storage if resharding
    pre-backward   gather again (if it was freed)             [hook on the outputs]
    post-backward  reduce the gradients to where the params live, free
                   [autograd function on the inputs: fires when this call's backward is over]
    end of backward (:class:`~matrixfsdp.runtime.root.Root`): any unit whose post-backward did not
                   fire runs it now, in a fixed order, so every rank issues the same
                   collectives in the same order.

A unit's lifecycle is two states, as FSDP2's: where its parameters are
(:class:`ShardedState`: sharded, a gather in flight, unsharded, or unsharded by the user's
``unshard()``) and where its step is (:class:`TrainingState`: idle, forward, backward,
post-backward). The reduce itself runs in :mod:`~matrixfsdp.runtime.reduce`, in one
direction, from the unsharded gradients to the shards' ``.grad``.

Backward bookkeeping: ``calls`` counts this step's forward calls whose inputs were routed
through :class:`_PostBackward`; the unit reduces when as many of those have fired in this
backward pass, or at the end of the pass. A unit called k times per step (weight sharing,
two forwards before one backward) therefore reduces once, after its k-th call's backward;
gradients left on the unsharded parameters at the end of a pass are reduced then, so
several backward passes before a step accumulate exactly as in torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._compat import calling_pipeline_stage, compiled_in_place
from ..diagnosis.debug import BACKWARD_GATHER, FORWARD_GATHER, REPLICATE_BROADCAST
from ..layout.types import MuonFilter
from ..layout.units import UnitLayout
from .collectives import Pending
from .mixed_precision import MixedPrecisionPolicy, Precision, tensors_in, tree_map_tensors
from .reduce import start_reduce
from .storage import UnitStorage
from .streams import Ready
from .tp import refuse_compiled

if TYPE_CHECKING:
    from .domain import Domain


def _tensors_requiring_grad(obj: Any) -> list[torch.Tensor]:
    return [t for t in tensors_in(obj) if t.requires_grad]


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a graph (CUDA graphs; False on a
    device type without graphs)."""
    probe = getattr(getattr(torch, device.type, None), "is_current_stream_capturing", None)
    return bool(probe is not None and probe())


def refuse_torch_pipeline_stage(module: nn.Module) -> None:
    """Raise if torch's own ``PipelineStage`` runs this root's forward.

    torch's stage handles data parallelism only for torch's ``FSDPModule`` class: over this
    library's module it reduces every micro-batch's gradients (k times the bytes), and its
    split backward (zero-bubble schedules) hands autograd the module's parameters, which
    between calls are the shards, so the weight pass never reaches the stage's parameters
    and every stage but the first silently stops training. Nothing torch calls on the
    module tells one stage from the other, so the caller is read from the stack: the
    stage's ``forward_maybe_with_nosync`` (or, at its shape inference, ``_compute_outputs``)
    is a few frames up (module call, hooks)."""
    stage = calling_pipeline_stage(module)
    if stage is not None and not getattr(stage, "sees_matrixfsdp", False):
        raise TypeError(
            f"matrixfsdp: {type(module).__name__} runs in torch.distributed.pipelining's "
            "own PipelineStage, which drives data parallelism only for torch's FSDP2: "
            "it would reduce every micro-batch's gradients and, under the zero-bubble "
            "schedules, never hand the weight pass this library's parameters (stages "
            "left untrained). Build the stage with matrixfsdp.pipelining.PipelineStage "
            "(torch's class and signature; docs/pipelining.md)")


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


@dataclass(frozen=True)
class ShardOptions:
    """The keywords of one ``matrixfsdp.fully_shard`` call (documented there). The root's
    call's ``muon_filter``, ``debug``, ``overlap``, ``sync_module_states`` and
    ``tp_ownership`` apply to the whole model; ``offload_policy`` and
    ``independent_replicas`` are checked at the call."""

    mesh: DeviceMesh | None = None
    reshard_after_forward: bool | None = None
    muon_filter: MuonFilter | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    debug: bool = False
    overlap: bool = True
    sync_module_states: bool = False
    offload_policy: object = None
    independent_replicas: bool = False
    tp_ownership: str = "auto"


class ShardedState(Enum):
    """Where a unit's parameters are (FSDP2's ``ShardedState``, plus the two in between)."""

    SHARDED = auto()  # the shards only; the unsharded buffers are freed
    GATHERING = auto()  # a gather (a prefetch) is in flight into the unsharded buffers
    UNSHARDED = auto()  # the full parameters are in the unsharded buffers
    PINNED = auto()  # unsharded by the user's unshard(): kept until reshard()


class TrainingState(Enum):
    """Where a unit is in the training step (FSDP2's ``TrainingState``)."""

    IDLE = auto()  # no forward of this step yet: the next forward starts the step
    FORWARD = auto()  # this step's forward calls run (their backwards are counted)
    BACKWARD = auto()  # gathered for its backward; its post-backward has not run yet
    POST_BACKWARD = auto()  # reduced in this backward pass, which has not ended yet


class Unit:
    """One communication unit: the parameters of one ``fully_shard`` call that no inner
    call holds. Created by ``fully_shard``; planned and sharded with all the other units
    of its model when the root's ``fully_shard`` returns (:mod:`matrixfsdp.runtime.lazy_init`)."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh, options: ShardOptions):
        self.module = module
        self.sync_module_states = options.sync_module_states
        self.mesh = mesh
        self.reshard_after_forward = options.reshard_after_forward
        # None (the default) resolves at every planning: True for a block, False for the
        # root; a unit planned as a root of its own first is a block of the outer root
        self.reshard_default = options.reshard_after_forward is None
        self.muon_filter, self.mp_policy = options.muon_filter, options.mp_policy
        self.debug, self.overlap = options.debug, options.overlap
        self.tp_ownership = options.tp_ownership
        self.root: Any = None  # the model's Root (root.py imports this file: no type here)
        self.domain: Domain | None = None  # of its mesh: groups, Comm, plan
        self.name, self.index = "", 0  # in root.units
        self.forward_prefetch: list[Unit] | None = None  # None: the recorded order decides
        self.backward_prefetch: list[Unit] | None = None
        # set when sharded
        self.refs: list[tuple[nn.Module, str]] = []  # where parameters are registered
        self.ref_param: list[int] = []  # refs[k] holds parameter ref_param[k] (tied: repeats)
        self.layout: UnitLayout | None = None
        self.precision: Precision | None = None
        self.storage: UnitStorage | None = None
        self.tp_params: list = []  # per parameter: its TPParam (tp.py), None if plain
        self.sharded: list[nn.Parameter] = []
        self.unsharded: list[nn.Parameter] = []
        self.needs_init = False  # built on meta: shards allocated, not yet initialised
        # FSDP2's module methods (matrixfsdp.runtime.module.FSDPModule)
        self.requires_gradient_sync = True  # False: keep the gradients unsharded, no reduce
        self.divide_factor: float | None = None  # set_gradient_divide_factor: sum / factor
        self.max_input_buffers: int | None = None  # set_reduce_scatter_max_input_buffers
        self.reshard_after_backward = True
        self.accumulated: list[torch.Tensor | None] = []  # unsynced grads, reduce dtype
        self.guards: list = []  # forward pre-hooks on the modules holding its parameters
        self.reset_step()

    def reset_step(self) -> None:
        """Forget the step in progress: nothing gathered, no call pending."""
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self._gather: Pending | None = None  # the gather in flight (GATHERING)
        self._ready = Ready()  # where the side stream issued it (streams.py)
        self.calls = 0  # forward calls this step that will report their backward
        self.calls_done = 0  # of those, done in the current backward pass

    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state in (ShardedState.UNSHARDED, ShardedState.PINNED)

    @property
    def in_backward(self) -> bool:
        """Gathered for its backward, post-backward not run yet (a forward now recomputes)."""
        return self.training_state is TrainingState.BACKWARD

    @property
    def local(self) -> torch.Tensor:
        return self.storage.local

    # ---- parameter movement -----------------------------------------------------------
    @torch.no_grad()
    def prefetch(self, phase: int) -> None:
        """Start this unit's gather without waiting for it (a no-op if it is gathered or
        on its way)."""
        if self.sharded_state is not ShardedState.SHARDED:
            return
        self.sharded_state = ShardedState.GATHERING
        if not self.layout.numel:  # a unit may hold no parameter of its own
            self._gather, self._ready = Pending(), Ready()
            return
        with self.root.streams.comm() as ready:  # its waits stall the side stream only
            self.sync_replicas()  # HSDP: the matrices stepped last step, before they travel
            self.root.before_collective(self, phase, self.layout)
            self._gather = self.storage.start_unshard(self.domain.comm)
        self._ready = ready

    @torch.no_grad()
    def unshard(self) -> None:
        if not self.is_unsharded:
            if self.sharded_state is ShardedState.GATHERING:
                self.root.schedule.counts["prefetched"] += 1
            self.prefetch(BACKWARD_GATHER if self.in_backward else FORWARD_GATHER)
            self._ready.wait()  # the one place the compute stream waits for a gather
            self._gather.wait()
            self._gather = None
            self.sharded_state = ShardedState.UNSHARDED

    def pin(self) -> None:
        """The user's ``unshard()``: gathered, and kept through forwards until ``reshard()``."""
        self.unshard()
        self.sharded_state = ShardedState.PINNED

    def reshard(self) -> None:
        if self.sharded_state is ShardedState.SHARDED:
            return
        if self._gather is not None:  # never free a buffer a gather still writes into
            self._gather.wait()
            self._gather = None
        self.storage.free()
        self.sharded_state = ShardedState.SHARDED

    def register(self, params: list[nn.Parameter]) -> None:
        for (mod, attr), i in zip(self.refs, self.ref_param):
            mod._parameters[attr] = params[i]

    def _use_unsharded(self) -> None:
        for sp, up in zip(self.sharded, self.unsharded):  # a shard frozen after planning
            if up.requires_grad != sp.requires_grad:
                up.requires_grad_(sp.requires_grad)
        self.register(self.unsharded)

    # ---- HSDP ---------------------------------------------------------------------------
    def start_broadcast(self) -> None:
        """HSDP: start sending the matrices each replica stepped to the other replicas."""
        rep = self.domain.replication
        if rep.enabled and self.layout.has_replica_owned and rep.is_stale(self.index):
            self.root.before_collective(self, REPLICATE_BROADCAST, self.layout)
            rep.start_broadcast(self.index, self.local, self.storage.segment)

    def sync_replicas(self) -> None:
        """HSDP: the matrices each replica stepped are on every replica when this returns."""
        self.start_broadcast()
        self.domain.replication.finish_broadcast(self.index)

    # ---- hooks --------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        root = self.root
        if root is None:
            raise RuntimeError(f"matrixfsdp: {type(module).__name__} is a fully_shard unit whose "
                               "root was never sharded; call fully_shard on the root module")
        if self.needs_init:
            raise RuntimeError(f"matrixfsdp: unit '{self.name}' was built on the meta device and "
                               "its shards are not initialised; call matrixfsdp.init_weights(model)")
        if not torch.compiler.is_compiling() and _capturing(self.local.device):
            raise RuntimeError(
                f"matrixfsdp: unit '{self.name}' ran inside a CUDA graph capture "
                "(torch.cuda.graph, or torch.compile(mode='reduce-overhead') with its hooks in the "
                "graph): CUDA graphs are not supported, each gather allocates the unit's "
                "parameters anew and a graph replays fixed addresses. Compile with mode='default' "
                "or 'max-autotune-no-cudagraphs' (docs/compile.md)")
        if root.tp is not None and compiled_in_place(module):
            refuse_compiled(f"unit '{self.name}' was compiled (module.compile())")
        if root.step_failed(self):
            root.recover()  # the last forward or backward raised and the user caught it
        recompute = root.in_backward and self.in_backward
        if self.training_state is TrainingState.IDLE:  # the step's first forward call
            self.calls, self.training_state = 0, TrainingState.FORWARD
        if self.index == 0 and not recompute:
            refuse_torch_pipeline_stage(module)
            root.pre_forward()
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
        return self._route_inputs(args, kwargs)

    def _route_inputs(self, args, kwargs):
        """Pass this call's inputs through :class:`_PostBackward` (its backward is this
        call's post-backward)."""
        tensors = _tensors_requiring_grad((args, kwargs)) if torch.is_grad_enabled() else []
        if not tensors:
            return args, kwargs
        self.calls += 1
        outs = _PostBackward.apply(self, *tensors)
        outs = outs if isinstance(outs, tuple) else (outs,)
        new = {id(t): o for t, o in zip(tensors, outs)}
        return tree_map_tensors(lambda t: new.get(id(t), t), (args, kwargs))

    def post_forward(self, module, args, kwargs, output):
        root = self.root
        if root.in_backward and self.in_backward:
            return output  # recomputation (see pre_forward): stay unsharded for backward
        if self.index == 0:
            root.forward_open = False
        if self.sharded_state is ShardedState.PINNED and not root.in_backward:
            return self.precision.cast_output(output)  # unshard() by the user: kept
        self.register(self.sharded)
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
            self.training_state = TrainingState.BACKWARD
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
        """Reshard, then start reducing the gradients accumulated on the unsharded
        parameters (if any) to where each parameter lives (:mod:`.reduce`: they land on the
        shards' ``.grad``); without gradient sync, keep them unsharded instead (FSDP2's)."""
        grads = self._take_grads()
        if self.reshard_after_backward:
            self.reshard()  # the unsharded parameters are not needed any more
        if not self.requires_gradient_sync:
            self.accumulated = grads  # FSDP2's no-sync: accumulate unsharded, reduce later
        elif any(g is not None for g in grads):
            start_reduce(self, grads)
        self.register(self.sharded)
        self.training_state = TrainingState.POST_BACKWARD

    def _take_grads(self) -> list[torch.Tensor | None]:
        """The unsharded parameters' gradients (cleared from them), plus those kept from
        backward passes without gradient sync (in the reduce dtype, as FSDP2 keeps them)."""
        grads = [p.grad if info is None else info.local_grad(p.grad)
                 for p, info in zip(self.unsharded, self.tp_params)]
        for p in self.unsharded:
            p.grad = None
        if self.accumulated or not self.requires_gradient_sync:
            acc = self.accumulated or [None] * len(grads)
            red = self.precision.reduce
            grads = [a if g is None else g.to(red) if a is None else a.add_(g)
                     for a, g in zip(acc, grads)]
            self.accumulated = []
        return grads

    @torch.no_grad()
    def abandon(self, failed_backward: bool) -> None:
        """A forward or backward that raised: finish the gather in flight (every rank
        issued it), drop the unsharded gradients, reshard, forget the step. After a failed
        backward, the gradients kept without sync go too (see ``Root.recover``)."""
        for p in self.unsharded:
            p.grad = None
        if failed_backward:
            self.accumulated = []
        self.reshard()
        if self.storage is not None:
            self.register(self.sharded)
        self.reset_step()

    def end_backward(self) -> None:
        """After every unit's final ``post_backward`` (which resharded it): a new pass."""
        self.calls_done = 0
        self.training_state = TrainingState.IDLE
