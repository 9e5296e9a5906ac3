"""The plan as text: per rank, the matrices owned, bytes held, NS cost and the balance."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .types import Plan


def fmt_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``3.3 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass
class _Counts:
    owned: list[int]  # per world rank: Muon matrices whose NS it runs, each expert counted
    muon_bytes: list[int]  # per shard rank: Muon bytes stored
    n_muon: int  # Muon matrices, each expert counted
    n_experts: int
    n_stacks: int
    n_even: int


def _counts(plan: Plan) -> _Counts:
    P, S = plan.world_size, plan.shard_size
    c = _Counts([0] * P, [0] * S, 0, 0, 0, 0)
    for pl in plan.placements.values():
        if not pl.spec.muon:
            c.n_even += 1
            continue
        matrix_bytes = math.prod(pl.spec.matrix_shape) * pl.spec.itemsize
        c.n_muon += pl.spec.matrices
        if pl.spec.is_experts:
            c.n_stacks += 1
            c.n_experts += pl.spec.matrices
            for w in range(P):
                c.owned[w] += pl.matrices_on(w % S)
            for r in range(S):
                c.muon_bytes[r] += pl.matrices_on(r) * matrix_bytes
        else:
            c.owned[pl.owner] += 1
            c.muon_bytes[pl.owner_shard] += matrix_bytes
    return c


def _head(plan: Plan, c: _Counts) -> list[str]:
    P, S, R = plan.world_size, plan.shard_size, plan.replicas
    experts = (f", {c.n_experts} of them experts of {c.n_stacks} 3-D parameters (experts split "
               "over ranks, each whole)") if c.n_stacks else ""
    if R == 1:
        head = f"MatrixFSDP plan: {P} ranks"
        cols = "| rank | matrices | Muon bytes | even bytes | bytes held | NS GFLOP | NS cost / mean |"
    else:
        head = (f"MatrixFSDP plan (HSDP): {P} ranks = {R} replicas x {S} shard ranks; each 2-D "
                "matrix is stored on one shard rank of every replica and stepped (NS) by one "
                "world rank" + ("; experts run on every replica" if c.n_stacks else ""))
        cols = ("| rank | (replica, shard) | matrices (NS here) | Muon bytes | even bytes | "
                "bytes held | NS GFLOP | NS cost / mean |")
    return [f"{head}, {len(plan.unit_names)} units, {c.n_muon} Muon matrices (whole on one "
            f"owner){experts}, {c.n_even} even-sharded parameters",
            "", cols, "|---:" * cols.count(" | ") + "|---:|"]


def _rows(plan: Plan, c: _Counts, max_rows: int, n_cols: int) -> list[str]:
    P, S, R = plan.world_size, plan.shard_size, plan.replicas
    mean_cost = sum(plan.rank_cost) / P
    ranks = list(range(P))
    if P > max_rows:  # show the heaviest ranks, the summary covers the rest
        ranks = sorted(sorted(ranks, key=lambda r: -plan.rank_cost[r])[:max_rows])
    lines = []
    for r in ranks:
        share = plan.rank_cost[r] / mean_cost if mean_cost else 0.0
        where = f"| ({r // S}, {r % S}) " if R > 1 else ""
        muon = c.muon_bytes[r % S]
        lines.append(
            f"| {r} {where}| {c.owned[r]} | {fmt_bytes(muon)} | "
            f"{fmt_bytes(plan.rank_bytes[r] - muon)} | "
            f"{fmt_bytes(plan.rank_bytes[r])} | {plan.rank_cost[r] / 1e9:.2f} | {share:.3f} |")
    if len(ranks) < P:
        lines.append(f"| ... | ({P - len(ranks)} lighter ranks not shown) |" + " |" * (n_cols - 1))
    return lines


def _summary(plan: Plan) -> list[str]:
    P, S = plan.world_size, plan.shard_size
    total_cost = sum(plan.rank_cost)
    mean_bytes = sum(plan.rank_bytes) / P
    lines = [
        "",
        f"NS cost imbalance (max/mean): {plan.imbalance:.3f}; lower bound "
        f"max(largest matrix, total/P)/mean: {plan.imbalance_bound:.3f}; "
        f"gap to the bound: {plan.imbalance / plan.imbalance_bound - 1:+.1%}",
        f"Bytes held per rank: max {fmt_bytes(max(plan.rank_bytes))}, "
        f"mean {fmt_bytes(mean_bytes)} (max/mean "
        f"{max(plan.rank_bytes) / mean_bytes if mean_bytes else 1.0:.3f})",
        f"Ranks owning no Muon matrix: {sum(1 for c in plan.rank_cost if c == 0)}",
    ]
    if plan.replicas > 1:
        lines.append(
            f"NS work per rank: mean {total_cost / P / 1e9:.2f} GFLOP = total / {P} world ranks "
            f"(a plain HSDP that repeats NS on every replica: total / {S} = "
            f"{total_cost / S / 1e9:.2f} GFLOP per rank)")
    return lines


def format_report(plan: Plan, max_rows: int = 32) -> str:
    """A readable table: per rank, the matrices owned, bytes held, NS cost, balance.

    Under HSDP each row is a world rank with its (replica, shard rank): "matrices" are the
    ones whose NS it runs (its owned 2-D matrices plus its shard rank's experts), "Muon
    bytes" what it stores (every matrix of its shard rank, whichever replica steps it)."""
    c = _counts(plan)
    head = _head(plan, c)
    n_cols = head[2].count(" | ")
    return "\n".join(head + _rows(plan, c, max_rows, n_cols) + _summary(plan))
