"""Gradient clipping by the global norm, and the names of non-finite gradients.

On a MatrixFSDP model each rank holds disjoint pieces of the global gradient: whole Muon
matrices on their owner (an empty placeholder, its ``.grad`` empty, elsewhere) and a row slice
of every other parameter. ``torch.nn.utils.clip_grad_norm_`` sees only this rank's pieces,
so it returns a different norm on every rank and the ranks clip by different factors.
Here every element is counted once: a local ``sum |g|^p`` (``max |g|`` for inf) over this
rank's pieces, one all-reduce over the root's process group, then the root. Parameters that
are not MatrixFSDP shards are taken to be replicated (identical on every rank) and are
added once, after the all-reduce.

Tensor parallelism: a second all-reduce over the tp group; pieces that every tp rank holds
alike (plain and ``Replicate`` parameters) count ``1/tp`` on each.

HSDP: the all-reduce spans the whole mesh. A 2-D Muon matrix counts on its owner world
rank only (the copy another replica steps holds zeros); the other pieces (row shards,
experts) are averaged over the replicas and identical on each, so only replica 0 counts
them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._compat import all_gather_single, foreach_mul_, foreach_norm
from ..diagnosis import arrival
from ..runtime.param import placement_of, root_of, sharded_param

__all__ = ["clip_grad_norm_", "nonfinite_grad_names", "nonfinite_grad_ranks"]

_Params = torch.Tensor | Iterable[torch.Tensor]


def _split(parameters: _Params, pp_mesh: DeviceMesh | None):
    """(all params, sharded params by root, plain params). Sharded ones share a root,
    unless ``pp_mesh`` is given (one root per pipeline stage on this rank)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    by_root: dict = {}
    plain, first = [], {}
    for p in params:
        pl = placement_of(p)
        if pl is None:
            plain.append(p)
            continue
        r = root_of(p)
        if r not in by_root:
            if by_root and pp_mesh is None:
                raise ValueError(
                    f"parameters '{next(iter(first.values()))}' and '{pl.spec.name}' belong to "
                    "different matrixfsdp roots; clip each model's parameters in its own call, "
                    "or, for the stages of one pipeline, all of them in one call with pp_mesh")
            by_root[r], first[r] = [], pl.spec.name
        by_root[r].append(p)
    return params, by_root, plain


def _local_stat(grads: list[torch.Tensor], p: float, acc: torch.dtype, device: torch.device,
                foreach: bool | None) -> torch.Tensor:
    """``sum |g|^p`` over ``grads`` (``max |g|`` for p = inf) as a 0-d ``acc`` tensor on ``device``.

    Per-tensor norms first (in ``acc``, whatever the grad dtype), as torch does."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():  # an empty piece adds nothing (and has no inf norm)
            # this rank's piece as a plain tensor: a ShardedGrad refuses local norms
            groups.setdefault((g.device, g.dtype), []).append(g.as_subclass(torch.Tensor))
    norms: list[torch.Tensor] = []
    for (dev, _), gs in groups.items():
        if foreach or (foreach is None and dev.type in ("cpu", "cuda")):
            norms += [n.to(device) for n in foreach_norm(gs, p, dtype=acc)]
        else:
            norms += [torch.linalg.vector_norm(g, p, dtype=acc).to(device) for g in gs]
    if not norms:
        return torch.zeros((), dtype=acc, device=device)
    stacked = torch.stack(norms)
    return stacked.max() if math.isinf(p) else stacked.pow(p).sum()


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup) -> None:
    """The norm's all-reduce; a timeout names the rank that did not arrive (diagnosis/arrival.py)."""
    work = dist.all_reduce(t, op=op, group=group, async_op=True)
    arrival.wait(work, arrival.issued(group, "gradient norm all_reduce"))


def _root_stat(sharded, root, p: float, acc: torch.dtype, foreach: bool | None) -> torch.Tensor:
    """``sum |g|^p`` (p = inf: ``[max |g|, any NaN]``) over one root's pieces, all-reduced
    over its ranks: the same on every rank of the root."""
    device = sharded[0].device
    counted = [q for q in sharded if q.grad is not None and (info := sharded_param(q)).steps_here()
               and (info.unit.domain.groups.replica == 0 or info.placement.owner is not None)]
    # TP: a piece every tp rank holds alike (a plain or Replicate parameter) counts 1/tp
    # times on each, so that the sum over the tp group counts it once
    same = [sharded_param(q).tp_replicated for q in counted]
    local = _local_stat([q.grad for q, s in zip(counted, same) if not s], p, acc, device, foreach)
    copies = _local_stat([q.grad for q, s in zip(counted, same) if s], p, acc, device, foreach)
    groups = [root.groups.world] + ([root.tp.gather.group] if root.tp is not None else [])
    if math.isinf(p):
        local = torch.maximum(local, copies)
        # A MAX all-reduce need not propagate NaN (max(nan, x) may give x), so NaN travels
        # as a separate flag in the same call.
        nan = local.isnan()
        local = torch.stack([torch.where(nan, torch.zeros_like(local), local), nan.to(acc)])
    else:
        local = local + copies / (root.tp.size if root.tp is not None else 1)
    for group in groups:
        _all_reduce(local, dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM, group)
    return local


