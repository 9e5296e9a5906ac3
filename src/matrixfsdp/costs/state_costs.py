"""Model state per rank for all ranks of a layout at once: what
:func:`~matrixfsdp.layout.traffic.rank_held` counts rank by rank (segments, the gradient
buffers the shards' ``.grad`` keep alive, Muon momentum and AdamW moments), summed from
difference arrays over the shard ranks plus the ranks that hold pieces, so a 16384-rank
plan costs milliseconds (``tests/advisor/test_plan_search.py`` holds it against ``rank_held``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..layout.traffic import reduce_layouts
from ..layout.units import UnitLayout


def _diff_add(diff: list[int], start: int, stop: int, v: int) -> None:
    if stop > start and v:
        diff[start] += v
        diff[stop] -= v


def _even_chunks(rows: int, S: int) -> tuple[int, int, int]:
    """FSDP2's chunks: ``c`` rows on ranks ``< q``, ``rem`` on rank ``q``, none after."""
    c = -(-rows // S)
    q = rows // c if c else 0
    return c, q, rows - q * c


@dataclass
class StateParts:
    """:func:`traffic.rank_held`'s totals of some units over ``S`` shard ranks, kept
    additive (difference arrays over the shard ranks for the even parts, sparse extras at the
    ranks holding pieces), so units planned once serve several stages."""

    S: int
    storage: int = 0
    grads: list[int] = field(default_factory=list)
    optim: list[int] = field(default_factory=list)
    default: dict[tuple[int, int], int] = field(default_factory=dict)
    specific: dict[tuple[int, int, int], int] = field(default_factory=dict)

    def __post_init__(self):
        self.grads = self.grads or [0] * (self.S + 1)
        self.optim = self.optim or [0] * (self.S + 1)

    def add(self, u: UnitLayout, red: UnitLayout, T: int, s: int) -> None:
        """Unit ``u`` (its storage layout; ``red``: its reduce layout, whose segments the
        gradients keep alive) over ``T`` tp ranks, ``s`` bytes per element."""
        S, E, H = self.S, u.even_numel, red.head
        self.storage += E * s
        reach = 0
        for pl in u.placements:
            if pl.spec.muon and pl.spec.numel:
                continue
            c, q, rem = _even_chunks(pl.spec.rows, S)
            rn = pl.spec.row_numel
            _diff_add(self.optim, 0, q, 2 * c * rn * s)
            _diff_add(self.optim, q, q + 1, 2 * rem * rn * s)
            if rn:
                reach = max(reach, q + (rem > 0))
        _diff_add(self.grads, 0, min(reach, S), H * s)
        held: dict[tuple[int, int], dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for pc in u.pieces:
            n = u.placements[pc.index].spec.numel if pc.split else pc.numel
            for t in ((pc.tp_owner,) if pc.split else range(T)):
                held[(pc.rank, t)][pc.kind] += n
        for (r, t), kinds in held.items():
            seg, grad_seg = u.segment(r, t).size, red.segment(r, t).size
            even_stepped = r < reach
            everywhere = kinds.get(0, 0)  # experts: stepped on every replica

            def grads(stepped: int, grad_seg: int = grad_seg, even_stepped: bool = even_stepped
                      ) -> int:  # beyond the even part's, counted already
                if even_stepped:
                    return (grad_seg - H) * s
                return grad_seg * s if stepped else 0
            base = grads(everywhere)
            self.default[(r, t)] = self.default.get((r, t), 0) + (seg - E) * s + base + \
                everywhere * s
            for k, n in kinds.items():
                if k:
                    key3 = (k - 1, r, t)
                    extra = grads(everywhere + n) - base + n * s
                    self.specific[key3] = self.specific.get(key3, 0) + extra

    def merged(self, other: StateParts) -> StateParts:
        out = StateParts(self.S, self.storage + other.storage,
                         [a + b for a, b in zip(self.grads, other.grads)],
                         [a + b for a, b in zip(self.optim, other.optim)],
                         dict(self.default), dict(self.specific))
        for k, v in other.default.items():
            out.default[k] = out.default.get(k, 0) + v
        for k, v in other.specific.items():
            out.specific[k] = out.specific.get(k, 0) + v
        return out

    def spread(self, R: int, T: int) -> tuple[float, float]:
        """(max, mean) of the total over the ``R x S x T`` ranks."""
        S = self.S
        grads, optim = list(self.grads), list(self.optim)
        for arr in (grads, optim):
            for r in range(1, S + 1):
                arr[r] += arr[r - 1]
        base_r = [self.storage + grads[r] + optim[r] for r in range(S)]
        top: dict[tuple[int, int], int] = defaultdict(int)
        for (_, r, t), v in self.specific.items():
            top[(r, t)] = max(top[(r, t)], v)
        best = max([max(base_r)] + [base_r[r] + v + top[(r, t)]
                                    for (r, t), v in self.default.items()])
        total = (R * T * sum(base_r) + R * sum(self.default.values())
                 + sum(self.specific.values()))
        return float(best), total / (R * S * T)


def state_spread(layouts: Sequence[UnitLayout], R: int, S: int, T: int, s: int
                 ) -> tuple[float, float]:
    """(max, mean) over the ``R x S x T`` ranks of :func:`traffic.rank_held`'s total."""
    parts = StateParts(S)
    for u, red in zip(layouts, reduce_layouts(layouts)):
        parts.add(u, red, T, s)
    return parts.spread(R, T)


