"""The analysis and the table of ``matrixfsdp bench --tp`` (:mod:`.tp`): pure functions
from every rank's record of its collectives to the critical-path bytes, the owner layout's
floor and the rendered table."""

from __future__ import annotations

import json
from typing import Any

from matrixfsdp.runtime.collectives import PHASE_OF
from matrixfsdp.train.machine import machine_line

from .tp_model import KINDS, MIB, SYSTEMS, TPBenchConfig


# ---- analysis (pure: every rank's record in, the results out) -------------------------------
def _op_kind(op: str) -> str:
    if op.startswith("all_gather") or op == "broadcast":
        return "gather"
    if op.startswith("reduce_scatter") or op == "reduce":
        return "reduce"
    return "other"


def unit_passes(per_rank_calls: list[list[dict]]) -> dict[str, Any]:
    """The step's collectives, each charged to its group's most loaded rank (calls matched
    per group, in order), grouped into unit passes (a unit's gather or reduce: a tagged
    call's tag; untagged, the k-th calls of the same op on every group of one size, as each
    of FSDP2's collectives runs on every data-parallel group at once). A pass ends when its
    most loaded rank is done: its cost is the maximum over ranks of the costs of
    the calls that rank takes part in. Returns the passes (``kind``, ``cost``, ``tp_hop``:
    the same maximum over the all-to-alls alone; ``group_size`` of its first group, ``unit``
    from its tag, ``phase`` its first call's) and per rank its bytes per kind."""
    queues: dict[tuple, dict[int, list[dict]]] = {}
    for r, calls in enumerate(per_rank_calls):
        for c in calls:
            queues.setdefault((c["group"], tuple(c["ranks"])), {}).setdefault(r, []).append(c)
    per_rank = [{"gather": 0, "reduce": 0, "other": 0, "calls": 0} for _ in per_rank_calls]
    passes: dict[str, dict[str, Any]] = {}
    for (name, ranks), by_rank in queues.items():
        if sorted(by_rank) != sorted(ranks) or len({len(v) for v in by_rank.values()}) != 1:
            raise RuntimeError(f"group {name} {list(ranks)}: calls per rank "
                               f"{ {r: len(v) for r, v in by_rank.items()} } do not match")
        for k, same in enumerate(zip(*(by_rank[r] for r in ranks))):
            first = same[0]
            if any(c["op"] != first["op"] or c["tag"] != first["tag"] for c in same):
                raise RuntimeError(f"group {name}: mismatched calls "
                                   f"{[(c['op'], c['tag']) for c in same]}")
            cost = max(max(c["sent"], c["received"]) for c in same)
            tag = first["tag"]
            # untagged: the k-th call of every group of the same kind and size runs at once
            # (FSDP2's all-gather of one unit on each data-parallel group, or of one
            # experts' unit on each ep rank's group): one pass
            key = (json.dumps(tag) if tag is not None
                   else f"{first['op']}@{len(ranks)}#{k}")
            kind = tag[1] if tag is not None else _op_kind(first["op"])
            p = passes.setdefault(key, {"kind": kind, "rank_bytes": {}, "rank_hop": {},
                                        "ops": {}, "group_size": len(ranks),
                                        "phase": first["phase"],
                                        "unit": tag[0] if tag is not None else None})
            hop = cost if first["op"] == "all_to_all_single" else 0
            p["ops"][first["op"]] = p["ops"].get(first["op"], 0) + 1
            for r in ranks:
                p["rank_bytes"][r] = p["rank_bytes"].get(r, 0) + cost
                p["rank_hop"][r] = p["rank_hop"].get(r, 0) + hop
                per_rank[r][kind] += cost
                per_rank[r]["calls"] += 1
    out = {k: {"kind": p["kind"], "cost": max(p["rank_bytes"].values()),
               "tp_hop": max(p["rank_hop"].values()), "ops": p["ops"],
               "group_size": p["group_size"], "unit": p["unit"], "phase": p["phase"]}
           for k, p in passes.items()}
    return {"passes": out, "per_rank": per_rank}


def stats_by_kind(summary: dict[str, dict[str, int]]) -> dict[str, int]:
    """MatrixFSDP's own counters (one rank's ``comm_stats``) as gather / reduce / other
    critical bytes."""
    out = {"gather": 0, "reduce": 0, "other": 0}
    for kind, c in summary.items():
        ph = PHASE_OF.get(kind, "other")
        out[ph if ph in ("gather", "reduce") else "other"] += c["critical_bytes"]
    return out


def row_hop(holders: list[int], T: int) -> int:
    """The all-to-all of one data-parallel row: the most loaded tp rank's max(sent,
    received) bytes when tp rank t holds matrices of ``holders[t]`` bytes (whole) and sends
    every other tp rank its ``1/T`` slice of each."""
    W = sum(holders)
    return max(max((T - 1) * h, W - h) for h in holders) // T


