"""Facts about process groups and the groups made from them, in one place.

* :func:`group_timeout`: how long a group's collectives wait (HSDP bounds the mesh's groups
  by the world's; debug mode waits at most that long for a missing rank; an asynchronous
  save's group inherits it).
* :func:`twin_group`: a new group over the same ranks with another timeout or backend, made
  once and kept: HSDP's mesh groups bounded by the world's timeout
  (:meth:`~matrixfsdp.runtime.hsdp.MeshGroups.from_mesh`), and the gloo group of an
  asynchronous save's background thread (:func:`matrixfsdp.state.files.save_checkpoint`).
"""

from __future__ import annotations

import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from .._compat import backend_timeout

# group -> {(backend, timeout): its twin}; an entry goes with its group
_twins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_timeout(group: dist.ProcessGroup, device: str | torch.device | None = None
                  ) -> timedelta | None:
    """``group``'s timeout: that of its backend for ``device`` (default: its CPU backend's,
    else its CUDA backend's), or None where torch does not say (no such backend, or one
    without options). torch's own default when None is
    ``torch.distributed.constants.default_pg_timeout`` (30 minutes)."""
    for d in (device,) if device is not None else ("cpu", "cuda"):
        try:
            return backend_timeout(group, torch.device(d))
        except Exception:  # noqa: BLE001 (no such backend, or no options)
            continue
    return None


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still a live process group (not destroyed since it was made)."""
    try:
        dist.get_backend(group)
        return True
    except (KeyError, ValueError, RuntimeError):
        return False


def twin_group(group: dist.ProcessGroup, *, backend: str | None = None,
               timeout: timedelta | None = None, local: bool | None = None
               ) -> dist.ProcessGroup:
    """A process group of ``group``'s ranks with ``backend`` (default: ``group``'s own) and
    ``timeout`` (default: ``group``'s own, :func:`group_timeout`), made on the first call and
    returned again by every later one with the same ``backend`` and ``timeout``, as long as
    ``group`` and the twin are both live (after ``destroy_process_group`` a call makes a new
    one).

    Making it is a collective: ``local=True``: of ``group``'s ranks only (torch's
    ``use_local_synchronization``), so ranks may make the twins of different groups at once
    (each rank its own shard group); ``local=False``: of every rank of the world, as any new
    group. Default: ``local`` unless ``group`` is the whole world. Whether a twin exists is
    the same on every rank that made it, so a later call is a collective exactly where the
    first was."""
    if timeout is None:
        timeout = group_timeout(group)
    if backend is None:
        backend = dist.get_backend(group)
    made = _twins.setdefault(group, {})
    key = (str(backend), timeout)
    twin = made.get(key)
    if twin is None or not _registered(group) or not _registered(twin):
        ranks = dist.get_process_group_ranks(group)
        whole = len(ranks) == dist.get_world_size()
        if local is None:
            local = not whole
        twin = dist.new_group(None if whole and not local else ranks, timeout=timeout,
                              backend=backend, use_local_synchronization=local)
        made[key] = twin
    return twin
