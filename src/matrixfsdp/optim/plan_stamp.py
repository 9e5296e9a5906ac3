"""The checks behind ``matrixfsdp.Muon.state_dict`` / ``load_state_dict``.

A state dict of this rank's own tensors (what ``state_dict()`` held before it held
``RowShard`` s on a sharded model, and what a per-rank file of then holds) loads back only
where every rank holds the same tensors: the same world size and plan. ``state_dict()``
records both in each param group (``mf_world_size``, ``mf_plan``: a digest of the names,
shapes and placements of the group's parameters), and ``load_state_dict`` checks them, and
every tensor's shape, before
touching anything: a state saved at another world size or plan is refused on every rank,
including one whose own state happens to fit.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..runtime.param import placement_of, root_of

# Recorded in each param group of ``state_dict()``, checked and dropped by ``load_state_dict``.
# A loader that reshards (``matrixfsdp.set_state_dict``) drops them from what it hands over.
PLAN_KEYS = ("mf_world_size", "mf_plan")
RESHARD_HINT = ("optimizer state saved at another world size or plan; save with "
                "matrixfsdp.get_state_dict / torch.distributed.checkpoint and load with "
                "matrixfsdp.set_state_dict (which reshards)")


def param_name(p: torch.Tensor) -> str:
    """A parameter's name for messages (its shape where it has no placement)."""
    pl = placement_of(p)
    return f"'{pl.spec.name}'" if pl is not None else f"of shape {tuple(p.shape)}"


def world_size(params: Iterable[torch.Tensor]) -> int | None:
    """The world size the parameters are planned for (None: plain tensors, no plan)."""
    for p in params:
        root = root_of(p)
        if root is not None:  # HSDP: replicas x shard size
            return root.groups.replicas * root.groups.shard_size
    return None


def rank_of(params: Iterable[torch.Tensor]) -> int:
    """This rank as the plan numbers it (under HSDP its world rank, not its shard rank)."""
    for p in params:
        root = root_of(p)
        if root is not None:
            return root.groups.world_rank
    return dist.get_rank() if dist.is_initialized() else 0


def plan_digest(params: Iterable[torch.Tensor]) -> str:
    """A short digest of where each parameter lives on every rank (name, shape, Muon or
    not, each rank's rows, and the world rank that steps a matrix, which under HSDP also
    names the replica): equal digests mean every rank holds and steps the same tensors."""
    h = hashlib.sha256()
    rows: dict[int, bytes] = {}  # a plan shares one row-range list among parameters alike
    for p in params:
        pl = placement_of(p)
        key = (pl.spec.name, pl.spec.shape, pl.spec.muon, pl.owner) if pl is not None \
            else tuple(p.shape)
        h.update(repr(key).encode())
        if pl is None:
            continue
        if pl.owner is not None:  # a matrix: whole on its owner, its rows follow from it
            h.update(repr(len(pl.row_ranges)).encode())
            continue
        k = id(pl.row_ranges)  # each distinct list read once: O(P) per list, not per parameter
        if k not in rows:
            rows[k] = hashlib.sha256(array("q", [i for r in pl.row_ranges for i in r])).digest()
        h.update(rows[k])
    return h.hexdigest()[:16]


def _no_state(p: torch.Tensor) -> str:
    pl = placement_of(p)
    if pl is not None and pl.owner is not None:
        return (f"no state (this rank holds the empty placeholder {tuple(p.shape)}; the matrix "
                f"is owned by rank {pl.owner})")
    return f"no state (this rank holds none of it: {tuple(p.shape)})"


def check_loadable(optimizer: torch.optim.Optimizer, state_dict: dict,
                   state_keys: dict[bool, tuple[str, ...]]) -> None:
    """Raise ``ValueError`` (naming the parameter, this rank and the shapes) unless
    ``state_dict`` fits ``optimizer`` (a ``matrixfsdp.Muon``) on this rank: the same groups
    (sizes, ``use_muon``), the same world size and plan where recorded, and every tensor of
    ``state_keys`` of this rank's shape. Reads the state dict only, so every rank decides
    alike where the world size or plan differs."""
    saved_groups, state = state_dict["param_groups"], state_dict["state"]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    where = f"matrixfsdp.Muon.load_state_dict on rank {rank_of(params)}"
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"{where}: the state has {len(saved_groups)} parameter groups, this "
                         f"optimizer {len(optimizer.param_groups)}. If this is {RESHARD_HINT}")
    for i, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"{where}: parameter group {i} has {len(saved['params'])} parameters "
                             f"in the state, {len(group['params'])} here. If this is {RESHARD_HINT}")
        if bool(saved.get("use_muon", group["use_muon"])) != bool(group["use_muon"]):
            raise ValueError(f"{where}: parameter group {i} has use_muon={saved['use_muon']} in "
                             f"the state, use_muon={group['use_muon']} here")
    world = world_size(params)
    plan = None  # (saved world size, saved digest, this world size, this digest)
    for saved, group in zip(saved_groups, optimizer.param_groups):
        if world is not None and "mf_world_size" in saved:
            digest = plan_digest(group["params"])
            if (saved["mf_world_size"], saved.get("mf_plan")) != (world, digest):
                plan = (saved["mf_world_size"], saved.get("mf_plan"), world, digest)
                break
    bad = []  # (parameter, state key, saved shape, what this rank needs)
    for saved, group in zip(saved_groups, optimizer.param_groups):
        muon = bool(group["use_muon"])
        for pid, p in zip(saved["params"], group["params"]):
            for key in state_keys[muon]:
                t = (state.get(pid) or {}).get(key)
                if not isinstance(t, torch.Tensor) or key == "step":
                    continue
                if muon and not p.numel():
                    bad.append((p, key, tuple(t.shape), _no_state(p)))
                elif t.shape != p.shape:
                    bad.append((p, key, tuple(t.shape), str(tuple(p.shape))))
    if not bad and plan is None:
        return
    msg = [where + ":"]
    if bad:
        p, key, got, need = bad[0]
        more = f" ({len(bad) - 1} more tensors do not fit either)" if len(bad) > 1 else ""
        msg.append(f"parameter {param_name(p)}: saved {key} has shape {got}, this rank's placement "
                   f"needs {need}{more}.")
    if plan is not None:
        msg.append(f"The state was saved at world size {plan[0]} (plan {plan[1]}), this optimizer "
                   f"runs at world size {plan[2]} (plan {plan[3]}).")
        if not bad:
            msg.append("This rank's own tensors happen to fit, but not the state as a whole: "
                       "momentum would be missing or on other matrices, so every rank refuses.")
        msg.append(f"This is {RESHARD_HINT}.")
    else:
        msg.append(f"This looks like {RESHARD_HINT}.")
    raise ValueError(" ".join(msg))
