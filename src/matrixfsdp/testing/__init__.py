"""Process groups for tests of code built on this library (docs/testing.md): ``"hollow"``
(:class:`~.hollow.Hollow`), one process playing any rank of a world of any size, every
collective complete at once (P = 16384 on a laptop); ``"grouped_gloo"``
(:class:`~.grouped_gloo.GroupedGloo`), gloo with NCCL's coalesced launches and uneven
gathers, so the NCCL path runs on CPU ranks. Both count in :data:`COUNTS` the launches, ops
and bytes NCCL would see::

    from matrixfsdp import testing
    testing.register("hollow")
    dist.init_process_group("hollow", store=dist.HashStore(), rank=16383, world_size=16384)
    ...
    testing.COUNTS.reset(); step(); print(testing.COUNTS.launches, testing.COUNTS.ops)
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from .counts import COUNTS, Counts
from .grouped_gloo import SETTINGS, GroupedGloo, Link
from .hollow import Hollow

__all__ = ["COUNTS", "Counts", "GroupedGloo", "Hollow", "Link", "register"]

def register(backend: str, *, coalesce: bool = True, link: Link | None = None) -> str:
    """Make ``backend`` (``"hollow"`` or ``"grouped_gloo"``) a backend name for
    ``init_process_group`` / ``new_group`` (CPU tensors); returns it. ``grouped_gloo``
    only: the groups made after it take these settings: ``coalesce`` False refuses
    coalescing, as gloo does; ``link`` delays every launch by its latency and its most
    loaded rank's bytes over the link."""
    if backend == "grouped_gloo":
        SETTINGS.update(coalesce=coalesce, link=link)
    elif backend != "hollow":
        raise ValueError(f"matrixfsdp.testing.register: no test backend {backend!r} "
                         "(hollow, grouped_gloo)")
    if backend not in dist.Backend.backend_list:
        dist.Backend.register_backend(backend, _CREATORS[backend], devices=["cpu"])
    return backend


def _hollow(store, rank: int, size: int, timeout: timedelta) -> Hollow:
    return Hollow(rank, size)


def _grouped_gloo(store, rank: int, size: int, timeout: timedelta) -> GroupedGloo:
    return GroupedGloo(store, rank, size, timeout)


_CREATORS = {"hollow": _hollow, "grouped_gloo": _grouped_gloo}
