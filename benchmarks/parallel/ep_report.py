"""The analysis and the table of ``matrixfsdp bench --ep`` (:mod:`.ep`): pure functions from
every rank's record of its collectives to the critical-path bytes per domain (the experts'
units, the dense units), the owner layout's floor and the rendered table. The passes are
:func:`.tp_report.unit_passes`'s."""

from __future__ import annotations

from typing import Any

from matrixfsdp.train.machine import machine_line

from ..harness.config import PHASES
from .ep_model import SYSTEMS
from .tp_model import KINDS
from .tp_report import mib, stats_by_kind, unit_passes

DOMAINS = ("experts", "dense")


def _empty() -> dict[str, Any]:
    return {**{dom: dict.fromkeys(KINDS, 0) for dom in DOMAINS}, "other": 0}


def owner_floor(units: list[dict], gathers: dict[str, int]) -> dict[str, Any]:
    """Per domain and kind, the critical bytes per step of the owner layout and of FSDP2's
    ring over the same ranks, from the units' sizes: a unit over ``P`` ranks with Muon
    matrices of ``M`` bytes and other parameters of ``E`` moves per pass ``M + E(P-1)/P``
    (owner layout: every rank relays or receives each whole matrix once, whatever the
    placement; a reduce also its ``F`` bytes of gradient flags from each of the ``P - 1``
    others) against ``(M + E)(P-1)/P`` (FSDP2). An experts' unit's stacks split evenly by
    whole experts over its ranks (the bench requires the experts to divide by them), so they
    travel in the unit's even all-gather / reduce-scatter, as ``E``: FSDP2's ring bytes.
    ``gathers``: per unit, how many times a step gathers it (the reduce: once)."""
    out: dict[str, Any] = {"matrixfsdp": _empty(), "fsdp2_ep": _empty(), "matrix_ratio": {}}
    for u in units:
        P, M, E = u["ranks"], u["matrix_bytes"], u["even_bytes"]
        if u["experts"]:  # whole experts, the same count on every rank: the even part
            M, E = 0, M + E
        dom = "experts" if u["experts"] else "dense"
        for kind, n in (("gather", gathers[u["name"]]), ("reduce", 1)):
            flags = u["flag_bytes"] * (P - 1) if kind == "reduce" and P > 1 else 0
            out["matrixfsdp"][dom][kind] += n * (M + E * (P - 1) / P + flags)
            out["fsdp2_ep"][dom][kind] += n * (M + E) * (P - 1) / P
        if M:
            out["matrix_ratio"][dom] = P / (P - 1)
    for s in SYSTEMS:
        out[s]["total"] = sum(out[s][dom][k] for dom in DOMAINS for k in KINDS)
    out["ratio"] = out["matrixfsdp"]["total"] / out["fsdp2_ep"]["total"]
    return out


def _critical(passes: dict[str, dict], domain_of) -> dict[str, Any]:
    """The step's critical bytes per domain and kind (``other``: anything else), per phase
    the passes began in, and in total."""
    crit = _empty()
    phases = dict.fromkeys(PHASES, 0)
    for p in passes.values():
        if p["kind"] in KINDS:
            crit[domain_of(p)][p["kind"]] += p["cost"]
        else:
            crit["other"] += p["cost"]
        if p["phase"] in phases:
            phases[p["phase"]] += p["cost"]
    crit["total"] = sum(crit[dom][k] for dom in DOMAINS for k in KINDS) + crit["other"]
    crit["phases"] = phases
    return crit


def summarise(records: list[dict[str, Any]], d: int, ep: int) -> dict[str, Any]:
    """One grid's results from every rank's :func:`.ep.measure_rank` record (rank order)."""
    units = records[0]["matrixfsdp"]["units"]
    experts_unit = {u["name"]: u["experts"] for u in units}
    res: dict[str, Any] = {"d": d, "ep": ep, "ranks": d * ep, "units": units, "systems": {}}
    domain = {"matrixfsdp": lambda p: "experts" if experts_unit.get(p["unit"]) else "dense",
              "fsdp2_ep": lambda p: "experts" if p["group_size"] == d else "dense"}
    analysed = {}
    for system in SYSTEMS:
        a = analysed[system] = unit_passes([r[system]["calls"] for r in records])
        calls0 = records[0][system]["calls"]
        ops: dict[str, int] = {}
        for c in calls0:
            ops[c["op"]] = ops.get(c["op"], 0) + 1
        res["systems"][system] = {
            "critical": _critical(a["passes"], domain[system]), "passes": len(a["passes"]),
            "per_rank_bytes": [p["gather"] + p["reduce"] + p["other"] for p in a["per_rank"]],
            "calls_rank0": ops,
            "step_calls": max(sum(1 for c in r[system]["calls"] if c["phase"] == "step")
                              for r in records),
            "step_wall_ms": max(r[system]["step_wall_ms"] for r in records)}
    own = [stats_by_kind(r["matrixfsdp"]["comm_stats"]) for r in records]
    res["systems"]["matrixfsdp"]["comm_stats_agrees"] = all(
        o[k] == p[k] for o, p in zip(own, analysed["matrixfsdp"]["per_rank"])
        for k in ("gather", "reduce", "other"))
    meshes = {tuple(r[g]) for r in records for g in ("experts_group", "dense_group")}
    res["systems"]["fsdp2_ep"]["mesh_groups_only"] = all(
        tuple(c["ranks"]) in meshes for r in records for c in r["fsdp2_ep"]["calls"])
    gathers = {u["name"]: 0 for u in units}
    for p in analysed["matrixfsdp"]["passes"].values():
        if p["unit"] is not None and p["kind"] == "gather":
            gathers[p["unit"]] += 1
    floor = owner_floor(units, gathers)
    ours, theirs = (res["systems"][s]["critical"] for s in SYSTEMS)
    # the runtime's own layout arithmetic (planning.layout), per unit and pass
    planned = _empty()
    for u in units:
        dom = "experts" if u["experts"] else "dense"
        planned[dom]["gather"] += gathers[u["name"]] * u["gather_bytes"]
        planned[dom]["reduce"] += u["reduce_bytes"]
    slack = 3 * len(units)  # the ring's rounding of (P-1)/P: a byte per pass at most

    def close(measured, model) -> bool:
        return all(abs(measured[dom][k] - model[dom][k]) <= slack for dom in DOMAINS for k in KINDS)

    res.update(gathers=gathers, floor=floor,
               ratio={**{f"{dom}_{k}": ours[dom][k] / theirs[dom][k] if theirs[dom][k]
                         else float("nan") for dom in DOMAINS for k in KINDS},
                      "total": ours["total"] / theirs["total"]},
               as_designed=close(ours, planned),
               fsdp2_as_modelled=close(theirs, floor["fsdp2_ep"]),
               # a reduce aligns each parameter after the flags to 16 elements: 60 bytes at most
               within_floor=ours["total"] - ours["other"] <= floor["matrixfsdp"]["total"] + slack
               + sum(15 * u["flag_bytes"] for u in units))
    return res


