"""Checks of the meshes ``fully_shard`` is given: its arguments, that the mesh holds the
calling rank, and which data-parallel dims of the parent mesh a mesh covers (torchtitan's
meshes: size-1 and flattened dims)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._compat import flattened_dims, root_mesh
from ..layout.assign import TP_OWNERSHIPS


def check_args(mesh: DeviceMesh, reshard_after_forward: object, offload_policy: object,
               independent_replicas: bool, tp_ownership: object = "auto") -> None:
    """Refuse what fully_shard does not support, naming what to do instead."""
    if tp_ownership not in TP_OWNERSHIPS:
        raise ValueError(f"matrixfsdp: tp_ownership={tp_ownership!r}: one of "
                         f"{', '.join(map(repr, TP_OWNERSHIPS))}")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise NotImplementedError(
            f"matrixfsdp: offload_policy={type(offload_policy).__name__} (CPU offload) is not "
            "supported; keep parameters on the accelerator, shard over more ranks, or use a "
            "MixedPrecisionPolicy with bf16 param_dtype to cut memory")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"matrixfsdp: reshard_after_forward={reshard_after_forward!r}: only True, False or "
            "None are supported (FSDP2's int, resharding to a smaller group after forward, is "
            "not implemented here)")
    if mesh.ndim not in (1, 2):
        raise NotImplementedError(
            f"matrixfsdp: fully_shard needs a 1-D mesh or a 2-D (replicate, shard) mesh for "
            f"HSDP, got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}"
            + (f" ({_sizes(mesh.mesh_dim_names, mesh.shape)}): pass its data-parallel sub-mesh, "
               "e.g. mesh['fsdp'], or mesh['dp_replicate', 'fsdp'] for HSDP (size-1 dims count "
               "for nothing)" if mesh.mesh_dim_names else ""))
    check_member(mesh)
    check_mesh(mesh, independent_replicas)


def check_member(mesh: DeviceMesh) -> None:
    """Refuse a mesh that does not hold this rank, naming the rank and the mesh (before:
    ``IndexError: list index out of range`` from torch, deep in the set-up of its groups)."""
    if not dist.is_initialized() or mesh.get_coordinate() is not None:
        return
    names = f" ({', '.join(mesh.mesh_dim_names)})" if mesh.mesh_dim_names else ""
    raise ValueError(
        f"matrixfsdp: rank {dist.get_rank()} is not in the mesh it was given: a "
        f"{'x'.join(map(str, mesh.shape))} {mesh.device_type} mesh{names} of ranks "
        f"{mesh.mesh.tolist()}. Every rank that calls fully_shard must be in its mesh: build the "
        "part of the model it trains on its own mesh (a pipeline stage's), or pass a mesh that "
        "holds it")


# Dim names the mesh check reads (lower case). Ranks along a data-parallel dim train the same
# parameters on other data, so a mesh must cover every such dim of size > 1 of the mesh it
# was sliced from; the ranks along any other dim (pp, tp, ep and unknown names) hold other
# parameters and need no averaging.
REPLICATE_DIM_NAMES = ("replicate", "dp_replicate", "dp", "ddp", "hsdp")
SHARD_DIM_NAMES = ("shard", "dp_shard", "fsdp", "efsdp", "dp_shard_mod_ep", "dp_shard_in_ep",
                   "dp_shard_cp", "dp_cp", "batch")
CONTEXT_DIM_NAMES = ("cp",)  # context parallel: gradients from other tokens, averaged too
# A flattened dim of these names splits the experts (torchtitan 0.2's ``ep``, flattened from
# ``dp_shard_in_ep`` and ``cp``): the data dims inside it are expert parallel for the
# parameters of a mesh that leaves them out (``dp_shard_mod_ep``, the experts' mesh).
EXPERT_DIM_NAMES = ("ep",)


def _sizes(names, shape) -> str:
    return ", ".join(f"{n}={s}" for n, s in zip(names, shape))


def _data_kind(name: str) -> str | None:
    n = name.lower()
    return ("replicate" if n in REPLICATE_DIM_NAMES else "context" if n in CONTEXT_DIM_NAMES
            else "shard" if n in SHARD_DIM_NAMES else None)


def _groups_along(root: DeviceMesh) -> dict[str, set[int]] | None:
    """The global ranks of this rank's group along each dim of ``root`` and along each
    dim flattened from it (``_compat.flattened_dims``: ``dp_shard_cp``, ``dp_cp``, ...)."""
    coord, full = root.get_coordinate(), root.mesh
    if coord is None or tuple(full.shape) != tuple(root.shape):
        return None
    out = {}
    for d, name in enumerate(root.mesh_dim_names):
        index = list(coord)
        index[d] = slice(None)
        out[name] = set(full[tuple(index)].flatten().tolist())
    for name, flat in flattened_dims(root).items():
        out[name] = set(flat.mesh.flatten().tolist())
    return out


def _left_out(mesh: DeviceMesh) -> tuple[DeviceMesh, list[tuple[str, int]]] | None:
    """The named mesh ``mesh`` was sliced from and its data-parallel dims (name, size > 1)
    whose ranks ``mesh`` leaves out; None if that cannot be read (see :func:`check_mesh`)."""
    root = root_mesh(mesh)
    if root is mesh or root.ndim < 2 or not root.mesh_dim_names:
        return None
    along = _groups_along(root)
    if along is None:
        return None
    mine = set(mesh.mesh.flatten().tolist())
    experts = [g for n, g in along.items() if n.lower() in EXPERT_DIM_NAMES and not g <= mine]
    return root, [(name, size) for name, size in zip(root.mesh_dim_names, root.shape)
                  if size > 1 and _data_kind(name) and not along[name] <= mine
                  and not any(along[name] <= g for g in experts)]


def sliced_from_named_world(mesh: DeviceMesh) -> bool:
    """Whether ``mesh`` is a slice of a mesh with named dims over every rank that leaves
    out none of its data-parallel dims: the ranks outside it hold other parameters
    (pipeline stages), and nothing is left to warn about."""
    found = _left_out(mesh)
    return (found is not None and not found[1] and dist.is_initialized()
            and found[0].size() == dist.get_world_size())


def check_mesh(mesh: DeviceMesh, independent_replicas: bool = False) -> None:
    """Refuse a mesh sliced from a larger one (``mesh["shard"]`` of a ``("replicate",
    "shard")`` mesh) that leaves out a data-parallel dim of size > 1 of that mesh: the
    ranks along it hold the same parameters and see other data, and nothing would average
    their gradients, so the replicas would train apart, silently.

    Read from the mesh the slice comes from (torch's root mesh) and this rank's groups in
    it: a dim is covered when this rank's group along it lies inside the mesh's ranks, so
    a flattened dim (``dp_shard_cp``, ``dp_cp``, flattened from ``dp_shard`` and ``cp``)
    covers the dims it was flattened from, and a size-1 dim is always covered (one
    replica). Data-parallel dims, by name: replicate dims (``replicate``, ``dp_replicate``,
    ``dp``, ``ddp``, ``hsdp``: pass the 2-D ``(replicate, shard)`` mesh for HSDP), shard
    dims (``shard``, ``dp_shard``, ``fsdp``, ``dp_shard_mod_ep``, ``dp_shard_in_ep``, ...)
    and ``cp`` (context parallel ranks compute gradients from other tokens of the same
    sequences: they are averaged over ``cp`` as well, which is why torchtitan shards over
    ``dp_shard_cp``). A data dim inside a flattened ``ep`` dim is expert parallel (the
    experts' ``dp_shard_mod_ep`` mesh). ``pp``, ``tp``, ``ep`` and other names are other
    parameters and pass (a mesh over part of the world is warned about at sharding).

    Not seen: a mesh whose root has no other named dims. torchtitan 0.3's ``ParallelDims``
    unflattens a 1-D ``("world",)`` mesh, which stays the root of every mesh it makes, so
    ``dense["fsdp"]`` there passes whatever ``dp_replicate`` is."""
    if mesh.ndim > 2 or independent_replicas:
        return
    found = _left_out(mesh)
    if found is None or not found[1]:
        return
    root, apart = found
    bad = [n for n, _ in apart]
    names = mesh.mesh_dim_names or ()
    kinds = {n: _data_kind(n) for n in bad}
    hints = []
    rep = [n for n in bad if kinds[n] == "replicate"]
    if rep:
        hints.append(f"for HSDP pass the 2-D mesh mesh[{(rep[0], *names)!r}] (replicate, shard)"
                     if len(bad) == 1 and mesh.ndim == 1 else
                     "for HSDP pass the 2-D mesh (replicate, shard) that covers them")
    cp = [n for n in bad if kinds[n] == "context"]
    if cp:
        hints.append(f"context parallel ranks ({cp[0]}) compute gradients from other tokens, "
                     "which must be averaged too: shard over a dim flattened from the shard "
                     f"dim and {cp[0]} (torchtitan: mesh['dp_shard', '{cp[0]}']"
                     "._flatten('dp_shard_cp'))")
    shard = [n for n in bad if kinds[n] == "shard"]
    if shard:
        hints.append(f"pass a mesh that covers {shard} too (a dim flattened from them and "
                     "the mesh's dims, or the 2-D (replicate, shard) mesh)")
    raise ValueError(
        f"matrixfsdp: the mesh ({_sizes(names, mesh.shape)}) is part of a mesh with dims "
        f"({_sizes(root.mesh_dim_names, root.shape)}); over its {bad} "
        f"dim{'s' if len(bad) > 1 else ''} ({_sizes(bad, [s for _, s in apart])}) the replicas "
        "would train apart (nothing averages their gradients): " + "; ".join(hints)
        + ". To train independent replicas on purpose pass independent_replicas=True")