def _total_norm(params, by_root, plain, p: float, foreach: bool | None,
                pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    # Decided from the parameters, which every rank holds alike (placeholders included),
    # never from the grads, which only some ranks have: the all-reduce must match.
    acc = torch.float64 if any(q.dtype == torch.float64 for q in params) else torch.float32
    plain_grads = [q.grad for q in plain if q.grad is not None]
    if not by_root and pp_mesh is None:  # nothing sharded: torch's own result, same reduction
        device = plain_grads[0].device if plain_grads else torch.device("cpu")
        stat = _local_stat(plain_grads, p, acc, device, foreach)
        return stat if math.isinf(p) else stat.pow(1.0 / p)
    device = next(iter(by_root.values()))[0].device if by_root else torch.device(
        pp_mesh.device_type if pp_mesh.device_type == "cpu" else torch.get_device_module(
            pp_mesh.device_type).current_device())
    stats = [_root_stat(sharded, root, p, acc, foreach) for root, sharded in by_root.items()]
    mine = _local_stat(plain_grads, p, acc, device, foreach)  # replicated: counted once
    if math.isinf(p):
        buf = torch.stack([mine.nan_to_num(0.0), mine.isnan().to(acc)])
        for st in stats:
            buf = torch.maximum(buf, st)
        if pp_mesh is not None:  # the stages hold disjoint parameters
            _all_reduce(buf, dist.ReduceOp.MAX, pp_mesh.get_group())
        return torch.where(buf[1] > 0, torch.full_like(buf[0], math.nan), buf[0])
    total = sum(stats, mine)
    if pp_mesh is not None:
        _all_reduce(total, dist.ReduceOp.SUM, pp_mesh.get_group())
    return total.pow(1.0 / p)


def _bad(grad: torch.Tensor | None) -> torch.Tensor:
    """1 if ``grad`` (this rank's piece) holds a NaN or inf, else 0 (an int32 0-d tensor)."""
    if grad is None or not grad.numel():
        return torch.zeros((), dtype=torch.int32)
    return (~torch.isfinite(grad.as_subclass(torch.Tensor)).all()).to(torch.int32)


def _nonfinite(params, by_root, plain) -> dict[str, list[int]]:
    """{name: the world ranks whose piece of its gradient is not finite}, the same on every
    rank of a root: per root, one MAX all-reduce of one int32 flag per planned parameter
    (and, with the first root, per non-sharded one), then an all-gather of every rank's
    flags for the bad parameters alone (a failure path: P x the bad ones, which it names)."""
    others = [(i, q) for i, q in enumerate(params) if placement_of(q) is None]
    other_names = [f"<parameter {i} of shape {tuple(q.shape)} (not sharded)>" for i, q in others]
    if not by_root:  # nothing sharded: this rank's verdict, no collective
        me = dist.get_rank() if dist.is_initialized() else 0
        return {n: [me] for n, (_, q) in zip(other_names, others) if _bad(q.grad)}
    out: dict[str, list[int]] = {}
    for k, (root, sharded) in enumerate(by_root.items()):
        order = list(root.plan.placements)  # the plan's: the same everywhere
        index = {name: i for i, name in enumerate(order)}
        names = order + (other_names if k == 0 else [])
        flags = torch.zeros(len(names), dtype=torch.int32, device=sharded[0].device)
        for q in sharded:
            flags[index[placement_of(q).spec.name]] = _bad(q.grad)
        for j, (_, q) in enumerate(others if k == 0 else []):
            flags[len(order) + j] = _bad(q.grad)
        group = root.groups.world
        anywhere = flags.clone()  # which parameters are bad on some rank: one MAX all-reduce
        work = dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=group, async_op=True)
        arrival.wait(work, arrival.issued(group, "non-finite gradients all_reduce"))
        bad = anywhere.nonzero().flatten()
        if not bad.numel():
            continue
        # then, for those alone, every rank's flag (P x the bad ones, not P x all of them)
        ranks = dist.get_process_group_ranks(group)
        everyone = torch.empty(len(ranks) * bad.numel(), dtype=torch.int32, device=flags.device)
        work = all_gather_single(everyone, flags[bad].contiguous(), group=group, async_op=True)
        arrival.wait(work, arrival.issued(group, "non-finite gradients all_gather"))
        rows = everyone.view(len(ranks), bad.numel()).cpu()
        out.update({names[i]: [ranks[r] for r in rows[:, j].nonzero().flatten().tolist()]
                    for j, i in enumerate(bad.tolist())})
    return out


