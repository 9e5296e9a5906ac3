"""What one collective moves, by NCCL's algorithms: one arithmetic for the runtime's counters
(:class:`~matrixfsdp.runtime.collectives.CommStats`), the planner's predictions
(:mod:`~matrixfsdp.layout.traffic`, :mod:`~matrixfsdp.costs.comm_costs`) and the test
backends (:mod:`matrixfsdp.testing`). A collective ends when its most loaded rank is done,
so each op is charged to that rank (``critical``), beside this rank's own bytes and the
mean over ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    """Bytes one collective moves: this rank's sent and received, its most loaded rank's
    ``max(sent, received)`` (``critical``), and the mean over ranks of what one sends."""

    sent: int
    received: int
    critical: int
    mean: int


def op_load(kind: str, nbytes: int, P: int, rank: int, root: int | None = None) -> Load:
    """What one collective over ``P`` ranks moves for group rank ``rank``, from the
    ``nbytes`` of the buffer handed to it (an all-gather's output, a reduce-scatter's input,
    a broadcast's / reduce's / all-reduce's tensor):

    * ``all_gather`` / ``reduce_scatter``: a ring; every rank sends and receives
      ``(P-1)/P`` of the buffer. ``all_reduce``: twice that.
    * ``broadcast`` / ``reduce`` (from / to ``root``): pipelined along the ring that starts
      (ends) at the root: the root only sends (receives), the far end only receives (sends),
      everyone else moves the buffer once each way.
    """
    if P == 1:
        return Load(0, 0, 0, 0)
    if kind in ("broadcast", "reduce"):
        toward = kind == "reduce"
        far = (root + 1) % P if toward else (root - 1) % P
        sends = rank != (root if toward else far)
        receives = rank != (far if toward else root)
        return Load(nbytes * sends, nbytes * receives, nbytes, nbytes * (P - 1) // P)
    b = (2 if kind == "all_reduce" else 1) * nbytes * (P - 1) // P
    return Load(b, b, b, b)
