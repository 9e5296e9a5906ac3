"""``matrixfsdp.fully_shard``: FSDP2's ``fully_shard``, with each Muon matrix whole on one owner.

The runtime makes the unit and, at the root's call, plans and shards the model
(:func:`~matrixfsdp.runtime.module.make_unit`); this call then gives the module what
FSDP2's DTensor parameters give it without hooks: torch's ``state_dict`` /
``load_state_dict`` (:mod:`~matrixfsdp.tensors.module_hooks`) and, for the optimizers that
will step its parameters, their step pre-hooks (:mod:`~matrixfsdp.optim.watch`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .layout.types import MuonFilter
from .optim.watch import watch_new_optimizers
from .runtime.mixed_precision import MixedPrecisionPolicy
from .runtime.module import make_unit
from .runtime.unit import ShardOptions
from .tensors.module_hooks import install_module_hooks


def fully_shard(module: nn.Module, *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | None = None,
                muon_filter: MuonFilter | None = None,
                mp_policy: MixedPrecisionPolicy | None = None, debug: bool = False,
                overlap: bool = True, sync_module_states: bool = False,
                offload_policy: object = None, independent_replicas: bool = False,
                tp_ownership: str = "auto") -> nn.Module:
    """Make ``module`` one communication unit, like FSDP2's ``fully_shard``.

    Call it on every block, bottom-up, then on the root. The unit holds the module's
    parameters that no inner unit holds. When the root's call returns, all units are
    planned together and sharded: Muon matrices (by default the 2-D weights inside the
    non-root units, except embeddings) go whole to one owner rank each; all other
    parameters are split by rows over the ranks. From then on every ``nn.Parameter``
    object of the model is this rank's shard (the same objects as before the call, so
    any parameter list, read before or after, is right). A model sharded with a single
    call (no inner unit) is sharded at its first use instead, with the same objects.

    Args:
        mesh: a 1-D device mesh over the data-parallel ranks (default: all ranks on the
            current accelerator, or CPU), or a 2-D ``(replicate, shard)`` mesh for HSDP
            (as FSDP2: sharded over dim 1, replicated over dim 0; each Muon matrix is
            stepped by one replica and broadcast to the others, see docs/hsdp.md). With
            tensor parallelism: the data-parallel dims of the mesh whose tp dim the TP
            plan used (``mesh["dp"]`` after ``parallelize_module(..., mesh["tp"], ...)``;
            docs/nd-parallel.md).
        reshard_after_forward: free the unsharded parameters after forward and gather
            them again in backward. None: True for blocks, False for the root.
        muon_filter: ``(fqn, param) -> bool`` deciding which parameters are Muon matrices;
            read from the root call. FQNs are relative to the root module.
        mp_policy: torch's ``torch.distributed.fsdp.MixedPrecisionPolicy`` for this unit:
            gather and compute in ``param_dtype``, average gradients in ``reduce_dtype``;
            shards, their gradients and the optimizer state keep the parameters' dtype.
        debug: read from the root call. Before every gather and reduce, all ranks compare
            (step, unit, phase) and raise the same error naming each rank's position if
            they differ (docs/troubleshooting.md).
        overlap: read from the root call. Gather the next unit while this one computes
            (forward and backward) and reduce gradients asynchronously (docs/overlap.md).
        sync_module_states: read from the root call. When the model is sharded, every
            rank checks that all ranks hold the same initial values (one small collective)
            and raises naming the first parameter that differs; True copies rank 0's
            values instead (docs/troubleshooting.md).
        offload_policy: FSDP2's CPU offload is not implemented: anything but None (or
            FSDP2's default ``OffloadPolicy()``) raises NotImplementedError.
        independent_replicas: allow a mesh that leaves out a data-parallel dim of size
            > 1 of its parent (``mesh["shard"]`` of a ``(replicate, shard)`` mesh): each
            replica then trains on its own, nothing averages across them (see
            :func:`~matrixfsdp.runtime.mesh_checks.check_mesh`).
        tp_ownership: read from the root call. Under tensor parallelism, who owns a Muon
            matrix the TP plan split: ``"rank"``, one tp rank of its data-parallel owner
            (held whole there: the other tp ranks' slices hop to and from it in every gather
            and reduce, its Newton-Schulz runs on that one GPU); ``"group"``, that owner's
            whole tp group (each tp rank keeps and steps its own slice: nothing crosses the
            tp group in forward or backward, and the Newton-Schulz runs over the group,
            summing the Gram of the slices once per iteration inside the node);
            ``"auto"`` (the default), whichever the model's costs find cheaper, matrix by
            matrix (:func:`~matrixfsdp.layout.assign.tp_group_owned`; docs/nd-parallel.md).
    Returns:
        ``module``, whose class now also derives from :class:`matrixfsdp.FSDPModule`
        (FSDP2's module methods).
    """
    make_unit(module, ShardOptions(
        mesh=mesh, reshard_after_forward=reshard_after_forward, muon_filter=muon_filter,
        mp_policy=mp_policy, debug=debug, overlap=overlap, sync_module_states=sync_module_states,
        offload_policy=offload_policy, independent_replicas=independent_replicas,
        tp_ownership=tp_ownership))
    install_module_hooks(module)
    watch_new_optimizers()
    return module
