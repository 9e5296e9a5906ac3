"""A unit's gradient reduce, in one direction: from the gradients its backward left on the
unsharded parameters to this rank's pieces, averaged, as the shards' ``.grad``.

    Unit.post_backward ── start_reduce
      1. the shard group: the even parts' reduce-scatter and one reduce per holder
         (:meth:`~matrixfsdp.runtime.storage.UnitStorage.start_reduce`)
      2. TP: each slice of a split matrix to the tp rank holding it whole (``ShardReduce.hop``)
      3. HSDP: across the replicas (:meth:`~matrixfsdp.runtime.hsdp.Replication.reduce_across`)
      4. this rank's pieces become the shards' ``.grad`` (:func:`attach_grads`)

Each stage starts when the one before it is waited for; when that is, the schedule decides
(:mod:`~matrixfsdp.runtime.overlap`: FSDP2's bound, one shard-group reduce in flight by
default, every stage done by the end of backward), except that on a device with streams the
stages after the shard group's are issued at once from the side stream, each as soon as the
one before it is done there (:meth:`~matrixfsdp.runtime.streams.Streams.chain`). A
parameter some rank had no gradient for waits for the reduced flags, read on the host once
at the end of the pass (:meth:`~matrixfsdp.runtime.root.Root.attach_unused`), which then
attaches it here too.
"""

from __future__ import annotations

from typing import Any

import torch

from ..diagnosis.debug import REDUCE, REPLICATE_REDUCE
from ..layout.units import UnitLayout
from .param import set_sharded_grad
from .storage import ShardReduce

_Unit = Any  # a runtime.unit.Unit (which imports this file: no import back)


def start_reduce(unit: _Unit, grads: list[torch.Tensor | None]) -> None:
    """Start reducing ``grads`` (per parameter of ``unit``, None: none this pass) to where
    each parameter lives; the stages after the shard group's are chained on the schedule.
    Frozen parameters do not travel (as in FSDP2; every rank must freeze the same ones:
    debug mode checks)."""
    trainable = tuple(p.requires_grad for p in unit.sharded)
    lay, _ = unit.layout.reduce_layout(trainable)
    if not lay.numel:
        return
    unit.root.schedule.make_room()  # FSDP2's bound on send buffers alive, before this one
    unit.root.before_collective(unit, REDUCE, lay)
    shard = unit.storage.start_reduce(unit.domain.comm, grads, trainable, unit.divide_factor)
    reduce = _Reduce(unit, shard, [grads[i] is not None for i in shard.index])
    # on a device with streams the follow-ups start from the side stream as soon as the
    # shard group's reduce is done there; the schedule's wait is then the compute stream's
    unit.root.schedule.add_reduce(unit.root.streams.chain(
        shard.pending.then(reduce.after_shard_group)))


class _Reduce:
    """Stages 2-4 of one unit's reduce (module docstring), each run once the one before is
    done."""

    def __init__(self, unit: _Unit, shard: ShardReduce, had: list[bool]):
        self.unit, self.shard, self.had = unit, shard, had

    def after_shard_group(self) -> None:
        if self.shard.hop is None:
            self.after_tp()
        else:  # TP: the slices of split matrices to the tp ranks holding them whole; on a
            # device with streams, HSDP's replicate-dim reduce then starts from the side
            # stream as soon as the hop is done there (the hop's buffers held till then)
            root = self.unit.root
            root.schedule.add_follow_up(root.streams.chain(self.shard.hop().then(self.after_tp)))

    def after_tp(self) -> None:
        unit, lay = self.unit, self.shard.layout
        replication = unit.domain.replication
        if not replication.enabled:
            self.attach()
            return
        unit.root.before_collective(unit, REPLICATE_REDUCE, lay)  # HSDP: over the replicas too
        seg = lay.segment(unit.domain.shard_rank, unit.storage.tp_rank)
        divisor = None if unit.divide_factor is None else 1
        unit.root.schedule.add_follow_up(
            replication.reduce_across(self.shard.out, seg, divisor).then(self.attach))

    def attach(self) -> None:
        """This rank's pieces of the reduced buffer become the shards' ``.grad``, for every
        parameter some rank had a gradient for. One left without a gradient on every rank
        keeps ``.grad`` as it was (None after ``zero_grad``), as torch leaves an unused
        parameter, so no optimizer steps it; one used on some ranks only gets the average
        with zeros (FSDP2's). Whether a rank had one is this rank's own knowledge
        (``had``); where it had none, the reduced flag counts tell, read on the host once
        per backward pass for all units at its end: no host read otherwise."""
        unit, out, lay, index = self.unit, self.shard.out, self.shard.layout, self.shard.index
        prec = unit.precision
        grad = out.to(prec.orig) if prec.reduce != prec.orig else out
        attach_grads(unit, grad, lay, index, [j for j, h in enumerate(self.had) if h])
        lacked = [j for j, h in enumerate(self.had) if not h]
        if lacked:
            unit.root.defer_unused(unit, grad, out[lay.even_numel:lay.head], lay, index, lacked)


def attach_grads(unit: _Unit, grad: torch.Tensor, lay: UnitLayout, index: list[int],
                 which: list[int]) -> None:
    """This rank's pieces of the reduced ``grad`` (laid out as ``lay``) as the ``.grad`` of
    ``unit``'s parameters ``index[j]`` for ``j`` in ``which`` (added to one already there).

    Every rank gives each of these parameters a ``.grad``, as FSDP2 gives each DTensor shard
    one, so that any list built from ``p.grad`` over ``model.parameters()`` has the same
    length on every rank (torch's and torchtitan's clipping stack one norm per gradient and
    reduce the stack): an empty placeholder (a matrix another rank owns, no rows of a
    parameter) gets an empty gradient, and under HSDP the copy of a matrix that another
    replica steps gets zeros (its gradient lives on that replica; nothing steps the copy
    here: :meth:`~matrixfsdp.runtime.param.ShardedParam.steps_here`)."""
    groups, tp_rank = unit.domain.groups, unit.storage.tp_rank
    for j in which:
        p = unit.sharded[index[j]]
        if not p.numel():  # one kept by zero_grad(set_to_none=False) is plain since the step
            set_sharded_grad(p, grad.narrow(0, 0, 0).view(p.shape) if p.grad is None else p.grad)
            continue
        start = lay.shard_offset(j, groups.shard_rank, tp_rank)
        view = grad[start:start + p.numel()].view(p.shape)
        if not groups.steps_here(lay.placements[j]):
            view.zero_()  # HSDP: another replica reduced and steps it
        set_sharded_grad(p, view if p.grad is None else p.grad.add_(view))
