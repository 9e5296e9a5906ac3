"""Set-up checks: silent divergence caught before the first step.

* :func:`check_same_init`: ranks whose models were initialised differently (another seed)
  would each shard their own values, and training would mix them silently. One small
  all-gather of two int64 digests per parameter finds the first parameter that differs;
  ``sync=True`` broadcasts rank 0's values instead. Runs on the full (unsharded) tensors,
  so at ``fully_shard`` time, before the shards are cut. Meta tensors (a model built on the
  meta device and initialised by ``matrixfsdp.init_weights``) are skipped.
* :func:`check_unsharded_trainable` / :func:`check_optimizer_params`: a trainable parameter
  outside every unit (a module added after ``fully_shard``) gets no gradient reduce, so each
  rank would train its own copy.
* :func:`check_same_setup` / :func:`check_same_optimizer`: the model's shapes, dtypes,
  buffers and mixed-precision policies, and an optimizer's settings, alike on every rank
  (compared once at set-up; a checkpoint's names are checked by ``state/entries.py``).
* :func:`judge_matrix_coverage`: a rank that owns Muon matrices but steps none of them
  (it built no matrix optimizer on ``matrix_params``) while other ranks step theirs: its
  matrices would silently never train. Settled by the first-step comparison of an
  optimizer's settings where every rank steps one of its own; else judged at the next
  forward, once every optimizer of the first step has stepped.
* :func:`agree_on_local_checks`: what one rank's own checks found (a unit of mixed dtypes
  on that rank only) raised on every rank of the mesh, naming the rank, before the first
  collective that rank would miss.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .arrival import ranks_text
from .collectives import all_gather_object
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


def check_same_init(named_params: Iterable[tuple[str, torch.Tensor]], group: Any = None, *,
                    sync: bool = False) -> int:
    """Raise ``ValueError`` on every rank of ``group`` (default: the world) naming the first
    parameter whose initial values differ between ranks; with ``sync=True`` copy rank 0's
    values into every rank's tensors instead (a broadcast per parameter). Meta tensors are
    skipped. A collective (two tiny all-gathers: the count, then ``2 x P`` int64 digests).
    Returns the number of parameters compared (or synced).

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
    device = named[0][1].device
    world = dist.get_world_size(group)
    count = torch.tensor([len(named)], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    if len({int(c) for c in counts}) > 1:
        raise ValueError("matrixfsdp: ranks hold different numbers of parameters at set-up ("
                         + ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(counts))
                         + "); every rank must build the same model")
    mine = torch.stack([_digest(p) for _, p in named])
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    for i, (name, _) in enumerate(named):
        differ = [r for r in range(1, world) if not torch.equal(rows[r][i], rows[0][i])]
        if differ:
            raise ValueError(
                f"matrixfsdp: parameter '{name}' differs between ranks at set-up (ranks "
                f"{differ} hold other initial values than rank 0): seed every rank alike before "
                "building the model (torch.manual_seed), load the same weights everywhere, or "
                "ask for rank 0's values to be copied to every rank (sync=True)")
    return len(named)


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
def _shown(value: Any) -> str:
    return str(value).replace("torch.", "")


OPTIONAL = "matrix optimizer "  # items a rank may lack (a rank that owns no matrix)


def agree_on_local_checks(problem: Exception | None, mesh: Any) -> None:
    """Raise, on every rank of ``mesh``, the first error (lowest rank) that a rank's own
    set-up checks found (``problem`` on this rank, None if none): the same type and
    message everywhere, naming that rank. One all-gather per mesh dim, at set-up only.
    Before, the rank that found it raised alone and the others went on into the next
    collective, where they saw "Connection closed by peer"."""
    if not dist.is_initialized() or mesh.size() == 1:
        if problem is not None:
            raise problem
        return
    found = {dist.get_rank(): (type(problem).__name__, str(problem))} if problem is not None else {}
    for dim in range(mesh.ndim):  # every rank of the mesh: along one dim, then the next
        merged: dict[int, tuple[str, str]] = {}
        for seen in all_gather_object(found, mesh.get_group(dim)):
            merged.update(seen)
        found = merged
    if not found:
        return
    rank = min(found)
    kind, text = found[rank]
    error = {"ValueError": ValueError, "NotImplementedError": NotImplementedError,
             "TypeError": TypeError}.get(kind, RuntimeError)
    raise error(f"{text} (found on rank {rank} of the mesh {mesh.mesh.tolist()}; every rank of it "
                "raises this)") from problem


