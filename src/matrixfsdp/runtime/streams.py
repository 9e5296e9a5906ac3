"""Which stream the library's collectives wait on: the compute stream only at ``unshard``.

On a device with streams (CUDA), a collective issued with ``async_op=True`` runs on the
backend's own stream, ordered after the work the issuing stream holds, and ``wait()``
makes the *calling* stream wait for it (NCCL's wait blocks no host thread). So a stage that
waits for another collective before it issues its own (a unit's gather after the replicas'
broadcast of its matrices; the tp hop's assembly; HSDP's replicate-dim reduce after the
shard group's) would stall the compute stream if it ran there. Here such chains run on one
side stream, FSDP2's all-gather stream:

* :meth:`Streams.comm`: the side stream first waits for the compute stream's work so far
  (the shards it reads were written there; a buffer the compute stream freed is not reused
  before the compute stream is done with it), then the enclosed code issues and waits on
  it: a unit's prefetch (the replicas' broadcast it waits for, its gather, the tp hop);
* :meth:`Streams.chain`: a shard-group reduce whose follow-ups (the gradients' tp hop,
  HSDP's replicate-dim reduce; under both, the hop and then the replicate-dim reduce, the
  hop chained in turn) are issued at once from the side stream, each as soon as the one
  before it is done on the device, not when the schedule next waits for it; their buffers
  stay referenced until the compute stream has waited for the side stream;
* :class:`Ready`: the point (an event) on the side stream after such a chain, which the
  compute stream waits for, at a unit's ``unshard`` (before it reads the gathered
  parameters) and where the schedule finishes a reduce (before the compute stream reads a
  gradient, or a buffer the chain used is released): by event, never the whole side
  stream, so a later prefetch queued there does not hold the compute stream.

Without streams (CPU: gloo's ``wait()`` blocks the host) every method is a no-op and the
code runs as it did, in the same order; ``module`` lets a test stand in a device module
that records the order of the streams' waits (``tests/runtime/test_streams.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .collectives import Pending


class Streams:
    """The side stream of one root's collectives on ``device`` (none on CPU)."""

    def __init__(self, device: torch.device, module: Any = None):
        mod = module if module is not None else getattr(torch, device.type, None)
        available = getattr(mod, "is_available", None)
        self.enabled = module is not None or (
            device.type not in ("cpu", "meta") and hasattr(mod, "Stream")
            and callable(available) and available())
        self._mod = mod if self.enabled else None
        self.side = mod.Stream(device=device) if self.enabled else None

    @contextlib.contextmanager
    def comm(self) -> Iterator[Ready]:
        """Run the enclosed issues and waits on the side stream, after the compute stream's
        work so far; the :class:`Ready` it yields is, once the block is left, the side
        stream's point the compute stream waits for (nested: on the side stream already,
        nothing more)."""
        ready = Ready()
        if not self.enabled or self._mod.current_stream() == self.side:
            yield ready
            return
        self.side.wait_stream(self._mod.current_stream())
        with self._mod.stream(self.side):
            yield ready
            ready.event = self._mod.Event()
            ready.event.record(self.side)
        ready.streams = self

    def chain(self, pending: Pending) -> Pending:
        """Finish ``pending`` now on the side stream (its waits make the side stream wait;
        its epilogues run there and may issue follow-ups from it) and return what the
        compute stream waits for in its place: the side stream's point after it, holding
        ``pending``'s buffers until then. Without streams: ``pending`` itself, finished
        later."""
        if not self.enabled:
            return pending
        keep = pending.holding()
        with self.comm() as ready:
            pending.wait()
        return Pending(ready, keep=keep, label=pending.label)


class Ready:
    """A point on the side stream (an event recorded there) that the compute stream waits
    for: :meth:`wait` (a work's ``wait()``: the calling stream waits, the host does not)."""

    def __init__(self):
        self.event: Any = None
        self.streams: Streams | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.streams._mod.current_stream().wait_event(self.event)

    def is_completed(self) -> bool:
        return self.event is None or bool(self.event.query())
