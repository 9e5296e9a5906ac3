"""Facts about process groups and the groups made from them, in one place.

* :func:`group_timeout`: how long a group's collectives wait (HSDP bounds the mesh's groups
  by the world's; debug mode waits at most that long for a missing rank; an asynchronous
  save's group inherits it).
* :func:`bound_timeout`: a mesh's own groups (HSDP's, tp's) made to wait at most the
  world's timeout, on the group itself (no twin: on NCCL one more communicator each).
* :func:`twin_group`: a new group over the same ranks with another timeout or backend, made
  once and kept: the gloo group of an asynchronous save's background thread
  (:func:`matrixfsdp.state.files.save_checkpoint`).

A gloo group connects every pair of its ranks when it is made (``connectFullMesh``: P - 1
connections and P - 1 store reads per rank, 16383 at 16384 ranks), whatever its collectives
use. The asynchronous save's group is made with lazy connections instead (gloo connects a
pair at its first use; torch's ``TORCH_GLOO_LAZY_INIT``): made in one store write a rank,
it then holds what DCP's collectives use: every rank on the coordinator (DCP gathers each
rank's plan there), a few on the others (gloo's trees and rings). Measured in
``python -m studies.async_save --group``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from .._compat import backend_timeout, set_group_timeout

# group -> {(backend, timeout, lazy): its twin}; an entry goes with its group
_twins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
LAZY_ENV = "TORCH_GLOO_LAZY_INIT"  # read by ProcessGroupGloo when it is made
_env_lock = threading.Lock()


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


def bound_timeout(group: dist.ProcessGroup, limit: timedelta | None,
                  device: str | torch.device | None = None) -> dist.ProcessGroup:
    """``group`` itself, its collectives made to time out after at most ``limit`` (the world
    group's, the one the user gave ``init_process_group``): ``init_device_mesh`` makes its
    sub-groups with torch's default (30 minutes on gloo, 10 on NCCL), so a hang would outlast
    the user's timeout. Set on the group (no twin: on NCCL a twin is one more communicator,
    its buffers and its set-up), so it applies to every user of the mesh's group, DTensor's
    included; a group whose timeout is already within ``limit`` is left as it is."""
    own = group_timeout(group, device)
    if limit is not None and own is not None and own > limit:
        set_group_timeout(group, limit)
    return group


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still a live process group (not destroyed since it was made)."""
    try:
        dist.get_backend(group)
        return True
    except (KeyError, ValueError, RuntimeError):
        return False


def twin_group(group: dist.ProcessGroup, *, backend: str | None = None,
               timeout: timedelta | None = None, local: bool | None = None,
               lazy: bool | None = None) -> dist.ProcessGroup:
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
    first was.

    ``lazy``: a gloo twin connects each pair of ranks at its first use, not all pairs when
    made (:func:`lazy_gloo`). Default: when ``backend="gloo"`` is asked for by name (the
    asynchronous save's group, beside training on the group's own backend); a twin on the
    group's own backend (HSDP's, tp's) connects as that backend does by default."""
    if lazy is None:
        lazy = backend is not None and str(backend) == "gloo"
    if timeout is None:
        timeout = group_timeout(group)
    if backend is None:
        backend = dist.get_backend(group)
    made = _twins.setdefault(group, {})
    key = (str(backend), timeout, lazy)
    twin = made.get(key)
    if twin is None or not _registered(group) or not _registered(twin):
        ranks = dist.get_process_group_ranks(group)
        whole = len(ranks) == dist.get_world_size()
        if local is None:
            local = not whole
        with lazy_gloo(lazy and str(backend) == "gloo"):
            twin = dist.new_group(None if whole and not local else ranks, timeout=timeout,
                                  backend=backend, use_local_synchronization=local)
        made[key] = twin
    return twin


@contextlib.contextmanager
def lazy_gloo(on: bool = True):
    """Within: a gloo group made (by any thread) connects each pair of ranks at its first use
    (torch's ``TORCH_GLOO_LAZY_INIT``, read when ``ProcessGroupGloo`` is made), unless the
    environment already says (the user's choice stands). A no-op when ``on`` is False."""
    if not on or LAZY_ENV in os.environ:
        yield
        return
    with _env_lock:
        os.environ[LAZY_ENV] = "1"
        try:
            yield
        finally:
            os.environ.pop(LAZY_ENV, None)
