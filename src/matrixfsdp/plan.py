"""Where every parameter lives: the Plan.

Pure Python over shapes. Nothing here touches tensor data or ``torch.distributed``, so a
model built on the meta device plans in seconds for any world size.

Two kinds of parameter:

* **Muon matrices** live whole on one owner rank. The owner is chosen over all units at
  once so that the largest per-rank Newton-Schulz cost is as small as possible. A 3-D
  Muon parameter ``(experts, m, n)`` (fused MoE expert weights) is a stack of ``experts``
  Muon matrices: each expert is placed like any matrix, whole on one rank, and since the
  experts of one parameter are interchangeable, rank r gets a contiguous range of them
  (``row_ranges[r]`` along dim 0), as many as the assignment gave it.
* **Even parameters** (everything else: embeddings, head, norms, biases) are split by
  rows (dim 0) over all ranks as FSDP2's ``Shard(0)``: chunks of ``ceil(rows / P)`` rows,
  the last ranks' chunks short or empty. Storage pads every chunk to full size, so each
  rank stores the same bytes of them and the gather is one even all-gather.

A parameter with a zero-size dimension (``(0, n)``, ``(m, 0)``) holds no element: there
is nothing to orthogonalise, gather or reduce. It is never a Muon matrix, even where a
``muon_filter`` selects it (Muon on it would be a no-op, so the choice changes no number):
it is planned as an even parameter whose shards are all empty.

HSDP (``replicas x shard_size`` world ranks, docs/hsdp.md): storage is planned over the
``shard_size`` ranks of a shard group, identically in every replica (``row_ranges`` has
``shard_size`` entries), while each 2-D Muon matrix's ``owner`` is a *world* rank
``replica * shard_size + shard_rank``: it is stored whole on shard rank ``owner %
shard_size`` of every replica, and only replica ``owner // shard_size`` runs its NS. The
owners are balanced over all world ranks, so NS work per rank is ~ total / world size.
Expert stacks are planned over the shard group and run on every replica.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from torch import nn

from .assign import assign, ns_flops

MuonFilter = Callable[[str, nn.Parameter], bool]


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one parameter.

    ``name`` is the fully qualified name under the root module, ``unit`` the index of the
    communication unit (one ``fully_shard`` call) that holds it.
    """

    name: str
    shape: tuple[int, ...]
    itemsize: int
    unit: int
    muon: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def rows(self) -> int:
        """Length of dim 0 (a 0-d parameter counts as one row)."""
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def is_experts(self) -> bool:
        """A 3-D Muon parameter: a stack of ``shape[0]`` expert matrices."""
        return self.muon and len(self.shape) == 3

    @property
    def matrices(self) -> int:
        """How many Muon matrices this parameter holds (0 for an AdamW parameter)."""
        return self.shape[0] if self.is_experts else int(self.muon)

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        """``(m, n)`` of each Muon matrix: the last two dims."""
        return tuple(self.shape[-2:])


@dataclass
class Placement:
    """Where one parameter lives.

    Muon matrices: ``owner`` is the (world) rank running its NS; ``row_ranges[r]`` is the
    whole range on shard rank ``owner % shard_size`` and empty elsewhere (without HSDP the
    world is one shard group, so ``owner`` is simply the rank holding it whole). Expert
    stacks ``(experts, m, n)``: ``owner`` is None and ``row_ranges[r]`` is the contiguous
    range of whole experts shard rank r holds (possibly empty). Even parameters: ``owner``
    is None and ``row_ranges[r] = (start, stop)`` is shard rank r's slice of dim 0.
    """

    spec: ParamSpec
    owner: int | None
    row_ranges: list[tuple[int, int]]

    def local_rows(self, rank: int) -> int:
        start, stop = self.row_ranges[rank]
        return stop - start

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of rank's local tensor: the full shape on the owner, ``(0, *rest)``
        where a rank holds no rows, and ``(rows, *rest)`` for an even shard."""
        if not self.spec.shape:  # 0-d: the one "row" lives on a single rank
            return () if self.local_rows(rank) else (0,)
        return (self.local_rows(rank), *self.spec.shape[1:])

    @property
    def owner_shard(self) -> int | None:
        """The shard rank that stores this 2-D Muon matrix (None for other parameters)."""
        return None if self.owner is None else self.owner % len(self.row_ranges)

    @property
    def owner_replica(self) -> int | None:
        """The replica whose copy of this 2-D Muon matrix is stepped (HSDP; 0 without)."""
        return None if self.owner is None else self.owner // len(self.row_ranges)

    def matrices_on(self, rank: int) -> int:
        """How many whole Muon matrices shard rank ``rank`` holds of this parameter."""
        if self.spec.is_experts:
            return self.local_rows(rank)
        return int(self.spec.muon and self.owner_shard == rank)


@dataclass
class Plan:
    """The single source of truth on where parameters live, for one world size.

    ``world_size`` counts all ranks (``replicas x shard_size`` under HSDP); ``rank_cost``
    and ``rank_bytes`` are per world rank (NS FLOPs it runs, bytes it holds).
    """

    world_size: int
    unit_names: list[str]
    placements: dict[str, Placement]  # in unit order, then module order
    ns_steps: int = 5
    rank_cost: list[int] = field(default_factory=list)
    rank_bytes: list[int] = field(default_factory=list)
    replicas: int = 1

    @property
    def shard_size(self) -> int:
        """Ranks per shard group: the ranks a unit's flat buffer is split over."""
        return self.world_size // self.replicas

    def unit_params(self, unit: int) -> list[Placement]:
        return [pl for pl in self.placements.values() if pl.spec.unit == unit]

    @property
    def muon_costs(self) -> list[int]:
        """NS cost of every Muon matrix, each expert of an expert stack counted once."""
        return [ns_flops(pl.spec.matrix_shape, self.ns_steps)
                for pl in self.placements.values() for _ in range(pl.spec.matrices)]

    @property
    def lower_bound(self) -> float:
        """No assignment of whole matrices can beat ``max(largest matrix, total / P)``
        (under HSDP, expert NS runs on every replica: counted ``replicas`` times)."""
        costs = self.muon_costs
        if not costs:
            return 0.0
        work = sum(ns_flops(pl.spec.matrix_shape, self.ns_steps) * pl.spec.matrices
                   * (self.replicas if pl.spec.is_experts else 1)
                   for pl in self.placements.values() if pl.spec.muon)
        return max(max(costs), work / self.world_size)

    @property
    def imbalance(self) -> float:
        """Largest per-rank NS cost over the mean (1.0 is perfect)."""
        total = sum(self.rank_cost)
        return max(self.rank_cost) * self.world_size / total if total else 1.0

    @property
    def imbalance_bound(self) -> float:
        """The best imbalance any whole-matrix assignment could reach."""
        total = sum(self.rank_cost)
        return self.lower_bound * self.world_size / total if total else 1.0


