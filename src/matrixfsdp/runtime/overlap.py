"""Overlap: which unit to gather ahead, and the gradient reduces still in flight.

Forward: when unit k starts, the gather of the unit that came after it in the last step's
forward is issued too, so it travels while k computes. Backward: when unit k's backward
starts, the gather of the unit before it in forward order (next in backward) is issued.
Reduces are asynchronous: as FSDP2 (``set_reduce_scatter_max_input_buffers``, default 1),
before a unit's gradients are copied into a new unit-sized send buffer, the oldest reduces
are finished until fewer than ``max_reduces`` remain in flight, so at most ``max_reduces``
send buffers are alive at once; all are finished at the end of backward, before anyone can
read a gradient. Under HSDP a finished reduce starts
the unit's replicate-dim reduce (a follow-up, waited for at the end of backward), and the
first forward after an optimizer step starts every unit's broadcast from its owner replica
at once; each unit's gather waits for its own. On gloo the collectives run on
gloo's own threads, so compute and communication overlap on CPU too; on NCCL they run on
NCCL's stream and ``wait()`` orders the compute stream after them.

The order is recorded from the previous step's forward, so the first step runs without
prefetch; ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` (FSDP2's
names) fix the targets explicitly. Every rank runs the same modules in the same order, so
every rank issues the same prefetches in the same order (debug mode checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .collectives import Pending

if TYPE_CHECKING:
    from .unit import Unit


class Schedule:
    def __init__(self, enabled: bool = True, max_reduces: int = 1):
        self.enabled = enabled
        self.max_reduces = max_reduces
        self.order: list[Unit] = []  # units, in the last completed step's forward order
        self._this_step: list[Unit] = []
        self._reduces: list[Pending] = []
        self._follow_ups: list[Pending] = []  # HSDP: the replicate-dim reduces
        # what overlap did, since the last reset (read by tests and the bench):
        # gathers already in flight when their unit needed them, reduces left in flight
        # when the next one was issued, replicate-dim reduces in flight at the end of backward
        self.counts = dict(prefetched=0, deferred_reduces=0, deferred_follow_ups=0)

    # ---- order ------------------------------------------------------------------------
    def record(self, unit: Unit) -> None:
        if not self._this_step or self._this_step[-1] is not unit:
            self._this_step.append(unit)

    def end_step(self) -> None:
        if self._this_step:
            seen: dict[int, Unit] = {}
            for u in self._this_step:
                seen.setdefault(id(u), u)
            self.order = list(seen.values())
        self._this_step = []

    def _neighbour(self, unit: Unit, step: int) -> list[Unit]:
        try:
            i = self.order.index(unit) + step
        except ValueError:
            return []
        return [self.order[i]] if 0 <= i < len(self.order) else []

    def forward_targets(self, unit: Unit) -> list[Unit]:
        if not self.enabled:
            return []
        explicit = unit.forward_prefetch
        return explicit if explicit is not None else self._neighbour(unit, +1)

    def backward_targets(self, unit: Unit) -> list[Unit]:
        if not self.enabled:
            return []
        explicit = unit.backward_prefetch
        return explicit if explicit is not None else self._neighbour(unit, -1)

    # ---- reduces in flight ----------------------------------------------------------------
    def make_room(self) -> None:
        """Before a unit's send buffer is allocated: the oldest reduces are finished (and
        their follow-ups started) until fewer than ``max_reduces`` are in flight, FSDP2's
        bound on its reduce-scatter input buffers. A point set by the order of the units,
        never by when a collective happens to complete, so every rank interleaves the
        collectives of its communicators (shard, replicate, tp groups) in one order. NCCL
        may deadlock on communicators used in different orders by different ranks (their
        kernels wait for each other's peers); before, a reduce found done by polling
        started its follow-up at a moment each rank picked by its own timing."""
        self.counts["deferred_reduces"] += len(self._reduces)  # in flight across a backward
        while len(self._reduces) >= (self.max_reduces if self.enabled else 1):
            self._reduces.pop(0).wait()

    def add_reduce(self, pending: Pending) -> None:
        """A unit's reduce, in flight (without overlap: finished at once)."""
        self._reduces.append(pending)
        if not self.enabled:
            self._reduces.pop(0).wait()

    def add_follow_up(self, pending: Pending) -> None:
        """A collective a finished reduce started (HSDP: across replicas). It holds only a
        segment-sized buffer, so it may stay in flight until the end of backward."""
        self._follow_ups.append(pending)
        if not self.enabled:
            self.finish_follow_ups()

    def finish_follow_ups(self) -> None:
        while self._follow_ups:
            self._follow_ups.pop(0).wait()

    def finish_reduces(self) -> None:
        while self._reduces:  # finishing one may start a follow-up
            self._reduces.pop(0).wait()
        self.counts["deferred_follow_ups"] += len(self._follow_ups)
        self.finish_follow_ups()
