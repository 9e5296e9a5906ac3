"""The planner: owner assignment over all units at once, and the walk over a model that
collects what it plans (:mod:`~matrixfsdp.layout.types` says what a plan holds).

Pure Python over shapes: a model built on the meta device plans in seconds for any world
size.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from torch import nn

from .assign import (
    TPRates,
    assign,
    assign_replicated,
    ns_flops,
    ns_flops_split,
    tp_group_owned,
)
from .types import MuonFilter, ParamSpec, Placement, Plan


@functools.lru_cache(maxsize=4096)
def _even_ranges(rows: int, world_size: int) -> list[tuple[int, int]]:
    """FSDP2's ``Shard(0)`` chunks: rank r holds rows ``[r c, (r+1) c)`` of dim 0, clipped to
    ``rows``, with ``c = ceil(rows / world_size)``. Every rank's piece fits one chunk, so the
    gather is one even all-gather of chunk-padded pieces (docs/design.md). Cached: parameters
    of one shape share one list (``row_ranges`` are never mutated), for 16k-rank plans."""
    chunk = -(-rows // world_size)
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(world_size)]


# torch's convolutions (a 3-D weight that is no stack of matrices)
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                 nn.ConvTranspose3d)

def _checked_specs(specs: Sequence[ParamSpec]) -> list[ParamSpec]:
    """Refuse a Muon parameter that is neither a matrix nor an expert stack; an empty matrix
    has nothing for Muon to do, so it is planned as an (empty) even parameter."""
    for s in specs:
        if s.muon and len(s.shape) not in (2, 3):
            raise ValueError(f"parameter '{s.name}' is marked as a Muon matrix but has "
                             f"shape {tuple(s.shape)}; Muon needs 2-D matrices or 3-D "
                             "(experts, m, n) stacks of expert matrices")
    return [replace(s, muon=False) if s.muon and s.numel == 0 else s for s in specs]


def _place_even(specs: Sequence[ParamSpec], S: int) -> tuple[dict[str, Placement], list[int]]:
    """Row chunks of every even parameter over ``S`` shard ranks, and the bytes each shard
    rank holds of them: a whole (padded) chunk of every one, the same on every rank."""
    placements: dict[str, Placement] = {}
    per_rank = 0
    for s in specs:
        if s.muon:
            continue
        placements[s.name] = Placement(s, None, _even_ranges(s.rows, S))
        per_rank += -(-s.rows // S) * s.row_numel * s.itemsize
    return placements, [per_rank] * S


def _assign_items(muon: list[ParamSpec], item_spec: list[int], costs: list[int],
                  sizes: list[int], S: int, world_size: int, base_bytes: list[int]) -> list[int]:
    """The rank of every Muon item. 1-D: one assignment over all matrices and experts, as
    they run once. HSDP: experts over the shard ranks first (they run on every replica),
    then 2-D matrices over the world ranks, on top of their shard rank's expert load: each
    unit's matrices over distinct shard ranks where they fit (the replicate dim carries
    every matrix a shard rank holds), then over that shard rank's replicas
    (:func:`~matrixfsdp.layout.assign.assign_replicated`)."""
    if S == world_size:
        return assign(costs, sizes, S, base_bytes)
    owners = [0] * len(item_spec)
    experts = [k for k, i in enumerate(item_spec) if muon[i].is_experts]
    shard_load, shard_bytes = [0] * S, list(base_bytes)
    for k, r in zip(experts, assign([costs[k] for k in experts],
                                    [sizes[k] for k in experts], S, base_bytes)):
        owners[k] = r
        shard_load[r] += costs[k]
        shard_bytes[r] += sizes[k]
    mats = [k for k, i in enumerate(item_spec) if not muon[i].is_experts]
    world_owners = assign_replicated([costs[k] for k in mats], [sizes[k] for k in mats],
                                     [muon[item_spec[k]].unit for k in mats], S,
                                     world_size // S, shard_bytes, shard_load)
    for k, w in zip(mats, world_owners):
        owners[k] = w
    return owners


def _place_muon(muon: list[ParamSpec], counts: list[dict[int, int]], S: int
                ) -> dict[str, Placement]:
    """Placements of the Muon parameters from how many matrices each rank got of each: a
    2-D matrix whole on its owner's shard rank, a stack's experts as contiguous ranges."""
    placements = {}
    for s, per_rank in zip(muon, counts):
        if s.is_experts:
            stops = list(itertools.accumulate(per_rank.get(r, 0) for r in range(S)))
            placements[s.name] = Placement(s, None, list(zip([0, *stops[:-1]], stops)))
        else:
            (w,) = per_rank
            ranges = [(0, 0)] * S
            ranges[w % S] = (0, s.rows)
            placements[s.name] = Placement(s, w, ranges)
    return placements


def _place_tp_owners(split: list[Placement], ns_steps: int) -> None:
    """Tensor parallelism: among the tp ranks of each tp-split matrix's owner, the one that
    holds it whole (and runs its NS). Largest NS cost first, each to a tp rank where its
    unit's matrices at its shard rank stay within ``max(the unit's largest, its total /
    (shard ranks x tp))`` (what the tp hop carries there), among those that keep that GPU's
    NS within the largest matrix's or the least loaded's; then the GPU with the least NS,
    the (shard rank, tp rank) storing the fewest bytes over all units (what it holds and
    moves across replicas), the tp rank with the least NS over all owners (an owner with one
    matrix leaves the choice to it), the lowest. Deterministic, so every rank agrees."""
    total: dict[int, int] = defaultdict(int)
    largest: dict[int, int] = defaultdict(int)
    for pl in split:
        total[pl.spec.unit] += pl.spec.numel
        largest[pl.spec.unit] = max(largest[pl.spec.unit], pl.spec.numel)
    costs = [ns_flops(pl.spec.matrix_shape, ns_steps) for pl in split]
    limit = max(costs, default=0)
    gpu: dict[tuple[int | None, int], int] = defaultdict(int)  # (world owner, tp rank): NS
    stored: dict[tuple[int | None, int], int] = defaultdict(int)  # (shard rank, tp rank)
    per_tp: dict[int, int] = defaultdict(int)
    held: dict[tuple[int, int | None, int], int] = defaultdict(int)  # unit, shard, tp rank
    for k in sorted(range(len(split)), key=lambda k: -costs[k]):
        pl, cost = split[k], costs[k]
        u, r, n, T = pl.spec.unit, pl.owner_shard, pl.spec.numel, pl.spec.tp
        cap = max(largest[u], -(-total[u] // (len(pl.row_ranges) * T)))
        loads = [gpu[(pl.owner, t)] for t in range(T)]
        ok = max(limit, min(loads) + cost)
        t = min((t for t in range(T) if loads[t] + cost <= ok),
                key=lambda t: (held[(u, r, t)] + n > cap, loads[t], stored[(r, t)], per_tp[t], t))
        gpu[(pl.owner, t)] += cost
        stored[(r, t)] += n
        per_tp[t] += cost
        held[(u, r, t)] += n
        pl.tp_owner = t


def make_plan(specs: Sequence[ParamSpec], world_size: int, unit_names: Sequence[str],
              ns_steps: int = 5, shard_size: int | None = None,
              tp_ownership: str = "auto", tp_rates: TPRates | None = None) -> Plan:
    """Place every parameter: even ones by rows, Muon matrices whole on balanced owners.

    Every Muon matrix is one item of the assignment, each expert of an expert stack
    included, so the experts' NS cost and the 2-D matrices' balance together. Rank r then
    holds the contiguous range of a stack's experts that matches how many of them the
    assignment gave it (the experts of one stack are interchangeable).

    ``shard_size`` (HSDP; default ``world_size``, i.e. no replicas): storage is planned over
    the ``shard_size`` ranks of one shard group, the same in every replica. Expert stacks are
    assigned over the shard group (they run on every replica); then each 2-D matrix gets a
    world-rank owner among all ``world_size`` ranks, on top of the expert load of its shard
    rank: a unit's matrices on distinct shard ranks where they fit (what the replicate dim
    moves per shard rank), NS balanced over the whole world.

    ``tp_ownership`` (tensor parallelism): a tp-split matrix is owned by one tp rank of its
    owner (``"rank"``: held whole there, its slices hop to and from it), by its owner's tp
    group (``"group"``: each tp rank holds and steps its slice, the NS runs over the group),
    or by whichever of the two :func:`~matrixfsdp.layout.assign.tp_group_owned` finds
    cheaper at ``tp_rates`` (``"auto"``, per matrix).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    S = world_size if shard_size is None else shard_size
    if S < 1 or world_size % S:
        raise ValueError(f"shard_size must divide world_size, got {shard_size} for {world_size}")
    specs = _checked_specs(specs)
    placements, held = _place_even(specs, S)  # held: bytes per shard rank
    muon = [s for s in specs if s.muon]
    group = {s.name for s in muon if len(s.shape) == 2 and tp_group_owned(
        s.shape, s.tp, s.tp_dim, tp_ownership, ns_steps, tp_rates)}
    item_spec = [i for i, s in enumerate(muon) for _ in range(s.matrices)]
    costs = [ns_flops_split(muon[i].shape, muon[i].tp, muon[i].tp_dim, ns_steps)
             if muon[i].name in group else ns_flops(muon[i].matrix_shape, ns_steps)
             for i in item_spec]
    sizes = [math.prod(muon[i].matrix_shape) * muon[i].itemsize for i in item_spec]
    owners = _assign_items(muon, item_spec, costs, sizes, S, world_size, held)
    counts: list[dict[int, int]] = [{} for _ in muon]  # per Muon parameter: rank -> matrices
    rank_cost = [0] * world_size
    for i, c, b, r in zip(item_spec, costs, sizes, owners):
        counts[i][r] = counts[i].get(r, 0) + 1
        held[r % S] += b
        for w in (range(r, world_size, S) if muon[i].is_experts else (r,)):
            rank_cost[w] += c  # an expert runs on every replica of its shard rank
    placements.update(_place_muon(muon, counts, S))
    _place_tp_owners([placements[s.name] for s in muon if s.tp > 1 and s.name not in group],
                     ns_steps)
    ordered = {s.name: placements[s.name] for s in specs}
    rank_bytes = [held[w % S] for w in range(world_size)]
    return Plan(world_size, list(unit_names), ordered, ns_steps, rank_cost, rank_bytes,
                world_size // S)


def with_even_params(plan: Plan, specs: Sequence[ParamSpec]) -> Plan:
    """``plan`` with the even (non-Muon) parameters ``specs`` added in front, placed as
    :func:`make_plan` places them. Their bytes are the same on every shard rank, so the
    owners ``make_plan`` would choose for the whole set are ``plan``'s: the layout search
    plans a pipeline stage's blocks once and adds each stage's root parameters."""
    if any(s.muon for s in specs):
        raise ValueError("with_even_params: only even parameters can be added")
    placements, held = _place_even(specs, plan.shard_size)
    placements.update(plan.placements)
    return Plan(plan.world_size, plan.unit_names, placements, plan.ns_steps,
                list(plan.rank_cost), [b + held[0] for b in plan.rank_bytes], plan.replicas)


def unit_members(module: nn.Module, prefix: str, is_unit: Callable[[nn.Module], bool]
                 ) -> list[tuple[nn.Module, str, str]]:
    """(owning module, attribute, FQN) of the parameters of unit ``module`` that no child
    unit holds, in ``named_parameters`` order."""
    out = [(module, attr, f"{prefix}{attr}") for attr, p in module._parameters.items()
           if p is not None]
    for name, child in module._modules.items():
        if child is not None and not is_unit(child):
            out += unit_members(child, f"{prefix}{name}.", is_unit)
    return out


def is_muon_matrix(fqn: str, param: nn.Parameter, owner: nn.Module, in_root_unit: bool,
                   muon_filter: MuonFilter | None = None) -> bool:
    """Default rule: trainable weights inside the blocks (non-root units) that are
    matrices, and 3-D stacks of expert matrices ``(experts, m, n)`` (fused MoE weights).

    Excepted: embeddings; parameters named ``*bias*`` (GPT-OSS keeps per-expert biases as
    2-D ``(experts, out)``); convolution weights (``nn.Conv1d``'s is 3-D); 3-D parameters
    with a leading 1 (a broadcast dim, as in ViT's ``(1, tokens, d)`` position embedding or
    RWKV's ``(1, 1, d)`` mixes) or whose "matrices" are vectors (``(c, 1, k)``), and
    empty parameters (a zero-size dimension). All of those, and everything outside the
    blocks (embeddings, head, final norm), go to AdamW. A ``muon_filter`` decides instead
    (``make_plan`` still places an empty parameter it selects as an even one).
    """
    if muon_filter is not None:
        return bool(muon_filter(fqn, param))
    if (in_root_unit or not param.requires_grad or param.numel() == 0
            or "bias" in fqn.rsplit(".", 1)[-1]):
        return False
    if param.dim() == 2:
        return not isinstance(owner, nn.Embedding)
    if param.dim() == 3:
        return (not isinstance(owner, _CONVOLUTIONS) and param.shape[0] > 1
                and min(param.shape[1:]) > 1)
    return False


@dataclass
class Collected:
    """The parameters of a model's units, as the planner and the runtime see them.

    A tensor registered at several places (tied weights) is one parameter of one unit:
    planned, gathered and reduced once, registered at every place."""

    params: list[list[nn.Parameter]]  # per unit: its distinct parameters, in order
    refs: list[list[tuple[nn.Module, str, int]]]  # per unit: (module, attr, index in params)
    specs: list[ParamSpec]  # for the planner, unit-major in params order
    aliases: dict[str, str]  # tied name -> the name the plan uses


def _check_param(fqn: str, p: nn.Parameter, first: tuple[str, nn.Parameter] | None,
                 unit_name: str) -> None:
    if not p.is_floating_point():
        raise ValueError(f"matrixfsdp: parameter '{fqn}' has dtype {p.dtype}; only "
                         "floating-point parameters can be sharded")
    if first is not None and (p.dtype != first[1].dtype or p.device != first[1].device):
        raise ValueError(
            f"matrixfsdp: unit '{unit_name}' mixes parameters '{first[0]}' "
            f"({first[1].dtype}, {first[1].device}) and '{fqn}' ({p.dtype}, {p.device}); "
            "all parameters of one unit need the same dtype and device")


def collect_params(named_units: Sequence[tuple[str, nn.Module]],
                   is_unit: Callable[[nn.Module], bool],
                   muon_filter: MuonFilter | None) -> Collected:
    """Each unit's parameters (and where they are registered), checked, and their specs.

    ``named_units``: (name under the root, module) of every unit, the root first (its name
    is ""); ``is_unit`` tells which submodules are units of their own (their parameters are
    not the enclosing unit's). Refuses a tensor tied across two units, a non-floating-point
    parameter, a unit mixing dtypes or devices, and a ``muon_filter`` choice that is neither
    a matrix nor an expert stack. No ``torch.distributed``: ``plan_module`` and
    ``fully_shard`` plan through this one function.
    """
    names = [name or "<root>" for name, _ in named_units]
    seen: dict[int, tuple[int, str, int]] = {}  # id -> (unit index, first name, index)
    out = Collected([], [], [], {})
    for ui, (uname, module) in enumerate(named_units):
        params: list[nn.Parameter] = []
        refs: list[tuple[nn.Module, str, int]] = []
        out.params.append(params)
        out.refs.append(refs)
        first: tuple[str, nn.Parameter] | None = None
        for mod, attr, fqn in unit_members(module, f"{uname}." if uname else "", is_unit):
            p = mod._parameters[attr]
            if id(p) in seen:
                other_unit, other, index = seen[id(p)]
                if other_unit != ui:
                    raise NotImplementedError(
                        f"matrixfsdp: parameter '{fqn}' (unit '{names[ui]}') is the same tensor "
                        f"as '{other}' (unit '{names[other_unit]}'); tied parameters must live "
                        "in one unit: leave one of the two modules out of its own fully_shard "
                        "call so that both belong to the unit that contains them")
                refs.append((mod, attr, index))
                out.aliases[fqn] = other
                continue
            seen[id(p)] = (ui, fqn, len(params))
            refs.append((mod, attr, len(params)))
            _check_param(fqn, p, first, names[ui])
            first = first or (fqn, p)
            params.append(p)
            is_muon = is_muon_matrix(fqn, p, mod, ui == 0, muon_filter)
            if is_muon and p.dim() not in (2, 3):
                raise ValueError(f"matrixfsdp: muon_filter selected parameter '{fqn}' of shape "
                                 f"{tuple(p.shape)}; Muon needs 2-D matrices or 3-D "
                                 "(experts, m, n) stacks of expert matrices")
            out.specs.append(ParamSpec(fqn, tuple(p.shape), p.element_size(), ui, is_muon))
    return out


def plan_module(root: nn.Module, units: Sequence[nn.Module], world_size: int,
                muon_filter: MuonFilter | None = None, ns_steps: int = 5,
                shard_size: int | None = None) -> Plan:
    """Plan a model from its shapes alone (it may live on the meta device), exactly as
    ``fully_shard`` would: same collector (tied parameters planned once), same planner.

    ``units`` are the modules ``fully_shard`` would be called on, the root included.
    ``shard_size``: HSDP with ``world_size // shard_size`` replicas (see :func:`make_plan`).
    """
    unit_set = {id(m) for m in units} | {id(root)}
    named = [(n, m) for n, m in root.named_modules() if id(m) in unit_set]
    collected = collect_params(named, lambda m: id(m) in unit_set, muon_filter)
    return make_plan(collected.specs, world_size, [n or "<root>" for n, _ in named], ns_steps,
                     shard_size)
