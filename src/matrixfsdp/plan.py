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

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from torch import nn

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


def ns_flops(shape: Sequence[int], ns_steps: int = 5) -> int:
    """FLOPs of ``ns_steps`` quintic Newton-Schulz iterations on an ``m x n`` matrix.

    NS works on the wide orientation (``a = min(m, n)`` rows, ``b = max(m, n)`` columns).
    Per iteration: ``X X^T`` (2a²b), ``B = bA + cA²`` (2a³), ``aX + B X`` (2a²b).
    """
    m, n = shape
    a, b = min(m, n), max(m, n)
    return ns_steps * (4 * a * a * b + 2 * a**3)


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


def _even_ranges(rows: int, world_size: int) -> list[tuple[int, int]]:
    """FSDP2's ``Shard(0)`` chunks: rank r holds rows ``[r c, (r+1) c)`` of dim 0, clipped to
    ``rows``, with ``c = ceil(rows / world_size)``. Every rank's piece fits one chunk, so the
    gather is one even all-gather of chunk-padded pieces (docs/design.md)."""
    chunk = -(-rows // world_size)
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(world_size)]


def _distinct_costs(items: list[int], costs: list[int]) -> list[int]:
    seen: set[int] = set()
    out = []
    for i in items:
        if costs[i] not in seen:
            seen.add(costs[i])
            out.append(i)
    return out