@torch.no_grad()
def clip_grad_norm_(parameters: _Params, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None, *,
                    pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the global gradient of a MatrixFSDP model.

    A collective: every rank of the model's process group must call it, with the same
    parameters (``model.parameters()``: placeholders included). Each element of the
    global gradient counts once: a Muon matrix on its owner, each row slice on the rank
    holding it. Parameters that are not MatrixFSDP shards are taken to be replicated
    (identical grads on every rank) and count once. Parameters without ``.grad`` are
    skipped. Costs one all-reduce of one scalar (two for ``norm_type=inf``).

    Args:
        parameters: tensors whose ``.grad`` is clipped in place.
        max_norm: grads are scaled by ``min(1, max_norm / (total_norm + 1e-6))``.
        norm_type: p > 0 of the p-norm, or ``inf``.
        error_if_nonfinite: raise ``RuntimeError`` (on every rank together) if the total
            norm is NaN or inf, naming the parameters whose gradients are not finite.
        foreach: as in torch; None picks the foreach kernels on CPU and CUDA.
        pp_mesh: pipeline parallelism (torchtitan's argument of that name): the mesh of the
            pipeline dim. ``parameters`` are those of every stage on this rank (one root
            each); the stages' sums are added over ``pp_mesh`` (one more all-reduce), so
            every rank of every stage clips by the norm of the whole model.
    Returns:
        The total norm, a 0-d tensor on the shards' device, identical on every rank.
        Accumulated and returned in float32 (float64 if a parameter is float64), also
        for bf16 grads, where torch returns a bf16 norm.
    """
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    params, by_root, plain = _split(parameters, pp_mesh)
    total = _total_norm(params, by_root, plain, p, foreach, pp_mesh)
    if error_if_nonfinite and not bool(torch.isfinite(total)):  # same verdict on every rank
        names = list(_nonfinite(params, by_root, plain))
        where = (f"non-finite gradients: {', '.join(names)}" if names else
                 "every gradient is finite: the norm overflowed")
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so "
            "it cannot be clipped. To disable this error and scale the gradients by the "
            f"non-finite norm anyway, set `error_if_nonfinite=False` ({where})")
    _scale(params, max_norm, total, foreach)
    return total


def _scale(params: list[torch.Tensor], max_norm: float, total: torch.Tensor,
           foreach: bool | None) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``'s scaling, the same arithmetic, on plain
    views of the gradients: torch picks its foreach kernels only for tensors of exactly
    ``torch.Tensor`` (``_has_foreach_support``), and the shards' gradients are this
    library's subclass, which made it one ``mul_`` per gradient (a launch each on a GPU)."""
    grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for q in params:
        if q.grad is not None and q.grad.numel():
            g = q.grad.as_subclass(torch.Tensor)  # the same storage: scaled in place
            grads.setdefault((g.device, g.dtype), []).append(g)
    if not grads:
        return
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (device, _), gs in grads.items():
        if foreach or (foreach is None and device.type in ("cpu", "cuda")):
            foreach_mul_(gs, coef.to(device))
        else:
            for g in gs:
                g.mul_(coef.to(device))


@torch.no_grad()
def total_grad_norm(parameters: _Params, norm_type: float = 2.0,
                    foreach: bool | None = None, *, pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """The global gradient norm alone (``clip_grad_norm_`` without the scaling): the same
    0-d tensor on every rank. A collective. With torch's
    ``torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)`` on the local grads it
    makes the split form of clipping, which lets a non-finite norm skip the step before any
    gradient is scaled by it::

        norm = mf.total_grad_norm(model.parameters())
        if not torch.isfinite(norm):           # the norm is global: all ranks agree
            log.warning("skipping step: %s", mf.nonfinite_grad_names(model.parameters()))
            opt.zero_grad()
            continue
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm)
    """
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    params, by_root, plain = _split(parameters, pp_mesh)
    return _total_norm(params, by_root, plain, p, foreach, pp_mesh)


@torch.no_grad()
def nonfinite_grad_names(parameters: _Params) -> list[str]:
    """Names of the parameters whose gradient holds a NaN or inf on any rank.

    A collective (one all-reduce of one int32 flag per planned parameter), returning the
    same list on every rank: sharded parameters by name, in plan order, then any
    non-sharded ones by position in ``parameters``. Call it before any clipping scales
    the gradients by a non-finite norm (see :func:`total_grad_norm`)."""
    return list(_nonfinite(*_split(parameters, None)))


@torch.no_grad()
def nonfinite_grad_ranks(parameters: _Params) -> dict[str, list[int]]:
    """:func:`nonfinite_grad_names` with, for each name, the world ranks whose piece of that
    gradient holds a NaN or inf (a rank holding no piece of it is never named). The same
    on every rank; a collective (one all-reduce of an int32 flag per planned parameter, then
    every rank's flags for the bad ones alone).
    Without sharded parameters, this rank's verdict alone, no collective."""
    return _nonfinite(*_split(parameters, None))
