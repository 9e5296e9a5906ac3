"""Staging a state for ``dcp.async_save``.

For ``dcp.async_save`` a state must first be *staged*: copied, so that training can change
the live tensors while a background thread writes. :class:`RowShardStager` (used by
``matrixfsdp.save_checkpoint(..., async_save=True)``) stages it: each ``RowShard`` becomes a
``RowShard`` of a CPU copy of ``.local`` with the same shape and offsets, every other tensor
a CPU copy, every other value a deep copy (torch's default stager works too, through
``_local_tensor``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ..tensors.row_shard import RowShard


def _cpu_copy(t: torch.Tensor, pin: bool, pool: dict | None = None, key: tuple = ()) -> torch.Tensor:
    """A CPU copy of ``t``. From an accelerator: into pinned memory, non-blocking (the caller
    synchronizes once for all copies). ``pool``: the buffers of the previous staging, by
    place in the state; one of the same shape, dtype and pinning is written again instead
    of allocating (the save that read it has finished: a save waits for the one in flight)."""
    t = t.detach()
    out = pool.get(key) if pool is not None else None
    if out is None or out.shape != t.shape or out.dtype != t.dtype or out.is_pinned() != pin:
        if t.device.type == "cpu" and pool is None:
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        if pool is not None:
            pool[key] = out
    out.copy_(t, non_blocking=pin)
    return out


def stage_state(state: Any, pool: dict | None = None) -> Any:
    """A copy of ``state`` (nested dicts, lists and tuples of :class:`RowShard` s, tensors and
    plain values) that no later change to the live tensors can reach, in CPU memory.

    A ``RowShard`` becomes a ``RowShard`` of a CPU copy of ``.local`` with the same shape and
    offsets (so DCP plans and writes exactly the chunks the live one would), a tensor a CPU
    copy, any other value a ``copy.deepcopy``. An object met twice (a tied parameter under
    two names) is copied once. From an accelerator, ``RowShard`` rows go to pinned memory
    and the copies are awaited before this returns. The memory cost is one CPU copy of this
    rank's rows (parameters and optimizer state): each element once over all ranks.
    ``pool`` (a dict kept between stagings): the copies are written into the previous
    staging's buffers where they fit, so repeated saves allocate (and pin) host memory once.
    """
    memo: dict[int, Any] = {}
    devices: set[torch.device] = set()

    def stage(obj: Any, key: tuple) -> Any:
        if id(obj) in memo:
            return memo[id(obj)]
        if isinstance(obj, RowShard):
            pin = obj.local.device.type != "cpu" and torch.accelerator.is_available()
            if pin:
                devices.add(obj.local.device)
            out: Any = obj.like(_cpu_copy(obj.local, pin, pool, key))
        elif isinstance(obj, torch.Tensor):
            out = _cpu_copy(obj, False, pool, key)
        elif isinstance(obj, dict):
            out = {k: stage(v, (*key, k)) for k, v in obj.items()}
        elif isinstance(obj, list):
            out = [stage(v, (*key, i)) for i, v in enumerate(obj)]
        elif type(obj) is tuple:
            out = tuple(stage(v, (*key, i)) for i, v in enumerate(obj))
        else:
            out = copy.deepcopy(obj)
        memo[id(obj)] = out
        return out

    staged = stage(state, ())
    for device in devices:  # the non-blocking copies into pinned memory have landed
        torch.accelerator.synchronize(device)
    return staged


class RowShardStager(AsyncStager):
    """The stager ``dcp.async_save`` gets from ``matrixfsdp.save_checkpoint``: stages with
    :func:`stage_state`, in the calling thread, before ``async_save`` returns (so the
    checkpoint holds the values at the time of the call, whatever training does next),
    into ``pool``'s buffers of the previous save where they fit. Nothing to synchronize or
    close afterwards."""

    _synchronize_after_execute = False

    def __init__(self, pool: dict | None = None):
        self.pool = pool  # the buffers kept between saves (stage_state's)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return stage_state(state_dict, self.pool)

    def synchronize_staging(self) -> None:  # staging is done when stage returns
        pass

    def close(self) -> None:
        pass