def _assign(costs: list[int], sizes: list[int], world_size: int,
            base_bytes: list[int], base_load: list[int] | None = None) -> list[int]:
    """Owners for items, minimising the largest per-rank cost (ties: fewer bytes).

    Longest-processing-time first, then a bounded local search that moves or swaps items
    off the most loaded rank while that lowers the maximum. ``base_load``: cost each rank
    carries already (HSDP: the experts of its shard rank).
    """
    owner = [0] * len(costs)
    load = list(base_load) if base_load is not None else [0] * world_size
    mem = list(base_bytes)
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], -sizes[i], i))
    heap = [(load[r], mem[r], r) for r in range(world_size)]
    heapq.heapify(heap)
    for i in order:
        _, _, r = heapq.heappop(heap)
        owner[i] = r
        load[r] += costs[i]
        mem[r] += sizes[i]
        heapq.heappush(heap, (load[r], mem[r], r))

    items: list[list[int]] = [[] for _ in range(world_size)]
    for i, r in enumerate(owner):
        items[r].append(i)
    for _ in range(4 * len(costs) + 16):
        hi = max(range(world_size), key=lambda r: (load[r], mem[r]))
        best = None  # (new max of the pair, move)
        # Only costs matter to a move, so each rank offers one item per distinct cost (the
        # first in its list, the one a full scan would pick): the experts of a stack are
        # many equal items, and this keeps the search small for MoE models.
        hi_items = _distinct_costs(items[hi], costs)
        for lo in sorted(range(world_size), key=lambda r: load[r])[:64]:
            if lo == hi:
                continue
            lo_items = _distinct_costs(items[lo], costs)
            for a in hi_items:
                pair = max(load[hi] - costs[a], load[lo] + costs[a])
                if pair < load[hi] and (best is None or pair < best[0]):
                    best = (pair, a, None, lo)
                for b in lo_items:
                    d = costs[a] - costs[b]
                    if d <= 0:
                        continue
                    pair = max(load[hi] - d, load[lo] + d)
                    if pair < load[hi] and (best is None or pair < best[0]):
                        best = (pair, a, b, lo)
        if best is None:
            break
        _, a, b, lo = best
        for i, src, dst in ((a, hi, lo), (b, lo, hi)):
            if i is None:
                continue
            items[src].remove(i)
            items[dst].append(i)
            owner[i] = dst
            load[src] -= costs[i]
            load[dst] += costs[i]
            mem[src] -= sizes[i]
            mem[dst] += sizes[i]
    return owner


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
    R = world_size // S
    for s in specs:
        if s.muon and len(s.shape) not in (2, 3):
            raise ValueError(f"parameter '{s.name}' is marked as a Muon matrix but has "
                             f"shape {tuple(s.shape)}; Muon needs 2-D matrices or 3-D "
                             "(experts, m, n) stacks of expert matrices")
    # An empty matrix has nothing for Muon to do: plan it as an (empty) even parameter.
    specs = [replace(s, muon=False) if s.muon and s.numel == 0 else s for s in specs]
    placements: dict[str, Placement] = {}
    base_bytes = [0] * S  # per shard rank: each holds a whole (padded) chunk of every even one
    for s in specs:
        if s.muon:
            continue
        placements[s.name] = Placement(s, None, _even_ranges(s.rows, S))
        chunk_bytes = -(-s.rows // S) * s.row_numel * s.itemsize
        base_bytes = [b + chunk_bytes for b in base_bytes]

    muon = [s for s in specs if s.muon]
    item_spec = [i for i, s in enumerate(muon) for _ in range(s.matrices)]
    costs = [ns_flops(muon[i].matrix_shape, ns_steps) for i in item_spec]
    sizes = [math.prod(muon[i].matrix_shape) * muon[i].itemsize for i in item_spec]
    if R == 1:  # one assignment over all matrices and experts, as they run once
        owners = _assign(costs, sizes, S, base_bytes)
    else:  # experts over the shard ranks first, then 2-D matrices over the world
        owners = [0] * len(item_spec)
        experts = [k for k, i in enumerate(item_spec) if muon[i].is_experts]
        shard_load, shard_bytes = [0] * S, list(base_bytes)
        for k, r in zip(experts, _assign([costs[k] for k in experts],
                                         [sizes[k] for k in experts], S, base_bytes)):
            owners[k] = r
            shard_load[r] += costs[k]
            shard_bytes[r] += sizes[k]
        mats = [k for k, i in enumerate(item_spec) if not muon[i].is_experts]
        world_owners = _assign([costs[k] for k in mats], [sizes[k] for k in mats], world_size,
                               [shard_bytes[w % S] for w in range(world_size)],
                               [shard_load[w % S] for w in range(world_size)])
        for k, w in zip(mats, world_owners):
            owners[k] = w
    counts = [[0] * world_size for _ in muon]  # per Muon parameter, matrices per owner
    rank_cost = [0] * world_size
    held = list(base_bytes)  # per shard rank
    for i, c, b, r in zip(item_spec, costs, sizes, owners):
        counts[i][r] += 1
        held[r % S] += b
        for w in (range(r, world_size, S) if muon[i].is_experts else (r,)):
            rank_cost[w] += c  # an expert runs on every replica of its shard rank
    for s, per_rank in zip(muon, counts):
        if s.is_experts:
            ranges, start = [], 0
            for n in per_rank[:S]:
                ranges.append((start, start + n))
                start += n
            placements[s.name] = Placement(s, None, ranges)
        else:
            w = per_rank.index(1)
            ranges = [(0, 0)] * S
            ranges[w % S] = (0, s.rows)
            placements[s.name] = Placement(s, w, ranges)
    ordered = {s.name: placements[s.name] for s in specs}
    rank_bytes = [held[w % S] for w in range(world_size)]
    return Plan(world_size, list(unit_names), ordered, ns_steps, rank_cost, rank_bytes, R)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def format_report(plan: Plan, max_rows: int = 32) -> str:
    """A readable table: per rank, the matrices owned, bytes held, NS cost, balance.

    Under HSDP each row is a world rank with its (replica, shard rank): "matrices" are the
    ones whose NS it runs (its owned 2-D matrices plus its shard rank's experts), "Muon
    bytes" what it stores (every matrix of its shard rank, whichever replica steps it)."""
    P, S, R = plan.world_size, plan.shard_size, plan.replicas
    owned = [0] * P  # Muon matrices whose NS each world rank runs, each expert counted
    muon_bytes = [0] * S  # Muon bytes stored per shard rank
    n_experts = n_stacks = n_even = 0
    for pl in plan.placements.values():
        if not pl.spec.muon:
            n_even += 1
            continue
        matrix_bytes = math.prod(pl.spec.matrix_shape) * pl.spec.itemsize
        if pl.spec.is_experts:
            n_stacks += 1
            n_experts += pl.spec.matrices
            for w in range(P):
                owned[w] += pl.matrices_on(w % S)
            for r in range(S):
                muon_bytes[r] += pl.matrices_on(r) * matrix_bytes
        else:
            owned[pl.owner] += 1
            muon_bytes[pl.owner_shard] += matrix_bytes
    total_cost = sum(plan.rank_cost)
    mean_cost = total_cost / P
    n_muon = sum(1 for pl in plan.placements.values() if pl.owner is not None) + n_experts
    experts = (f", {n_experts} of them experts of {n_stacks} 3-D parameters (experts split "
               "over ranks, each whole)") if n_stacks else ""
    if R == 1:
        head = f"MatrixFSDP plan: {P} ranks"
        cols = "| rank | matrices | Muon bytes | even bytes | bytes held | NS GFLOP | NS cost / mean |"
    else:
        head = (f"MatrixFSDP plan (HSDP): {P} ranks = {R} replicas x {S} shard ranks; each 2-D "
                "matrix is stored on one shard rank of every replica and stepped (NS) by one "
                "world rank" + ("; experts run on every replica" if n_stacks else ""))
        cols = ("| rank | (replica, shard) | matrices (NS here) | Muon bytes | even bytes | "
                "bytes held | NS GFLOP | NS cost / mean |")
    lines = [
        f"{head}, {len(plan.unit_names)} units, "
        f"{n_muon} Muon matrices (whole on one owner){experts}, "
        f"{n_even} even-sharded parameters",
        "",
        cols,
        "|---:" * cols.count(" | ") + "|---:|",
    ]
    ranks = list(range(P))
    if P > max_rows:  # show the heaviest ranks, the summary covers the rest
        ranks = sorted(sorted(ranks, key=lambda r: -plan.rank_cost[r])[:max_rows])
    for r in ranks:
        share = plan.rank_cost[r] / mean_cost if mean_cost else 0.0
        where = f"| ({r // S}, {r % S}) " if R > 1 else ""
        lines.append(
            f"| {r} {where}| {owned[r]} | {_fmt_bytes(muon_bytes[r % S])} | "
            f"{_fmt_bytes(plan.rank_bytes[r] - muon_bytes[r % S])} | "
            f"{_fmt_bytes(plan.rank_bytes[r])} | {plan.rank_cost[r] / 1e9:.2f} | {share:.3f} |")
    if len(ranks) < P:
        lines.append(f"| ... | ({P - len(ranks)} lighter ranks not shown) |" + " |" * (
            cols.count(" | ") - 1))
    idle = sum(1 for c in plan.rank_cost if c == 0)
    mean_bytes = sum(plan.rank_bytes) / P
    lines += [
        "",
        f"NS cost imbalance (max/mean): {plan.imbalance:.3f}; lower bound "
        f"max(largest matrix, total/P)/mean: {plan.imbalance_bound:.3f}; "
        f"gap to the bound: {plan.imbalance / plan.imbalance_bound - 1:+.1%}",
        f"Bytes held per rank: max {_fmt_bytes(max(plan.rank_bytes))}, "
        f"mean {_fmt_bytes(mean_bytes)} (max/mean "
        f"{max(plan.rank_bytes) / mean_bytes if mean_bytes else 1.0:.3f})",
        f"Ranks owning no Muon matrix: {idle}",
    ]
    if R > 1:
        lines.append(
            f"NS work per rank: mean {mean_cost / 1e9:.2f} GFLOP = total / {P} world ranks "
            f"(a plain HSDP that repeats NS on every replica: total / {S} = "
            f"{total_cost / S / 1e9:.2f} GFLOP per rank)")
    return "\n".join(lines)


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


def plan_module(root: nn.Module, units: Sequence[nn.Module], world_size: int,
                muon_filter: MuonFilter | None = None, ns_steps: int = 5,
                shard_size: int | None = None) -> Plan:
    """Plan a model from its shapes alone (it may live on the meta device).

    ``units`` are the modules ``fully_shard`` would be called on, the root included.
    ``shard_size``: HSDP with ``world_size // shard_size`` replicas (see :func:`make_plan`).
    """
    unit_set = {id(m) for m in units} | {id(root)}
    named = [(n, m) for n, m in root.named_modules() if id(m) in unit_set]
    specs = []
    for ui, (uname, umod) in enumerate(named):
        prefix = f"{uname}." if uname else ""
        for owner, attr, fqn in unit_members(umod, prefix, lambda m: id(m) in unit_set):
            p = owner._parameters[attr]
            muon = is_muon_matrix(fqn, p, owner, ui == 0, muon_filter)
            specs.append(ParamSpec(fqn, tuple(p.shape), p.element_size(), ui, muon))
    return make_plan(specs, world_size, [n or "<root>" for n, _ in named], ns_steps, shard_size)