# ---- the table ------------------------------------------------------------------------------
def render(results: dict[str, Any]) -> str:
    """The tables of every grid (Markdown)."""
    cfg = results["config"]
    m = cfg["model"]
    lines = [f"MoE {m['layers']} blocks, d_model {m['d_model']}, {m['experts']} experts of "
             f"hidden {m['hidden']} (GroupedExperts w1/w2/w3), a dense d x d matrix and a "
             f"router per block, vocab {m['vocab']}; torchtitan's EP layout; seq {cfg['seq']}, "
             f"batch {cfg['batch']} per dp x ep rank, fp32; one step after {cfg['warmup']} "
             "warm-up. Critical path, MiB per step: every unit pass (a unit's gather or reduce; "
             "each FSDP2 collective is one) costs its most loaded rank's bytes, each collective "
             "charged max(sent, received) of its most loaded rank (NCCL's algorithms). The "
             "MoE's token dispatch (functional collectives) is excluded from both systems.", "",
             machine_line(results.get("machine")), "",
             "| grid (d x ep) | units (ranks) | phase | MatrixFSDP MiB | FSDP2 + EP MiB | ratio "
             "| owner floor |", "|---|---|---|---:|---:|---:|---:|"]
    for g in results["grids"]:
        ours, theirs = (g["systems"][s]["critical"] for s in SYSTEMS)
        fl = g["floor"]
        name = f"{g['d']} x {g['ep']} ({g['ranks']} ranks)"
        for dom, ranks in (("experts", g["d"]), ("dense", g["ranks"])):
            for k in KINDS:
                floor = fl["matrixfsdp"][dom][k] / fl["fsdp2_ep"][dom][k]
                lines.append(f"| {name} | {dom} ({ranks}) | {k} | {mib(ours[dom][k])} "
                             f"| {mib(theirs[dom][k])} | {g['ratio'][f'{dom}_{k}']:.3f}x "
                             f"| {floor:.3f}x |")
        lines.append(f"| {name} | gradient flags | other | {ours['other']} B "
                     f"| {theirs['other']} B | | |")
        lines.append(f"| {name} | all | total | {mib(ours['total'])} | {mib(theirs['total'])} "
                     f"| **{g['ratio']['total']:.3f}x** | {fl['ratio']:.3f}x |")
    lines += ["", "Per phase the passes began in (MiB, ours / FSDP2 + EP), the largest rank's "
              "own sum, and checks.", "",
              "| grid | forward | backward | optimizer.step() | largest rank's own MiB "
              "| collectives in step (ours / FSDP2 + AdamW) | comm_stats = recording "
              "| FSDP2 on the meshes' groups only | as designed |",
              "|---|---|---|---|---|---|---|---|---|"]
    for g in results["grids"]:
        s = g["systems"]
        ph = [s[x]["critical"]["phases"] for x in SYSTEMS]
        cols = " | ".join(f"{mib(ph[0][p])} / {mib(ph[1][p])}" for p in PHASES)
        big = " / ".join(mib(max(s[x]["per_rank_bytes"])) for x in SYSTEMS)
        lines.append(f"| {g['d']} x {g['ep']} | {cols} | {big} "
                     f"| {s['matrixfsdp']['step_calls']} / {s['fsdp2_ep']['step_calls']} "
                     f"| {'yes' if s['matrixfsdp']['comm_stats_agrees'] else 'NO'} "
                     f"| {'yes' if s['fsdp2_ep']['mesh_groups_only'] else 'NO'} "
                     f"| {'yes' if g['as_designed'] else 'NO'} |")
    return "\n".join(lines) + "\n"
