"""Set-up checks: silent divergence caught before the first step.

* :func:`check_same_init`: ranks whose models were initialised differently (another seed)
  would each shard their own values, and training would mix them silently. One digest
  over all parameters, compared in one small all-reduce; only where it differs are the
  per-parameter digests compared, to name the first parameter that differs;
  ``sync=True`` broadcasts rank 0's values instead. Runs on the full (unsharded) tensors,
  so at ``fully_shard`` time, before the shards are cut. Meta tensors (a model built on the
  meta device and initialised by ``matrixfsdp.init_weights``) are skipped.
* :func:`check_unsharded_trainable` / :func:`check_optimizer_params`: a trainable parameter
  outside every unit (a module added after ``fully_shard``) gets no gradient reduce, so each
  rank would train its own copy.
* :func:`model_setup`: the model's shapes, dtypes, buffers and mixed-precision policies,
  compared across ranks by :func:`~matrixfsdp.diagnosis.agree.check_same_setup` (a digest
  first, details only on a mismatch), as an optimizer's settings are
  (``check_same_optimizer``); a checkpoint's names are checked by ``state/entries.py``.
* :func:`judge_matrix_coverage`: a rank that owns Muon matrices but steps none of them
  (it built no matrix optimizer on ``matrix_params``) while other ranks step theirs: its
  matrices would silently never train. Settled by the first-step comparison of an
  optimizer's settings where every rank steps one of its own; else judged at the next
  forward, once every optimizer of the first step has stepped.
* :func:`agree_on_local_checks`: what one rank's own checks found (a unit of mixed dtypes
  on that rank only) raised on every rank of the mesh, naming the rank, before the first
  collective that rank would miss.

Each compares a fixed-size digest or flag first (O(1) bytes per rank, :mod:`.agree`) and
exchanges more only when something differs, to name the rank, parameter and values.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..diagnosis.agree import any_rank, broadcast_object, every_rank, min_max, object_device
from ..diagnosis.arrival import ranks_text
from .param import sharded_param
from .unit import Unit

_SHOWN = 5


def _digest(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the bits of ``t`` (all elements; every other element), on its
    device: equal tensors give equal digests, differently seeded ones differ."""
    flat = t.detach().contiguous().view(-1)
    nbytes = flat.numel() * flat.element_size()
    bits = flat.view(torch.uint8)
    if nbytes % 4 == 0:
        bits = bits.view(torch.int32)
    elif nbytes % 2 == 0:
        bits = bits.view(torch.int16)
    return torch.stack([bits.sum(dtype=torch.int64), bits[1::2].sum(dtype=torch.int64)])


# int64 constants of splitmix64 (signed), mixing each parameter's digest with its position
_MIX = (0x9E3779B97F4A7C15 - 2 ** 64, 0xBF58476D1CE4E5B9 - 2 ** 64, 0x94D049BB133111EB - 2 ** 64)


def _table_lanes(table: torch.Tensor) -> torch.Tensor:
    """Two int64 lanes of an ``[n, 2]`` table of digests, each depending on every digest
    and its position (splitmix64's mix, int64 arithmetic wrapping), on the table's device."""
    x = table * _MIX[0] + torch.arange(1, len(table) + 1, device=table.device)[:, None] * _MIX[1]
    x = x ^ (x >> 30)
    x = x * _MIX[2]
    return (x ^ (x >> 27)).sum(0)