def best_hop(sizes: list[int], d: int, T: int) -> int:
    """The least all-to-all cost of one unit pass any placement of its whole matrices
    (``sizes`` bytes) on the ``d x T`` grid can have: the minimum over placements of the
    maximum over rows of :func:`row_hop` (exhaustive, with symmetric states pruned)."""
    items = sorted(sizes, reverse=True)
    best = [row_hop([sum(items)] + [0] * (T - 1), T)]  # everything on one holder
    seen: set = set()

    def canon(grid):
        return tuple(sorted(tuple(sorted(row)) for row in grid))

    def visit(i: int, grid: list[list[int]]) -> None:
        cost = max(row_hop(row, T) for row in grid)
        if cost >= best[0]:
            return
        if i == len(items):
            best[0] = cost
            return
        key = (i, canon(grid))
        if key in seen:
            return
        seen.add(key)
        for r in range(d):
            for t in range(T):
                grid[r][t] += items[i]
                visit(i + 1, grid)
                grid[r][t] -= items[i]

    visit(0, [[0] * T for _ in range(d)])
    return best[0]


def owner_floor(units: list[dict], placements: list[dict], gathers: dict[str, int], dp: int,
                tp: int) -> dict[str, float]:
    """The owner layout's critical bytes per step against FSDP2 + TP's, from the units'
    sizes (module docstring). Per gather and per reduce of a unit, FSDP2 + TP
    ``(M/T + E)(d-1)/d``; the owner layout ``M/T + hop + E(d-1)/d`` (a reduce also the
    unit's gradient flags, ``F`` bytes from each of the ``d - 1`` others), where ``hop``,
    the tp all-to-all's most loaded rank, is

    * ``balanced``: ``(T-1)M/(dT^2)`` (every row owns ``M/d``, every holder ``M/(dT)``):
      the floor ``(M/T)(1 + (T-1)/(dT)) + E(d-1)/d``;
    * ``whole``: the least any placement of the unit's whole matrices allows
      (:func:`best_hop`): the floor for whole matrices;
    * ``plan``: what the plan's placement (``placements``) gives: the prediction of the
      measured bytes.

    ``gathers``: per unit, how many times a step gathers it (the reduce: once)."""
    d, T = dp, tp
    fsdp2 = common = 0.0
    hops = {"balanced": 0.0, "whole": 0, "plan": 0}
    for u in units:
        M, E, n = u["matrix_bytes"], u["even_bytes"], gathers[u["name"]] + 1
        fsdp2 += n * (M / T + E) * (d - 1) / d
        # a reduce's chunks also carry the unit's gradient flags from each of the d - 1 others
        common += n * (M / T + E * (d - 1) / d) + u["flag_bytes"] * (d - 1)
        mine = [p for p in placements if p["unit_name"] == u["name"]]
        rows = [[sum(p["bytes"] for p in mine if p["dp_owner"] == r and p["tp_holder"] == t)
                 for t in range(T)] for r in range(d)]
        hops["balanced"] += n * (T - 1) * M / (d * T * T)
        hops["whole"] += n * (best_hop([p["bytes"] for p in mine], d, T) if mine else 0)
        hops["plan"] += n * max(row_hop(row, T) for row in rows)
    out: dict[str, Any] = {"fsdp2_tp": fsdp2, "common": common, "tp_hop": hops,
                           "matrix_ratio": (d * T + T - 1) / ((d - 1) * T)}
    for k, h in hops.items():
        out[k] = common + h
        out[f"{k}_ratio"] = (common + h) / fsdp2 if fsdp2 else float("nan")
    return out


def _gathers(passes: dict[str, dict], units: list[dict]) -> dict[str, int]:
    """How many times the step gathers each unit (MatrixFSDP's tagged gather passes)."""
    out = {u["name"]: 0 for u in units}
    for key in passes:
        if key.startswith("["):
            unit, kind, _ = json.loads(key)
            if kind == "gather":
                out[unit] += 1
    return out


