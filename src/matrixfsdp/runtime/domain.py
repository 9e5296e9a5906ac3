"""The ranks a unit is sharded over: one :class:`Domain` per distinct ``fully_shard`` mesh.

Most models have one. Expert parallelism gives the experts' units a mesh of their own, as
in FSDP2 and torchtitan: the experts are DTensors split over an ``ep`` dim, and their
``fully_shard`` runs over the data-parallel ranks outside it (``dp_shard_mod_ep``), while
the dense units run over every data-parallel rank (the flattened dp x ep). Each domain
plans its own units (its ranks hold its parameters: each expert whole on one rank of the
experts' mesh, as any expert stack) and moves them over its own groups; everything a step
needs stays local to the owners, so the domains never talk to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..layout.types import Plan
from .collectives import Comm, CommStats, group_capabilities
from .hsdp import MeshGroups, Replication


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh's collectives run on (the current one of its type)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


@dataclass
class Domain:
    """One mesh's groups, the :class:`Comm` of its shard group, HSDP's
    :class:`Replication` over its replicate group, and the plan of its units."""

    mesh: DeviceMesh
    groups: MeshGroups
    comm: Comm
    replication: Replication
    plan: Plan

    @classmethod
    def of(cls, mesh: DeviceMesh, groups: MeshGroups, plan: Plan, stats: CommStats) -> Domain:
        """The domain of ``mesh``; each of its groups asked once whether it coalesces ops
        into one launch and averages in the collective (a collective of the mesh's ranks,
        at set-up)."""
        device = mesh_device(mesh)
        can = group_capabilities(groups.shard, device)
        shard = Comm(groups.shard, stats, coalesce=can.coalesce, device=device,
                     average=can.average)
        rep = None
        if groups.replicas > 1:
            can = group_capabilities(groups.replicate, device)
            rep = Comm(groups.replicate, stats, "replicate_", coalesce=can.coalesce,
                       device=device, average=can.average)
        return cls(mesh, groups, shard, Replication(groups, rep), plan)

    @property
    def shard_rank(self) -> int:
        """This rank in the shard group (where a unit's buffers are split)."""
        return self.groups.shard_rank

    @property
    def size(self) -> int:
        """Every rank of the mesh."""
        return self.mesh.size()
