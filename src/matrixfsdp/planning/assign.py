"""Owner assignment: whole items (Muon matrices, each expert of a stack) to ranks so that
the largest per-rank cost (Newton-Schulz FLOPs) is as small as possible. Pure Python over
numbers."""

from __future__ import annotations

import functools
import heapq
from collections import defaultdict
from collections.abc import Sequence


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


def _distinct_costs(items: list[int], costs: list[int]) -> list[int]:
    seen: set[int] = set()
    out = []
    for i in items:
        if costs[i] not in seen:
            seen.add(costs[i])
            out.append(i)
    return out


def assign(costs: list[int], sizes: list[int], world_size: int,
            base_bytes: list[int], base_load: list[int] | None = None) -> list[int]:
    """Owners for items, minimising the largest per-rank cost (ties: fewer bytes).

    Longest-processing-time first, then a bounded local search that moves or swaps items
    off the most loaded rank while that lowers the maximum. ``base_load``: cost each rank
    carries already (HSDP: the experts of its shard rank).
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

    items: defaultdict[int, list[int]] = defaultdict(list)  # rank -> its items
    for i, r in enumerate(owner):
        items[r].append(i)
    for _ in range(4 * len(costs) + 16):
        hi = max(range(world_size), key=lambda r: (load[r], mem[r]))
        best = None  # (new max of the pair, move)
        # Only costs matter to a move, so each rank offers one item per distinct cost (the
        # first in its list, the one a full scan would pick): the experts of a stack are
        # many equal items, and this keeps the search small for MoE models.
        hi_items = _distinct_costs(items[hi], costs)
        for lo in heapq.nsmallest(64, range(world_size), key=lambda r: load[r]):
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