def summarise(records: list[dict[str, Any]], cfg: TPBenchConfig, dp: int, tp: int
              ) -> dict[str, Any]:
    """One grid's results from every rank's :func:`measure_rank` record (rank order)."""
    res: dict[str, Any] = {"dp": dp, "tp": tp, "ranks": dp * tp, "systems": {}}
    analysed = {}
    for system in SYSTEMS:
        a = analysed[system] = unit_passes([r[system]["calls"] for r in records])
        crit = {k: sum(p["cost"] for p in a["passes"].values() if p["kind"] == k)
                for k in (*KINDS, "other")}
        crit["total"] = sum(crit.values())
        crit["tp_hop"] = sum(p["tp_hop"] for p in a["passes"].values())
        per_rank = a["per_rank"]
        calls0 = records[0][system]["calls"]
        ops: dict[str, int] = {}
        for c in calls0:
            ops[c["op"]] = ops.get(c["op"], 0) + 1
        res["systems"][system] = {
            "critical": crit, "passes": len(a["passes"]),
            "per_rank_bytes": [p["gather"] + p["reduce"] + p["other"] for p in per_rank],
            "calls_rank0": ops, "step_calls": sum(1 for c in calls0 if c["phase"] == "step"),
            "step_wall_ms": max(r[system]["step_wall_ms"] for r in records)}
    own = [stats_by_kind(r["matrixfsdp"]["comm_stats"]) for r in records]
    res["systems"]["matrixfsdp"]["comm_stats_agrees"] = all(
        o[k] == p[k] for o, p in zip(own, analysed["matrixfsdp"]["per_rank"])
        for k in ("gather", "reduce", "other"))
    groups = {tuple(c["ranks"]) for rec in records for c in rec["fsdp2_tp"]["calls"]}
    res["systems"]["fsdp2_tp"]["dp_groups_only"] = all(
        len(g) == dp and len({records[r]["tp_rank"] for r in g}) == 1 for g in groups)
    units = records[0]["matrixfsdp"]["units"]
    placements = records[0]["matrixfsdp"]["placements"]
    gathers = _gathers(analysed["matrixfsdp"]["passes"], units)
    floor = owner_floor(units, placements, gathers, dp, tp)
    ours, theirs = res["systems"]["matrixfsdp"]["critical"], res["systems"]["fsdp2_tp"]["critical"]
    res.update(units=units, gathers=gathers, floor=floor, placements=placements,
               ratio={k: ours[k] / theirs[k] if theirs[k] else float("nan")
                      for k in (*KINDS, "total")},
               # the flow moves what its design says, the plan's prediction, to the byte but
               # for the ring's rounding of (d-1)/d (a byte per pass at most)
               as_designed=abs(ours["total"] - ours["other"] - floor["plan"]) <= 3 * len(units)
               and ours["tp_hop"] == floor["tp_hop"]["plan"],
               fsdp2_as_modelled=abs(theirs["total"] - floor["fsdp2_tp"]) <= 3 * len(units),
               within_balanced_floor=ours["total"] <= floor["balanced_ratio"] * theirs["total"],
               within_whole_floor=ours["total"] <= floor["whole_ratio"] * theirs["total"])
    return res


# ---- the table ------------------------------------------------------------------------------
def mib(b: float) -> str:
    """Bytes as MiB with three decimals (the tables' unit)."""
    return f"{b / MIB:.3f}"


def render(results: dict[str, Any]) -> str:
    """The tables of every grid (Markdown)."""
    cfg = results["config"]
    m = cfg["model"]
    lines = [f"Llama {m['layers']} layers, d_model {m['d_model']}, {m['heads']} heads, FFN "
             f"{m['ffn']}, vocab {m['vocab']}; torchtitan's TP plan"
             f"{' with sequence parallelism' if cfg['sequence_parallel'] else ''}; seq "
             f"{cfg['seq']}, batch {cfg['batch']} per dp rank, fp32; one step after "
             f"{cfg['warmup']} warm-up. Critical path, MiB per step: every unit pass (a "
             "unit's gather or reduce; each FSDP2 collective is one) costs its most loaded "
             "rank's bytes, each collective charged max(sent, received) of its most loaded "
             "rank (NCCL's algorithms). DTensor's own (TP activation) collectives are "
             "excluded from both systems.", "", machine_line(results.get("machine")), "",
             "| grid (dp x tp) | phase | MatrixFSDP MiB | FSDP2 + TP MiB | ratio "
             "| floor, balanced | floor, whole matrices | plan's prediction |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for g in results["grids"]:
        ours, theirs = g["systems"]["matrixfsdp"]["critical"], g["systems"]["fsdp2_tp"]["critical"]
        fl = g["floor"]
        for k in (*KINDS, "total"):
            extra = "| | | |"
            if k == "total":
                extra = (f"| {fl['balanced_ratio']:.3f}x | {fl['whole_ratio']:.3f}x "
                         f"| {fl['plan_ratio']:.3f}x |")
            lines.append(f"| {g['dp']} x {g['tp']} ({g['ranks']} ranks) | {k} | {mib(ours[k])} "
                         f"| {mib(theirs[k])} | {g['ratio'][k]:.3f}x {extra}")
    lines += ["", "The tp all-to-alls (the hop between a matrix's holder and its tp row), MiB "
              "per step on the critical path, against the floor: balanced `(T-1)M/(dT^2)` per "
              "unit pass, the best placement of whole matrices, the plan's placement; and checks.",
              "", "| grid | tp hop measured | balanced | whole matrices | plan "
              "| collectives in optimizer.step() (ours / FSDP2 + AdamW) | comm_stats = "
              "recording | FSDP2 on dp groups only |", "|---|---:|---:|---:|---:|---|---|---|"]
    for g in results["grids"]:
        s, hop = g["systems"], g["floor"]["tp_hop"]
        lines.append(f"| {g['dp']} x {g['tp']} | {mib(s['matrixfsdp']['critical']['tp_hop'])} "
                     f"| {mib(hop['balanced'])} | {mib(hop['whole'])} | {mib(hop['plan'])} "
                     f"| {s['matrixfsdp']['step_calls']} / {s['fsdp2_tp']['step_calls']} "
                     f"| {'yes' if s['matrixfsdp']['comm_stats_agrees'] else 'NO'} "
                     f"| {'yes' if s['fsdp2_tp']['dp_groups_only'] else 'NO'} |")
    return "\n".join(lines) + "\n"