def check_same_setup(items: list[tuple[str, Any]], group: Any, what: str, extra: Any = None) -> list:
    """Raise ``ValueError`` on every rank of ``group`` naming the first of ``items``
    (``(description, value)``, in the same order on every rank) whose value differs
    between ranks, with each rank's value; ``what`` says what was set up ("the model",
    "the Muon optimizer"). Items whose description starts with "matrix optimizer " are
    compared among the ranks that have them (an optimizer over ``matrix_params``, which a
    rank owning no matrix may not have). One gather of the list: call it once, at
    set-up, never in a step. Values must compare with ``==`` (no tensors). ``extra`` travels
    in the same gather, uncompared: every rank's is returned, in rank order."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [extra]
    gathered = all_gather_object((items, extra), group)
    every = [ranks_items for ranks_items, _ in gathered]
    keys = [dict(ranks_items) for ranks_items in every]
    mine = dict(items)
    for key in dict.fromkeys(k for ranks_items in every for k, _ in ranks_items):
        values = [k.get(key, "(missing)") for k in keys]
        have = [v for v in values if not (key.startswith(OPTIONAL) and v == "(missing)")]
        if any(v != have[0] for v in have):
            by_value: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(_shown(v), []).append(r)
            seen = "; ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} "
                             f"{', '.join(map(str, rs))}" for v, rs in by_value.items())
            raise ValueError(f"matrixfsdp: ranks set up {what} differently: {key}: {seen}. Every "
                             "rank must build the same model and optimizer"
                             + ("" if key in mine else " (this rank lacks it)"))
    return [e for _, e in gathered]


def matrix_coverage(units: list[Unit], stepped: set[int]) -> tuple[list[tuple[str, tuple]], bool]:
    """This rank's trainable Muon matrices that it owns and steps (``matrix_params``) which
    no optimizer stepped so far (``stepped``: the ids of the parameters the optimizers that
    stepped held), by name and shape, and whether any it owns was stepped."""
    mine = [(info, p) for u in units for p in u.sharded
            if (info := sharded_param(p)) is not None and info.placement.spec.muon
            and not info.placement.spec.is_experts and p.requires_grad and p.numel() and info.steps_here()]
    return ([(i.name, tuple(i.placement.spec.shape)) for i, p in mine if id(p) not in stepped],
            any(id(p) in stepped for _, p in mine))


def judge_matrix_coverage(every: list[tuple[list, bool]], final: bool) -> bool:
    """From every rank's :func:`matrix_coverage` (the same list on every rank): whether it
    is decided that each rank steps the matrices it owns; with ``final`` (every optimizer of
    a step has stepped), raise ``RuntimeError`` if some rank owns matrices of which none was
    stepped while some rank steps its own: each rank steps only the matrices it owns, so a
    rank without the matrix optimizer would leave them at their initial values and differ
    from one process. A rank that steps some of its matrices chose which (as one process
    would), and no rank stepping any is one process's behaviour too: both pass. Before
    ``final`` (an optimizer's first step: another may step after it) only "every rank
    steps one of its matrices, or owns none" decides."""
    idle = [r for r, (names, stepped) in enumerate(every) if names and not stepped]
    stepping = [r for r, (_, s) in enumerate(every) if s]
    if not idle:
        return True
    if not final:
        return False
    if not stepping:
        return True
    names = every[idle[0]][0]
    shown = ", ".join(f"'{n}' {s}" for n, s in names[:_SHOWN]) + (" ..." if len(names) > _SHOWN else "")
    raise RuntimeError(
        f"matrixfsdp: {ranks_text(idle)} own{'s' if len(idle) == 1 else ''} Muon matrices that no "
        f"optimizer stepped ({len(names)} on rank {idle[0]}: {shown}), while {ranks_text(stepping)} "
        "step theirs: each rank steps the whole matrices it owns, so those would never train. "
        "Build the matrix optimizer on every rank: matrixfsdp.matrix_optimizer(cls, model, "
        "**options) (a placeholder on a rank that owns none), or cls(matrixfsdp.matrix_params("
        "model)) wherever that list is not empty; matrices meant not to train: "
        "requires_grad_(False) before fully_shard")


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


