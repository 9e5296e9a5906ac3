"""One parameter under MatrixFSDP: where it lives and which unit moves it.

FSDP2 keeps an ``FSDPParam`` per parameter; this is ours. Every module that needs to know
something about a sharded parameter (the optimizer, clipping, checkpoints, init) asks
:func:`sharded_param` and reads the answer; nothing else reads attributes off tensors.

* a **sharded** parameter (what ``model.parameters()`` holds after ``fully_shard``) maps
  to its :class:`ShardedParam`: the plan's :class:`~matrixfsdp.plan.Placement`, its index
  in its unit, and the unit (whose ``root`` holds the groups, plan and counters);
* a parameter of a unit not sharded yet maps to that unit (:func:`pending_unit`).

Sharding keeps the ``nn.Parameter`` objects: each original becomes its shard (its data
rebound to a view of the unit's storage), so a parameter list read at any time is right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .plan import Placement

if TYPE_CHECKING:
    from .root import Root
    from .unit import Unit

_INFO = "_mf_param"  # on a shard: its ShardedParam
_PENDING = "_mf_pending"  # on a parameter not sharded yet: the unit that will shard it


@dataclass(eq=False)
class ShardedParam:
    """What MatrixFSDP knows about one sharded parameter."""

    placement: Placement
    unit: Unit
    index: int  # in the unit's parameter list

    @property
    def name(self) -> str:
        """The fully qualified name under the root (the plan's name; tied ones share it)."""
        return self.placement.spec.name

    @property
    def root(self) -> Root:
        return self.unit.root

    @property
    def is_matrix(self) -> bool:
        """A Muon matrix (or expert stack), stepped whole where this rank holds it."""
        return self.placement.spec.muon

    def steps_here(self) -> bool:
        """Whether this rank's copy gets a gradient and is stepped (HSDP: a 2-D matrix only
        in the replica that owns it)."""
        return self.root.groups.steps_here(self.placement)


def sharded_param(p: Any) -> ShardedParam | None:
    """The :class:`ShardedParam` of a sharded parameter, None for any other tensor."""
    return getattr(p, _INFO, None)


def placement_of(p: Any) -> Placement | None:
    """Where a sharded parameter lives (None for any other tensor)."""
    info = getattr(p, _INFO, None)
    return info.placement if info is not None else None


def pending_unit(p: Any) -> Unit | None:
    """The unit that will shard parameter ``p`` (None once sharded, or never)."""
    unit = getattr(p, _PENDING, None)
    return unit if unit is not None and unit.root is None else None


def root_of(p: Any) -> Root | None:
    info = getattr(p, _INFO, None)
    return info.root if info is not None else None


def mark_pending(p: torch.Tensor, unit: Unit) -> None:
    setattr(p, _PENDING, unit)


def mark_sharded(p: torch.Tensor, info: ShardedParam) -> None:
    setattr(p, _INFO, info)


def unmark_sharded(p: torch.Tensor, unit: Unit) -> None:
    """``p`` holds its full tensor again and waits for ``unit`` to shard it."""
    if hasattr(p, _INFO):
        delattr(p, _INFO)
    setattr(p, _PENDING, unit)
