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
* :func:`check_saved_names`: a model-only load compares the saved names with the model's,
  both ways.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .param import root_of, sharded_param

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


def _name_of(p: torch.Tensor, hint: torch.Tensor | None) -> str:
    root = root_of(hint) if hint is not None else None
    if root is not None:
        for name, q in root.module.named_parameters():
            if q is p:
                return f"'{name}' {tuple(p.shape)}"
    return f"of shape {tuple(p.shape)}"


def check_optimizer_params(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``ValueError`` if ``optimizer`` steps MatrixFSDP shards and also a trainable
    parameter outside every unit (its gradient is this rank's alone). Optimizers over no
    shard at all are not MatrixFSDP's business and pass."""
    shard, outside = None, None
    for group in optimizer.param_groups:
        for p in group["params"]:
            if sharded_param(p) is not None:
                shard = shard if shard is not None else p
            elif p.requires_grad and outside is None:
                outside = p
    if shard is not None and outside is not None:
        raise ValueError(
            f"matrixfsdp: {type(optimizer).__name__} holds parameter {_name_of(outside, shard)}, "
            "which belongs to no MatrixFSDP unit (added after fully_shard?): its gradient is "
            "not averaged over the ranks, so each rank would train its own copy. Build the "
            "whole model before fully_shard")


def check_saved_names(model_names: Iterable[str], saved: Iterable[str], where: str = "") -> None:
    """Raise ``ValueError`` when the names a checkpoint holds differ from the model's, in
    either direction (a model of another depth or width, or another model)."""
    model_names, saved = set(model_names), set(saved)
    missing = sorted(model_names - saved)
    unexpected = sorted(saved - model_names)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"the model has {len(missing)} names the checkpoint lacks ({missing[:_SHOWN]}"
                     + (", ..." if len(missing) > _SHOWN else "") + ")")
    if unexpected:
        parts.append(f"the checkpoint has {len(unexpected)} names the model lacks "
                     f"({unexpected[:_SHOWN]}" + (", ..." if len(unexpected) > _SHOWN else "") + ")")
    raise ValueError(f"matrixfsdp: checkpoint {where} does not fit the model: " + "; ".join(parts)
                     + ". It was saved from another model (another depth, width or naming)")
