"""Owner assignment: whole items (Muon matrices, each expert of a stack) to ranks so that
the largest per-rank cost (Newton-Schulz FLOPs) is as small as possible (:func:`assign`);
under HSDP, with each unit's matrices spread over the shard ranks, whose replicate-dim
traffic carries every matrix they store (:func:`assign_replicated`). Pure Python over
numbers."""

from __future__ import annotations

import functools
import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass


def ns_flops(shape: Sequence[int], ns_steps: int = 5) -> int:
    """FLOPs of ``ns_steps`` quintic Newton-Schulz iterations on an ``m x n`` matrix.

    NS works on the wide orientation (``a = min(m, n)`` rows, ``b = max(m, n)`` columns).
    Per iteration: ``X X^T`` (2a²b), ``B = bA + cA²`` (2a³), ``aX + B X`` (2a²b).
    """
    return _ns_flops(tuple(shape), ns_steps)


@functools.lru_cache(maxsize=4096)
def _ns_flops(shape: tuple[int, ...], ns_steps: int) -> int:
    m, n = shape
    a, b = min(m, n), max(m, n)
    return ns_steps * (4 * a * a * b + 2 * a**3)


def gram_side(shape: Sequence[int], dim: int) -> int:
    """The side of the Gram matrix a tp group sums for an ``m x n`` matrix split along
    ``dim``: the sliced dim's complement (``n`` for row slices, ``m`` for column slices)."""
    m, n = shape
    return n if dim == 0 else m


def ns_flops_split(shape: Sequence[int], tp: int, dim: int, ns_steps: int = 5) -> int:
    """FLOPs each of ``tp`` ranks runs for the NS of an ``m x n`` matrix its tp group owns,
    split ``tp`` ways along ``dim``: per iteration the Gram of its slice in the sliced dim's
    complement (``g x g``: 2 g² s / tp, ``s`` the sliced dim's length), the polynomial of the
    summed Gram on every rank (2 g³) and its slice's update (2 g² s / tp)."""
    g = gram_side(shape, dim)
    s = shape[dim]
    return ns_steps * (4 * g * g * s // tp + 2 * g**3)


@dataclass(frozen=True)
class TPRates:
    """The rates at which ``tp_ownership="auto"`` compares a tp-split matrix's two
    placements (the advisor passes its own): NS matmuls in FLOP/s, the tp group's link
    (NVLink) in bytes/s per GPU and direction, the NS, gather and reduce dtypes' bytes,
    and the gathers and reduces a matrix makes per step (forward, backward's re-gather)."""

    flops: float = 400e12
    link: float = 450e9
    ns_itemsize: int = 2
    gather_itemsize: int = 2
    reduce_itemsize: int = 4
    gathers: int = 2
    reduces: int = 1


def tp_placement_seconds(shape: Sequence[int], tp: int, dim: int, ns_steps: int = 5,
                         rates: TPRates | None = None) -> tuple[float, float]:
    """Seconds per step of an ``m x n`` matrix split ``tp`` ways along ``dim``, owned by one
    tp rank and by its tp group: ``(rank, group)``. One tp rank: its whole NS on that GPU,
    and the other slices' hop to and from it in every gather and reduce; the tp group: its
    share of the split NS, and ``ns_steps`` all-reduces of the ``g x g`` Gram, summed in
    float32 whatever the NS dtype (``newton_schulz_split_``; a ring over the group: ``2
    (tp-1)/tp`` of it through each GPU)."""
    rates = rates or DEFAULT_RATES
    numel = shape[0] * shape[1]
    hop = (tp - 1) * numel // tp * (rates.gathers * rates.gather_itemsize
                                    + rates.reduces * rates.reduce_itemsize)
    rank = ns_flops(shape, ns_steps) / rates.flops + hop / rates.link
    g = gram_side(shape, dim)
    reduce = ns_steps * 2 * (tp - 1) * g * g * max(rates.ns_itemsize, 4) / tp
    group = ns_flops_split(shape, tp, dim, ns_steps) / rates.flops + reduce / rates.link
    return rank, group


