"""The root of one sharded model: what all its units share, and the end of backward.

One :class:`Root` per model, made when the root's ``fully_shard`` returns: the plan, the
process groups and their :class:`~matrixfsdp.runtime.collectives.Comm`, the counters, HSDP's
:class:`~matrixfsdp.runtime.hsdp.Replication`, the overlap :class:`~matrixfsdp.runtime.overlap.Schedule`,
and whether a backward pass is running (between the first pre-backward hook and the
end-of-backward callback).
"""

from __future__ import annotations

import torch
from torch import nn

from .._compat import in_backward, queue_backward_callback
from ..diagnosis.debug import CollectiveCheck
from ..layout.types import Plan
from ..layout.units import UnitLayout
from .checks import (
    agree_on_matrix_coverage,
    check_unsharded_trainable,
    judge_matrix_coverage,
    matrix_coverage,
)
from .collectives import CommStats
from .domain import Domain, mesh_device
from .overlap import Schedule
from .param import release_grads, sharded_param
from .reduce import attach_grads
from .streams import Streams
from .tp import TPGroups, refuse_compiled
from .unit import ShardedState, Unit


class Root:
    """State shared by all units of one model (the root unit first, in pre-order)."""

    def __init__(self, module: nn.Module, units: list[Unit], domains: list[Domain], plan: Plan,
                 stats: CommStats, debug: bool = False, overlap: bool = True):
        # ``domains``: one per distinct unit mesh, the root unit's first (domain.py; expert
        # parallelism gives the experts' units their own). ``plan``: all units' placements.
        # ``groups``, ``comm``, ``replication``, ``shard_rank`` are the root unit's domain's;
        # a unit's own are ``unit.domain``'s. ``world_size``: every rank of the root's mesh.
        primary = domains[0]
        self.module, self.units, self.plan, self.mesh = module, units, plan, primary.mesh
        self.domains = domains
        self.groups = primary.groups
        self.shard_rank = primary.shard_rank
        self.world_size = primary.size
        self.stats = stats
        self.comm = primary.comm
        self.replication = primary.replication
        self.aliases: dict[str, str] = {}  # tied parameter name -> the name the plan uses
        self.tp: TPGroups | None = None  # under tensor parallelism
        self.in_backward = False
        self.forward_open = False  # the root unit's forward started and has not returned
        self._unused: list = []  # units' parameters this rank had no gradient for (defer_unused)
        self.registration_check_due = True  # check_registered at the next root forward
        # the parameters the optimizers of the first step stepped, until it is judged that
        # every rank steps the matrices it owns (then None): settled by an optimizer's
        # first-step comparison of settings, or judged at the next forward (``due``); not
        # collected past the first step (mf.Muon alone: nothing to judge)
        self.stepped: set[int] | None = set()
        self.matrix_coverage_due = False
        self.collective_check = CollectiveCheck(self.groups.world, mesh_device(self.mesh),
                                                [u.name for u in units]) \
            if debug and self.world_size > 1 else None
        self.schedule = Schedule(enabled=overlap)
        self.streams = Streams(mesh_device(self.mesh))  # the side stream of chained collectives
        # a pipeline stage (integrations/pipelining.py) holding this step's gradients
        # unreduced until its schedule's last backward: its name, else None
        self.grads_held_by: str | None = None

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer holding this model's parameters is about to step them (called from
        its step pre-hook, :func:`matrixfsdp.optim.watch.watch`): the step's bookkeeping
        (:meth:`before_step`, :meth:`mark_stepped`) and plain-tensor gradients for it."""
        self.check_grads_reduced()
        self.before_step()  # unsharded copies kept past backward would go stale
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.stepped is not None:
            self.stepped.update(map(id, params))
        self.mark_stepped(params)
        release_grads(params)  # the optimizer's own norms (per matrix, on its owner) are right

    def matrix_coverage(self) -> tuple[list, bool] | None:
        """This rank's :func:`~matrixfsdp.runtime.checks.matrix_coverage`, None once judged."""
        return None if self.stepped is None else matrix_coverage(self.units, self.stepped)

    def judged_matrix_coverage(self, seen: list[int]) -> None:
        """Every rank's :meth:`matrix_coverage` as :func:`~matrixfsdp.runtime.checks.coverage_flags`
        reduced over the ranks (with an optimizer's first-step settings, in the same
        all-reduce): done if every rank steps one of its matrices (or owns none); else
        judged at the next forward, when every optimizer of the step has stepped."""
        if self.stepped is None or seen[0]:
            return
        decided = judge_matrix_coverage(seen, final=False)
        self.matrix_coverage_due = not decided
        if decided:
            self.stepped = None

    def check_grads_reduced(self) -> None:
        """Before an optimizer step: raise if a pipeline stage still holds this step's
        gradients unreduced (its schedule never called ``perform_reduce_grad``), the same
        on every rank of the stage."""
        if self.grads_held_by is not None:
            raise RuntimeError(
                f"matrixfsdp: optimizer.step() while {self.grads_held_by} still holds this "
                "step's gradients unreduced: its schedule did not finish the step (torch's "
                "schedules call perform_reduce_grad after the last backward); run the whole "
                "schedule.step() before optimizer.step()")

    def pre_forward(self) -> None:
        """The root unit's forward starts (a new step, or an eval forward)."""
        self.forward_open = True
        if self.registration_check_due:  # once per training step (each eval forward)
            self.check_registered()
            self.registration_check_due = not torch.is_grad_enabled()
        if self.matrix_coverage_due:  # once, undecided at the first step: one small all-reduce
            self.matrix_coverage_due = False
            agree_on_matrix_coverage(self.matrix_coverage(), self.groups.world)
            self.stepped = None
        elif self.stepped:  # a step passed with nothing left to judge: stop collecting
            self.stepped = None
        if self.schedule.enabled:  # HSDP: every broadcast travels while forward runs
            self.start_broadcasts()

    def check_registered(self) -> None:
        """Raise if a parameter no longer views this root's storage: ``model.to_empty``,
        ``.to(device or dtype)``, ``.half()`` after ``fully_shard`` replace the tensors (or
        their storage), and training would silently go on with the old ones. Under tensor
        parallelism, also a ``torch.compile(block)`` wrapper inside the model (unit.py
        refuses ``module.compile()`` for the same reason)."""
        check_unsharded_trainable(self.module, {id(p) for u in self.units for p in u.unsharded})
        if self.tp is not None:
            for name, m in self.module.named_modules():
                if type(m).__name__ == "OptimizedModule":  # torch.compile(module)'s wrapper
                    refuse_compiled(f"'{name}' is a torch.compile wrapper")
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
        if self.collective_check is not None:
            self.collective_check(unit.index, phase, *((layout.numel, layout.digest) if layout else (0, 0)))

    def start_broadcasts(self) -> None:
        """HSDP: start broadcasting every matrix a replica stepped to the other replicas
        (each unit's gather waits for its own, on the side stream)."""
        with self.streams.comm():
            for u in self.units:
                u.start_broadcast()

    def sync_replicas(self) -> None:
        """HSDP: broadcast every matrix a replica stepped to the other replicas now, rather
        than at its unit's next gather (before reading parameters outside forward)."""
        self.start_broadcasts()
        for u in self.units:
            u.sync_replicas()

    def mark_stepped(self, params) -> None:
        """HSDP: an optimizer is about to step ``params``; the units of those this root's
        replicas step apart must broadcast them before their next gather. Every rank steps
        the same parameters (placeholders included), so every rank marks the same units."""
        for p in params:
            info = sharded_param(p)
            if info is not None and info.root is self and info.unit.layout.has_replica_owned:
                info.unit.domain.replication.mark_stepped(info.unit.index)

    def step_failed(self, unit: Unit) -> bool:
        """Whether the last forward or backward raised (and the caller caught it): a
        backward pass that never reached its end-of-backward callback while no backward
        runs now, or, at the root unit's forward, a root forward that never returned."""
        if self.in_backward:
            return not in_backward()
        return unit.index == 0 and self.forward_open

    @torch.no_grad()
    def recover(self) -> None:
        """Leave the model as after a clean step, after a forward or backward raised.

        Every rank runs this at the same point (the next forward or optimizer step), when
        every rank raised at the same point (a check, an OOM retry): the gathers and reduces
        in flight are the same on every rank and are waited for, in the same order, with
        their follow-ups (gloo and NCCL cannot cancel them). A backward that raised leaves
        gradients no rank can use: some of its reduces had landed, others were in flight,
        and which ones may differ per rank (a wait on one that failed elsewhere), so all
        of them are dropped, on every rank: every shard's ``.grad`` and every
        gradient kept without sync becomes None, as ``zero_grad()`` would leave them (the
        earlier micro-batches of that step included). A forward that raised leaves the
        gradients of earlier backward passes as they were, as torch does. Gradients on
        unsharded parameters are dropped; every unit is resharded, its step forgotten."""
        self._drop_step(drop_grads=self.in_backward)
        self.registration_check_due = True

    def discard_grads(self) -> None:
        """Drop every gradient of the model, as ``zero_grad()`` would leave them, for a pass
        whose gradients are no step's: the reduces in flight waited for (every rank issued
        them), then the gradients kept without sync, those on unsharded parameters and the
        shards' ``.grad`` all None; every unit resharded. torch's pipeline stage runs one
        real forward and backward to infer its metadata, whose gradients it clears for
        FSDP2 (:mod:`matrixfsdp.integrations.pipelining`). Unlike :meth:`recover`, the
        pass ended normally: the parameters' registration is as it was."""
        self._drop_step(drop_grads=True)

    def _drop_step(self, drop_grads: bool) -> None:
        """End the step in flight on every rank alike: each unit resharded and its step
        forgotten (with ``drop_grads``, its gradients kept without sync and on unsharded
        parameters too), the reduces in flight and the replicas' broadcasts waited for, in
        order; then, with ``drop_grads``, what the reduces attached goes too."""
        for unit in self.units:
            unit.abandon(drop_grads)
        self.schedule.finish_reduces()
        self._unused = []
        for unit in self.units:
            unit.domain.replication.finish_broadcast(unit.index)
        if drop_grads:  # after the reduces: what they attached goes too
            for unit in self.units:
                for p in unit.sharded:
                    p.grad = None
        self.schedule.end_step()
        self.in_backward = self.forward_open = False

    def before_step(self) -> None:
        """An optimizer is about to change the shards: drop the unsharded copies kept by
        ``unshard()`` or ``set_reshard_after_backward(False)`` (gathered again when used)."""
        if in_backward():
            return  # stepping inside backward (optimizer-in-backward hooks)
        if self.in_backward or self.forward_open:
            self.recover()  # the step's forward or backward raised and was caught
            return
        for u in self.units:
            if u.sharded_state is not ShardedState.SHARDED:
                u.reshard()
                u.register(u.sharded)

    def defer_unused(self, unit: Unit, grad: torch.Tensor, counts: torch.Tensor,
                     lay: UnitLayout, index: list[int], lacked: list[int]) -> None:
        """A unit's reduce is done and this rank had no gradient for its parameters
        ``index[j]``, ``j`` in ``lacked``: whether another rank had one (``counts[j] > 0``,
        the reduced flags, on the device) is read at the end of the pass, for all units in
        one read (:meth:`attach_unused`)."""
        self._unused.append((unit, grad, counts[lacked], lay, index, lacked))

    def attach_unused(self) -> None:
        """The end of a backward pass: the parameters some rank used and this rank did not get
        their averaged gradient (the others' sum, over all ranks), those no rank used keep
        ``.grad`` as it was. One host read of every such unit's flag counts, and only on a
        rank that lacked a gradient this pass (none on the others): torch's semantics (an
        unused parameter has no ``.grad``, no optimizer steps it) need the world's answer
        on the host, as DDP's ``find_unused_parameters`` reads its bitmap."""
        if not self._unused:
            return
        pending, self._unused = self._unused, []
        used = (torch.cat([c for _, _, c, *_ in pending]) > 0).tolist()
        at = 0
        for unit, grad, _, lay, index, lacked in pending:
            attach_grads(unit, grad, lay, index, [j for j, u in zip(lacked, used[at:]) if u])
            at += len(lacked)

    def queue_final_callback(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            queue_backward_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        self.finish_grads()

    def finish_grads(self) -> None:
        """The end of a backward pass (the engine's final callback), or of a pipeline
        schedule's step (:mod:`matrixfsdp.integrations.pipelining`, after its last weight
        pass): every gradient left on the unsharded parameters (and kept from passes
        without sync, when sync is on again) is reduced, and in place when this returns."""
        # Units whose last call's post-backward did not fire (the root, whose input is token
        # ids; a call whose inputs need no grad) reduce here, in a fixed order, so every
        # rank issues the same collectives in the same order.
        for unit in reversed(self.units):
            unit.post_backward()
        self.schedule.finish_reduces()  # every .grad is in place before backward() returns
        self.attach_unused()
        for unit in self.units:  # a unit this forward did not use: its broadcast ends here
            unit.domain.replication.finish_broadcast(unit.index)
        for unit in self.units:
            unit.end_backward()
        self.schedule.end_step()
        self.in_backward = False
        self.registration_check_due = True
        if self.collective_check is not None:
            self.collective_check.step += 1