def check_same_init(named_params: Iterable[tuple[str, torch.Tensor]], group: Any = None, *,
                    sync: bool = False) -> int:
    """Raise ``ValueError`` on every rank of ``group`` (default: the world) naming the first
    parameter whose initial values differ between ranks; with ``sync=True`` copy rank 0's
    values into every rank's tensors instead (a broadcast per parameter). Meta tensors are
    skipped. Returns the number of parameters compared (or synced).

    A collective. When the ranks agree: two int64 digests per parameter (on its device,
    no host sync per parameter), folded into one digest of all of them, compared in one
    all-reduce of 48 bytes. Only on a mismatch (the failure path) rank 0's per-parameter
    digests are broadcast (16 bytes per parameter), each rank finds its first parameter
    that differs, one all-reduce picks the first, and one int64 per rank names the ranks
    that differ there (P of them, as the message does).

    Call it on the full tensors before sharding, e.g. ``check_same_init(
    model.named_parameters(), mesh_world_group)``.
    """
    named = [(n, p) for n, p in named_params if not p.is_meta]
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or not named:
        return len(named)
    if sync:
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for _, p in named:
                dist.broadcast(p.data, src=src, group=group)
        return len(named)
    here = named[0][1].device
    table = torch.stack([_digest(p).to(here) for _, p in named])
    low, high, _ = min_max([len(named), *_table_lanes(table).tolist()], group)
    if low == high:
        return len(named)
    if low[0] != high[0]:
        counts = [c for c, in every_rank([len(named)], group)]
        raise ValueError("matrixfsdp: ranks hold different numbers of parameters at set-up ("
                         + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
                         + "); every rank must build the same model")
    device = object_device(group)
    table = table.to(device)
    reference = table.clone()
    dist.broadcast(reference, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    differs = (table != reference).any(1)
    mine = differs.nonzero()
    i = min_max([int(mine[0]) if len(mine) else None], group)[0][0]
    if i is None:
        return len(named)  # the folded digests collided, the parameters agree
    differ = [r for r, (d,) in enumerate(every_rank([int(differs[i])], group, device)) if d]
    raise ValueError(
        f"matrixfsdp: parameter '{named[i][0]}' differs between ranks at set-up (ranks "
        f"{differ} hold other initial values than rank 0): seed every rank alike before "
        "building the model (torch.manual_seed), load the same weights everywhere, or "
        "ask for rank 0's values to be copied to every rank (sync=True)")


def check_unsharded_trainable(model: nn.Module, unsharded: set[int] = frozenset()) -> None:
    """Raise ``ValueError`` naming a trainable parameter of the sharded ``model`` that no
    unit holds (a module added or a parameter replaced after ``fully_shard``): its gradient
    would never be averaged over the ranks, so each rank would train its own copy.
    ``unsharded``: ids of the units' unsharded parameters (registered while a unit is
    gathered, e.g. between ``unshard()`` and ``reshard()``), which are the units' own."""
    for name, p in model.named_parameters():
        if p.requires_grad and sharded_param(p) is None and id(p) not in unsharded:
            raise ValueError(
                f"matrixfsdp: parameter '{name}' {tuple(p.shape)} is trainable but belongs to no "
                "MatrixFSDP unit (added after fully_shard?): its gradient would not be averaged "
                "over the ranks and each rank would train its own copy. Build the whole model "
                "before fully_shard, or freeze it (requires_grad_(False))")


class OutsideForwardGuard:
    """Forward pre-hook on a module holding parameters of ``unit`` (not the unit's own
    module): refuse a call while those are registered as shards."""

    def __init__(self, unit: Unit, module_name: str, attrs: list[tuple[str, int]]):
        self.unit, self.module_name, self.attrs = unit, module_name, attrs

    def __call__(self, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling():
            return  # inside a compiled block: its unit's hooks ran (eagerly) already
        unit = self.unit
        for attr, i in self.attrs:
            p = module._parameters.get(attr)
            if p is not None and p is unit.sharded[i]:
                info = sharded_param(p)
                raise RuntimeError(
                    f"matrixfsdp: {type(module).__name__} '{self.module_name}' was called "
                    f"outside the forward of its unit '{unit.name}': its parameter "
                    f"'{info.name}' is this rank's shard (shape {tuple(p.shape)} of "
                    f"{tuple(info.placement.spec.shape)}) and would give wrong results. Call it "
                    "from the model's forward, or register the method that calls it with "
                    "matrixfsdp.register_fsdp_forward_method(unit_module, 'method'), or "
                    "gather around the call: unit_module.unshard() ... unit_module.reshard()")


def guard_unit(unit: Unit) -> None:
    """Install :class:`OutsideForwardGuard` on every module holding ``unit``'s parameters
    other than the unit's own module (which gathers in its own forward hook)."""
    by_module: dict[int, tuple[nn.Module, list[tuple[str, int]]]] = {}
    for (mod, attr), i in zip(unit.refs, unit.ref_param):
        if mod is not unit.module:
            by_module.setdefault(id(mod), (mod, []))[1].append((attr, i))
    for mod, attrs in by_module.values():
        name = sharded_param(unit.sharded[attrs[0][1]]).name.rpartition(".")[0]
        unit.guards.append(mod.register_forward_pre_hook(OutsideForwardGuard(unit, name, attrs)))


def unguard_unit(unit: Unit) -> None:
    for h in unit.guards:
        h.remove()
    unit.guards.clear()


# ---- set-up that must be the same on every rank -----------------------------------------
def agree_on_local_checks(problem: Exception | None, mesh: Any) -> None:
    """Raise, on every rank of ``mesh``, the first error (lowest rank) that a rank's own
    set-up checks found (``problem`` on this rank, None if none): the same type and
    message everywhere, naming that rank. Before, the rank that found it raised alone and
    the others went on into the next collective, where they saw "Connection closed by peer".

    When no rank found one: one 16-byte all-reduce per mesh dim (the lowest rank with a
    problem, along one dim, then the next). Otherwise the message travels from that rank
    hop by hop, one broadcast per dim (failure path; the text names the whole mesh)."""
    if not dist.is_initialized() or mesh.size() == 1:
        if problem is not None:
            raise problem
        return
    me = dist.get_rank()
    first = me if problem is not None else None
    for dim in range(mesh.ndim):  # every rank of the mesh: along one dim, then the next
        first = min_max([first], mesh.get_group(dim))[0][0]
    if first is None:
        return
    # along dim d, from the rank at the first rank's coordinate d: after it, every rank
    # whose coordinates past d are the first rank's holds its message (the others, what
    # their source held), so after the last dim every rank does
    at = [int(c) for c in (mesh.mesh == first).nonzero()[0]]
    mine = list(mesh.get_coordinate())
    found = (type(problem).__name__, str(problem)) if me == first else None
    for dim in range(mesh.ndim):
        src = int(mesh.mesh[tuple(mine[:dim] + [at[dim]] + mine[dim + 1:])])
        found = broadcast_object(found if me == src else None, src, mesh.get_group(dim))
    kind, text = found
    error = {"ValueError": ValueError, "NotImplementedError": NotImplementedError,
             "TypeError": TypeError}.get(kind, RuntimeError)
    raise error(f"{text} (found on rank {first} of the mesh {mesh.mesh.tolist()}; every rank of it "
                "raises this)") from problem


def matrix_coverage(units: list[Unit], stepped: set[int]) -> tuple[list[tuple[str, tuple]], bool]:
    """This rank's trainable Muon matrices that it owns and steps (``matrix_params``) which
    no optimizer stepped so far (``stepped``: the ids of the parameters the optimizers that
    stepped held), by name and shape, and whether any it owns was stepped."""
    mine = [(info, p) for u in units for p in u.sharded
            if (info := sharded_param(p)) is not None and info.placement.spec.muon
            and not info.placement.spec.is_experts and p.requires_grad and p.numel() and info.steps_here()]
    return ([(i.name, tuple(i.placement.spec.shape)) for i, p in mine if id(p) not in stepped],
            any(id(p) in stepped for _, p in mine))


def coverage_flags(mine: tuple[list, bool] | None) -> list[int]:
    """This rank's :func:`matrix_coverage` as three flags to reduce with ``MAX`` over the
    ranks: ``[not collected any more, owns matrices of which none was stepped, stepped
    one of its own]``."""
    if mine is None:
        return [1, 0, 0]
    names, stepped = mine
    return [0, int(bool(names) and not stepped), int(stepped)]


def judge_matrix_coverage(seen: list[int], final: bool, mine: tuple[list, bool] | None = None,
                          group: Any = None) -> bool:
    """From :func:`coverage_flags` reduced over the ranks (``seen``, 1 where any rank set
    one; the same on every rank): whether it is decided that each rank steps the matrices
    it owns; with ``final`` (every optimizer of a step has stepped), raise ``RuntimeError``
    if some rank owns matrices of which none was stepped while some rank steps its own:
    each rank steps only the matrices it owns, so a rank without the matrix optimizer
    would leave them at their initial values and differ from one process. A rank that
    steps some of its matrices chose which (as one process would), and no rank stepping
    any is one process's behaviour too: both pass. Before ``final`` (an optimizer's first
    step: another may step after it) only "every rank steps one of its matrices, or owns
    none" decides.

    Only to raise (a collective of ``group``, with this rank's :func:`matrix_coverage`
    ``mine``): one int64 pair per rank says which ranks are idle and which step, and the
    lowest idle rank's names are broadcast."""
    _, idle_any, stepping_any = seen
    if not idle_any:
        return True
    if not final:
        return False
    if not stepping_any:
        return True
    every = every_rank(coverage_flags(mine)[1:], group)
    idle = [r for r, (i, _) in enumerate(every) if i]
    stepping = [r for r, (_, s) in enumerate(every) if s]
    me = dist.get_rank(group) if dist.is_initialized() else 0
    names = broadcast_object(mine[0] if me == idle[0] else None,
                             dist.get_global_rank(group, idle[0]) if group is not None else idle[0], group) \
        if len(every) > 1 else mine[0]
    shown = ", ".join(f"'{n}' {s}" for n, s in names[:_SHOWN]) + (" ..." if len(names) > _SHOWN else "")
    raise RuntimeError(
        f"matrixfsdp: {ranks_text(idle)} own{'s' if len(idle) == 1 else ''} Muon matrices that no "
        f"optimizer stepped ({len(names)} on rank {idle[0]}: {shown}), while {ranks_text(stepping)} "
        "step theirs: each rank steps the whole matrices it owns, so those would never train. "
        "Build the matrix optimizer on every rank: matrixfsdp.matrix_optimizer(cls, model, "
        "**options) (a placeholder on a rank that owns none), or cls(matrixfsdp.matrix_params("
        "model)) wherever that list is not empty; matrices meant not to train: "
        "requires_grad_(False) before fully_shard")


def agree_on_matrix_coverage(mine: tuple[list, bool] | None, group: Any) -> None:
    """:func:`judge_matrix_coverage` with ``final``, every rank's flags reduced first (one
    all-reduce of 24 bytes)."""
    judge_matrix_coverage(any_rank(coverage_flags(mine), group), True, mine, group)


def model_setup(named_params: list[tuple[str, torch.Tensor]], module: nn.Module,
                units: list[tuple[str, Any]], buffer_values: bool = True) -> list[tuple[str, Any]]:
    """What must agree across ranks before a model is sharded: each parameter's shape,
    dtype and ``requires_grad``, each persistent buffer's shape, dtype and (unless
    ``buffer_values`` is False: they are about to be copied from rank 0) values, as a
    digest, and each unit's mixed-precision policy; in the model's order."""
    items: list[tuple[str, Any]] = []
    for name, p in named_params:
        items += [(f"parameter '{name}' shape", tuple(p.shape)),
                  (f"parameter '{name}' dtype", p.dtype),
                  (f"parameter '{name}' requires_grad", p.requires_grad)]
    for prefix, mod in module.named_modules():
        for attr, b in mod._buffers.items():
            if b is None or attr in mod._non_persistent_buffers_set:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            items += [(f"buffer '{name}' shape", tuple(b.shape)), (f"buffer '{name}' dtype", b.dtype)]
            if buffer_values and not b.is_meta:  # a few values as they are, more as a digest
                items.append((f"buffer '{name}' values", tuple(b.flatten().tolist())) if b.numel() <= 8
                             else (f"buffer '{name}' values (digest)", tuple(_digest(b).tolist())))
    for name, policy in units:
        items.append((f"unit '{name}' mixed precision policy", repr(policy)))
    return items


def sync_buffers(module: nn.Module, group: Any) -> None:
    """Copy rank 0's persistent buffers into every rank's (``sync_module_states=True``, as
    DDP's ``broadcast_buffers``): one broadcast per buffer."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for mod in module.modules():
            for attr, b in mod._buffers.items():
                if b is not None and attr not in mod._non_persistent_buffers_set and not b.is_meta:
                    dist.broadcast(b, src=src, group=group)