DEFAULT_RATES = TPRates()
TP_OWNERSHIPS = ("rank", "group", "auto")


def tp_group_owned(shape: Sequence[int], tp: int, dim: int, ownership: str, ns_steps: int = 5,
                   rates: TPRates | None = None) -> bool:
    """Whether a Muon matrix split ``tp`` ways along ``dim`` is owned by its tp group
    (``ownership``: ``"rank"``, ``"group"``, or ``"auto"``: the cheaper by
    :func:`tp_placement_seconds`). Decided from shapes alone: every rank agrees."""
    if ownership not in TP_OWNERSHIPS:
        raise ValueError(f"tp_ownership must be one of {TP_OWNERSHIPS}, got {ownership!r}")
    if tp == 1 or ownership == "rank":
        return False
    if ownership == "group":
        return True
    rank, group = tp_placement_seconds(shape, tp, dim, ns_steps, rates)
    return group < rank


def _distinct(items: list[int], kinds: Sequence[object]) -> list[int]:
    seen: set[object] = set()
    out = []
    for i in items:
        if kinds[i] not in seen:
            seen.add(kinds[i])
            out.append(i)
    return out


def assign(costs: list[int], sizes: list[int], world_size: int,
           base_bytes: list[int], base_load: list[int] | None = None) -> list[int]:
    """Owners for items, minimising the largest per-rank cost (ties: fewer bytes).

    Longest-processing-time first, then a bounded local search that moves or swaps items
    off the most loaded rank while that lowers the maximum. ``base_load``: cost each rank
    carries already.
    """
    if not costs:
        return []
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
    _improve(owner, costs, sizes, load, mem)
    return owner


class _Move:
    """What :func:`_improve` may do and tells: ``allows(a, b, src, dst)`` (item ``a`` from
    ``src`` to ``dst`` and, unless ``b`` is None, item ``b`` back), ``moved(i, src, dst)``;
    ``kinds``: items of one kind are interchangeable in a move."""

    def kinds(self, costs: list[int]) -> Sequence[object]:
        """What tells items apart: two of one kind may stand for each other in a move."""
        return costs

    def allows(self, a: int, b: int | None, src: int, dst: int) -> bool:
        return True

    def moved(self, i: int, src: int, dst: int) -> None:
        pass


def _improve(owner: list[int], costs: list[int], sizes: list[int], load: list[int],
             mem: list[int], rules: _Move | None = None) -> None:
    """The local search: move or swap an item off the most loaded rank while that lowers
    the maximum of the pair (``rules`` permitting); ``owner``, ``load``, ``mem`` in place."""
    rules = rules or _Move()
    kinds = rules.kinds(costs)
    ranks = len(load)
    items: defaultdict[int, list[int]] = defaultdict(list)  # rank -> its items
    for i, r in enumerate(owner):
        items[r].append(i)
    for _ in range(4 * len(costs) + 16):
        hi = max(range(ranks), key=lambda r: (load[r], mem[r]))
        best = None  # (new max of the pair, move)
        # Only costs (and what ``rules`` tell apart) matter to a move, so each rank offers
        # one item per distinct kind (the first in its list, the one a full scan would
        # pick): the experts of a stack are many equal items, and this keeps the search
        # small for MoE models.
        hi_items = _distinct(items[hi], kinds)
        for lo in heapq.nsmallest(64, range(ranks), key=lambda r: load[r]):
            if lo == hi:
                continue
            lo_items = _distinct(items[lo], kinds)
            for a in hi_items:
                pair = max(load[hi] - costs[a], load[lo] + costs[a])
                if (pair < load[hi] and (best is None or pair < best[0])
                        and rules.allows(a, None, hi, lo)):
                    best = (pair, a, None, lo)
                for b in lo_items:
                    d = costs[a] - costs[b]
                    if d <= 0:
                        continue
                    pair = max(load[hi] - d, load[lo] + d)
                    if (pair < load[hi] and (best is None or pair < best[0])
                            and rules.allows(a, b, hi, lo)):
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
            rules.moved(i, src, dst)


