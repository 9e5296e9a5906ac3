"""Overlap: which unit to gather ahead, and the gradient reduces still in flight.

Forward: when unit k starts, the gather of the unit that came after it in the last step's
forward is issued too, so it travels while k computes. Backward: when unit k's backward
starts, the gather of the unit before it in forward order (next in backward) is issued.
Reduces are asynchronous: at most ``max_reduces`` are in flight (each holds a unit-sized
buffer), the oldest is finished when another would exceed that, and all are finished at
the end of backward, before anyone can read a gradient. On gloo the collectives run on
gloo's own threads, so compute and communication overlap on CPU too; on NCCL they run on
NCCL's stream and ``wait()`` orders the compute stream after them.

The order is recorded from the previous step's forward, so the first step runs without
prefetch; ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` (FSDP2's
names) fix the targets explicitly. Every rank runs the same modules in the same order, so
every rank issues the same prefetches in the same order (debug mode checks it).
"""

from __future__ import annotations

from typing import Any

from .comm import Pending


class Schedule:
    def __init__(self, enabled: bool = True, max_reduces: int = 2):
        self.enabled = enabled
        self.max_reduces = max_reduces
        self.order: list[Any] = []  # units, in the last completed step's forward order
        self._this_step: list[Any] = []
        self._reduces: list[Pending] = []

    # ---- order ------------------------------------------------------------------------
    def record(self, unit: Any) -> None:
        if not self._this_step or self._this_step[-1] is not unit:
            self._this_step.append(unit)

    def end_step(self) -> None:
        if self._this_step:
            seen: dict[int, Any] = {}
            for u in self._this_step:
                seen.setdefault(id(u), u)
            self.order = list(seen.values())
        self._this_step = []

    def _neighbour(self, unit: Any, step: int) -> list[Any]:
        try:
            i = self.order.index(unit) + step
        except ValueError:
            return []
        return [self.order[i]] if 0 <= i < len(self.order) else []

    def forward_targets(self, unit: Any) -> list[Any]:
        if not self.enabled:
            return []
        explicit = unit.forward_prefetch
        return explicit if explicit is not None else self._neighbour(unit, +1)

    def backward_targets(self, unit: Any) -> list[Any]:
        if not self.enabled:
            return []
        explicit = unit.backward_prefetch
        return explicit if explicit is not None else self._neighbour(unit, -1)

    # ---- reduces in flight ----------------------------------------------------------------
    def add_reduce(self, pending: Pending) -> None:
        self._reduces.append(pending)
        while len(self._reduces) > (self.max_reduces if self.enabled else 0):
            self._reduces.pop(0).wait()

    def finish_reduces(self) -> None:
        while self._reduces:
            self._reduces.pop(0).wait()
