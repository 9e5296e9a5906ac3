"""HSDP: the groups of a 2-D ``(replicate, shard)`` mesh, and what crosses the replicate dim.

A unit's parameters are sharded over the ranks of a shard group, identically in every
replica (the plan's storage is per shard rank). Each 2-D Muon matrix also has one owner
*replica*, so one world rank in all runs its NS (the plan balances those over the world):

* backward, once the shard group's reduce of a unit is done: the replicated run of this
  rank's segment (even parameters, expert stacks) is all-reduced (mean) across replicas,
  as in FSDP2's HSDP; the run of matrices stepped by replica i is *reduced* (mean) to
  replica i only (one launch for all of them where the group coalesces: ops grow with the
  replicas that step matrices here, never with the shard group). Only there do those
  matrices get a ``.grad``, so only there does the optimizer step them (and keep momentum).
  These run asynchronously while the backward of the units before it computes, and are
  waited for at the end of backward at the latest.
* after an optimizer step, at the start of the next forward (the root unit's pre-forward):
  each replica's run of every unit is *broadcast* from it to the other replicas, all units
  at once, asynchronously; a unit's gather waits for its own broadcast only, so unit k's
  broadcast travels while units before it compute. Never inside ``optimizer.step()``. A
  gather outside forward (a checkpoint: :func:`sync_replicas`) starts and waits for it
  itself. With ``overlap=False`` each unit broadcasts, synchronously, at its own gather.

A reduce plus a broadcast moves what an all-reduce of the same tensor moves, so summed over
the ranks (the mean rank) the bytes across the replicate dimension equal plain HSDP's; the
busiest holder carries its whole run, more than an even shard (``matrixfsdp plan``'s
``replicate vs FSDP2 HSDP`` column), while NS runs once in the world instead of once per
replica (docs/hsdp.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..diagnosis.timeouts import bound_timeout, group_timeout
from ..layout.types import Placement
from ..layout.units import Segment
from .collectives import Comm, Pending


@dataclass
class MeshGroups:
    """The process groups of a 1-D mesh (``replicas == 1``) or a 2-D ``(replicate, shard)``
    one, and this rank's place in them. ``world_rank = replica * shard_size + shard_rank``
    is the rank the plan uses for owners; ``peers[i]`` is the global rank of this shard
    rank in replica i."""

    shard: dist.ProcessGroup
    shard_rank: int
    shard_size: int
    replicate: dist.ProcessGroup | None
    replica: int
    replicas: int
    world: dist.ProcessGroup  # every rank of the mesh (debug checks, gradient norms)
    peers: list[int]

    @property
    def world_rank(self) -> int:
        return self.replica * self.shard_size + self.shard_rank

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> MeshGroups:
        """The mesh's groups. Every group waits at most the world group's timeout (the one
        the user gave ``init_process_group``), set on the mesh's own groups
        (:func:`~matrixfsdp.diagnosis.timeouts.bound_timeout`): a hang fails in the
        user's time, with no group made."""
        device = mesh.device_type
        limit = group_timeout(dist.group.WORLD, device)

        def bounded(g):
            return bound_timeout(g, limit, device)

        if mesh.ndim == 1:
            g = bounded(mesh.get_group())
            return cls(g, dist.get_rank(g), dist.get_world_size(g), None, 0, 1, g,
                       [dist.get_rank()])
        if mesh.ndim != 2:
            raise NotImplementedError(
                f"matrixfsdp: a {mesh.ndim}-D mesh; fully_shard takes a 1-D mesh or a 2-D "
                "(replicate, shard) mesh for HSDP")
        shard, rep = bounded(mesh.get_group(1)), bounded(mesh.get_group(0))
        ranks = sorted(mesh.mesh.flatten().tolist())
        if ranks == list(range(dist.get_world_size())):
            world = dist.group.WORLD
        else:  # the mesh is part of the world (e.g. one pipeline stage): its own group
            world = dist.new_group(ranks, use_local_synchronization=True, timeout=limit)
        R = dist.get_world_size(rep)
        return cls(shard, dist.get_rank(shard), dist.get_world_size(shard), rep,
                   dist.get_rank(rep), R, world, [dist.get_global_rank(rep, i) for i in range(R)])

    def steps_here(self, placement: Placement) -> bool:
        """Whether this rank's copy of the parameter gets a gradient and is stepped: every
        replicated one, and a 2-D Muon matrix only in its owner replica."""
        return placement.owner is None or placement.owner_replica == self.replica


class Replication:
    """HSDP's steps across the replicate dimension for one root; every method is a no-op
    on a 1-D mesh (``enabled`` False). It keeps, per unit, whether the matrices a replica
    stepped must still be broadcast (set by the optimizer step) and the broadcast in
    flight."""

    def __init__(self, groups: MeshGroups, comm: Comm | None):
        self.groups = groups
        self.comm = comm  # over the replicate group; None on a 1-D mesh
        self.enabled = comm is not None
        self._stale: set[int] = set()  # units whose replica-owned matrices changed
        self._inflight: dict[int, Pending] = {}
        self.max_inflight = 0  # most broadcasts in flight at once (overlap: all units')

    def reduce_across(self, out: torch.Tensor, seg: Segment,
                      divisor: float | None = None) -> Pending:
        """``out`` is this rank's segment of gradients, averaged over its shard group.
        Start averaging it over the replicas: the replicated run (``runs[0]``) on every
        replica, the run of matrices stepped by replica i (``runs[1 + i]``) on replica i
        only. ``out`` is final once the returned collectives are waited for. ``divisor``:
        what the sum is divided by (default: the number of replicas, the mean; 1 after a
        shard-group reduce that divided by a custom factor already)."""
        start, n = seg.runs[0]
        comm = self.comm  # one launch where the group coalesces
        return comm.batch("replicate", ([lambda: comm.all_reduce(out[start:start + n], divisor)]
                                        if n else []) +
                          [(lambda i=i, t=out[a:a + m]: comm.reduce(t, i, divisor))
                           for i, a, m in seg.replica_runs])

    def is_stale(self, unit_index: int) -> bool:
        return unit_index in self._stale

    def mark_stepped(self, unit_index: int) -> None:
        """An optimizer step changed this unit's replica-owned matrices (on one replica)."""
        self.finish_broadcast(unit_index)  # one still in flight (a skipped forward) ends first
        self._stale.add(unit_index)

    def start_broadcast(self, unit_index: int, local: torch.Tensor, seg: Segment) -> None:
        """Start copying the matrices each replica stepped (``runs[1 + i]`` of ``local``)
        from replica i to the others, in place; nothing may touch those rows of ``local``
        until :meth:`finish_broadcast`."""
        if unit_index in self._stale:
            self._stale.discard(unit_index)
            if not seg.replica_runs:  # this shard rank holds none of them
                return
            self._inflight[unit_index] = self.comm.batch(
                "replicate", [(lambda i=i, t=local[a:a + n]: self.comm.broadcast(t, i))
                              for i, a, n in seg.replica_runs])
            self.max_inflight = max(self.max_inflight, len(self._inflight))

    def finish_broadcast(self, unit_index: int) -> None:
        pending = self._inflight.pop(unit_index, None)
        if pending is not None:
            pending.wait()