class _Columns(_Move):
    """HSDP's shard ranks ("columns") as :func:`assign_replicated` fills them: the bytes of
    each group (unit) a column holds, under the group's cap where it can."""

    def __init__(self, sizes: list[int], groups: list[int], S: int):
        self.sizes, self.groups, self.S = sizes, groups, S
        total: defaultdict[int, int] = defaultdict(int)
        largest: defaultdict[int, int] = defaultdict(int)
        for g, b in zip(groups, sizes):
            total[g] += b
            largest[g] = max(largest[g], b)
        # the floor of a group's bytes at one shard rank: its largest item, or an even share
        self.cap = {g: max(largest[g], -(-total[g] // S)) for g in total}
        self.held: defaultdict[tuple[int, int], int] = defaultdict(int)  # (group, column)

    def kinds(self, costs: list[int]) -> Sequence[object]:
        return list(zip(costs, self.sizes, self.groups))

    def fits(self, i: int, c: int, less: int = 0) -> bool:
        g = self.groups[i]
        return self.held[(g, c)] - less + self.sizes[i] <= self.cap[g]

    def allows(self, a: int, b: int | None, src: int, dst: int) -> bool:
        cs, cd = src % self.S, dst % self.S
        if cs == cd:
            return True
        same = b is not None and self.groups[b] == self.groups[a]
        return (self.fits(a, cd, self.sizes[b] if same else 0)
                and (b is None or self.fits(b, cs, self.sizes[a] if same else 0)))

    def moved(self, i: int, src: int, dst: int) -> None:
        g = self.groups[i]
        self.held[(g, src % self.S)] -= self.sizes[i]
        self.held[(g, dst % self.S)] += self.sizes[i]


class _Fill:
    """:func:`assign_replicated`'s longest-processing-time pass over ``S`` columns of ``R``
    replicas each: per column a heap of the replicas given items ``(load, own bytes, world
    rank)`` beside the next untouched one, and over the columns a heap of ``(least replica
    load, bytes stored, column)``, both with stale entries skipped."""

    def __init__(self, costs: list[int], sizes: list[int], cols: _Columns, R: int,
                 base_bytes: list[int], base_load: list[int]):
        S = cols.S
        self.costs, self.sizes, self.cols, self.S, self.R = costs, sizes, cols, S, R
        self.load = [base_load[w % S] for w in range(S * R)]
        self.own = [0] * (S * R)  # bytes of the matrices a rank steps (gradient, momentum)
        self.stored = list(base_bytes)  # per column: what each of its replicas stores
        self.owner = [-1] * len(costs)
        self.reps: list[list[tuple[int, int, int]]] = [[] for _ in range(S)]
        self.fresh = [0] * S  # per column: its replicas from this one on have no item yet
        self.top = [self.key(c) for c in range(S)]
        heapq.heapify(self.top)

    def least(self, c: int) -> int:
        """Column ``c``'s least loaded replica (ties: fewest bytes stepped, lowest rank)."""
        heap = self.reps[c]
        while heap and heap[0][:2] != (self.load[heap[0][2]], self.own[heap[0][2]]):
            heapq.heappop(heap)
        if self.fresh[c] < self.R:
            w = c + self.fresh[c] * self.S
            if not heap or (self.load[w], 0, w) < heap[0]:
                return w
        return heap[0][2]

    def key(self, c: int) -> tuple[int, int, int]:
        return self.load[self.least(c)], self.stored[c], c

    def pop(self) -> tuple[int, int, int]:
        """The least column's entry, off the heap (stale ones dropped)."""
        while self.top[0] != self.key(self.top[0][2]):
            heapq.heappop(self.top)
        return heapq.heappop(self.top)

    def place(self, i: int, w: int, sign: int = 1) -> None:
        c = w % self.S
        if w == c + self.fresh[c] * self.S:
            self.fresh[c] += 1
        self.owner[i] = w if sign > 0 else -1
        self.load[w] += sign * self.costs[i]
        self.own[w] += sign * self.sizes[i]
        self.stored[c] += sign * self.sizes[i]
        self.cols.held[(self.cols.groups[i], c)] += sign * self.sizes[i]
        heapq.heappush(self.reps[c], (self.load[w], self.own[w], w))
        heapq.heappush(self.top, self.key(c))

    def column_for(self, i: int) -> tuple[int, int]:
        """(the least column, the least one item ``i`` fits: under its unit's cap, else
        the one holding the least of its unit)."""
        blocked = [self.pop()]
        while self.top and not self.cols.fits(i, blocked[-1][2]):
            blocked.append(self.pop())
        if self.cols.fits(i, blocked[-1][2]):
            c = blocked[-1][2]
        else:
            g = self.cols.groups[i]
            c = min(blocked, key=lambda e: (self.cols.held[(g, e[2])], e))[2]
        for e in blocked:
            heapq.heappush(self.top, e)
        return blocked[0][2], c

    def trade(self, i: int, c: int, placed: list[int]) -> bool:
        """Put ``i`` where an earlier item of its cost from another unit is, and that item
        on column ``c``'s least replica, where the cap keeps ``i`` itself from ``c``: the
        loads are the same as if ``i`` had gone to ``c``."""
        cols = self.cols
        for b in reversed(placed):
            wb = self.owner[b]
            if (cols.groups[b] != cols.groups[i] and wb % self.S != c and cols.fits(b, c)
                    and cols.fits(i, wb % self.S)):
                self.place(b, wb, -1)
                self.place(b, self.least(c))
                self.place(i, wb)
                return True
        return False


def assign_replicated(costs: list[int], sizes: list[int], groups: list[int], S: int, R: int,
                      base_bytes: list[int], base_load: list[int]) -> list[int]:
    """World owners (``replica * S + shard rank``) of whole matrices under HSDP: ``R``
    replicas of ``S`` shard ranks; ``groups``: each item's unit; ``base_bytes`` and
    ``base_load``: per shard rank (its even rows; its experts, which run on every replica).

    Every replica of a shard rank stores each matrix any of them owns, and the replicate
    dim's reduce and broadcast of a unit at a shard rank carry all its matrices there. So
    the assignment is :func:`assign`'s (longest processing time first over the world ranks,
    then the local search) with one rule: a unit's matrices at one shard rank stay within
    ``max(its largest, its total / S)`` bytes (the owner floor of the replicate dim) where a
    shard rank has room. Where the rule keeps an item off the least loaded rank, an earlier
    item of the same cost from another unit takes that rank and the item its place; failing
    that, the rule gives way if keeping it would raise NS above both the bound ``max(largest,
    total / world)`` and what the least loaded rank would get. Ties go to the shard rank
    storing the fewest bytes; a unit's matrices at one shard rank share one owner (one
    reduce, one broadcast) while that stays within the largest matrix's NS.
    """
    if not costs:
        return []
    cols = _Columns(sizes, groups, S)
    fill = _Fill(costs, sizes, cols, R, base_bytes, base_load)
    limit = max(costs)
    bound = max(limit, (sum(costs) + R * sum(base_load)) / (S * R))
    home: dict[tuple[int, int], int] = {}  # (group, column) -> the world rank stepping it
    same_cost: defaultdict[int, list[int]] = defaultdict(list)  # cost -> items placed
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], -sizes[i], i)):
        best, c = fill.column_for(i)
        least = fill.load[fill.least(best)] + costs[i]
        here = fill.load[fill.least(c)] + costs[i]
        traded = here > least and fill.trade(i, best, same_cost[costs[i]])
        if here > max(least, bound):  # the cap gives way where it would cost NS
            c = best
        if not traded:
            w = home.get((groups[i], c))
            if w is None or fill.load[w] + costs[i] > limit:
                w = fill.least(c)
            fill.place(i, w)
        home[(groups[i], fill.owner[i] % S)] = fill.owner[i]
        same_cost[costs[i]].append(i)
    owner, load, own = fill.owner, fill.load, fill.own
    _improve(owner, costs, sizes, load, own, cols)
    return owner