@functools.lru_cache(maxsize=4096)
def _even_ranges(rows: int, world_size: int) -> list[tuple[int, int]]:
    """FSDP2's ``Shard(0)`` chunks: rank r holds rows ``[r c, (r+1) c)`` of dim 0, clipped to
    ``rows``, with ``c = ceil(rows / world_size)``. Every rank's piece fits one chunk, so the
    gather is one even all-gather of chunk-padded pieces (docs/design.md). Cached: parameters
    of one shape share one list (``row_ranges`` are never mutated), for 16k-rank plans."""
    chunk = -(-rows // world_size)
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(world_size)]


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
    then 2-D matrices over the world ranks, on top of their shard rank's expert load."""
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
    world_owners = assign([costs[k] for k in mats], [sizes[k] for k in mats], world_size,
                          [shard_bytes[w % S] for w in range(world_size)],
                          [shard_load[w % S] for w in range(world_size)])
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


def make_plan(specs: Sequence[ParamSpec], world_size: int, unit_names: Sequence[str],
              ns_steps: int = 5, shard_size: int | None = None) -> Plan:
    """Place every parameter: even ones by rows, Muon matrices whole on balanced owners.

    Every Muon matrix is one item of the assignment, each expert of an expert stack
    included, so the experts' NS cost and the 2-D matrices' balance together. Rank r then
    holds the contiguous range of a stack's experts that matches how many of them the
    assignment gave it (the experts of one stack are interchangeable).

    ``shard_size`` (HSDP; default ``world_size``, i.e. no replicas): storage is planned over
    the ``shard_size`` ranks of one shard group, the same in every replica. Expert stacks are
    assigned over the shard group (they run on every replica); then each 2-D matrix gets a
    world-rank owner among all ``world_size`` ranks, on top of the expert load of its shard
    rank, so NS is balanced over the whole world.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    S = world_size if shard_size is None else shard_size
    if S < 1 or world_size % S:
        raise ValueError(f"shard_size must divide world_size, got {shard_size} for {world_size}")
    specs = _checked_specs(specs)
    placements, held = _place_even(specs, S)  # held: bytes per shard rank
    muon = [s for s in specs if s.muon]
    item_spec = [i for i, s in enumerate(muon) for _ in range(s.matrices)]
    costs = [ns_flops(muon[i].matrix_shape, ns_steps) for i in item_spec]
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
    ordered = {s.name: placements[s.name] for s in specs}
    rank_bytes = [held[w % S] for w in range(world_size)]
    return Plan(world_size, list(unit_names), ordered, ns_steps, rank_cost, rank_bytes,
                world_size // S)


def format_report(plan: Plan, max_rows: int = 32) -> str:
    """The per-rank table of :func:`matrixfsdp.plan_table.format_report` (kept here for
    the callers that import it from the planner)."""
    from .plan_table import format_report as report
    return report(plan, max_rows)


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
        return (not isinstance(owner, nn.modules.conv._ConvNd) and param.shape[0] > 1
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
