"""The benchmark's results: folding the ranks' records into each system's ``results.json``
entry (:func:`summarise`), the Markdown tables (:func:`render_markdown`), the phases plot
(:func:`plot_phases`), and writing ``results.json``, ``results.md`` and ``phases.png``
(:func:`write_results`)."""

from __future__ import annotations

import json
import math
import os
import statistics
import warnings
from collections.abc import Sequence
from typing import Any

from matrixfsdp.train.machine import machine_line

from .config import BASELINE, EXACT_BOUND, MUON_REFERENCE, PHASES

MIB = 2**20


# ------------------------------------------------------------------ results.json entries


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(name: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: fold the per-rank records of one system into the results entry."""
    failed = [r for r in per_rank if r.get("error")]
    if failed:
        return {"status": "does not run here", "error": failed[0]["error"],
                "failed_ranks": [r["rank"] for r in failed], "traceback": failed[0].get("traceback")}
    out: dict[str, Any] = {"status": "ok", "error": None, "phases": {}, "collectives": {}}
    for ph in (*PHASES, "total"):
        entry = {}
        for kind in ("wall_ms", "cpu_ms"):
            key = f"{ph}_{kind}"
            pooled = [t[key] for r in per_rank for t in r["timed"]]
            entry[kind] = {**_stats(pooled), "per_rank_median":
                           [statistics.median(t[key] for t in r["timed"]) for r in per_rank]}
        out["phases"][ph] = entry
    for ph in PHASES:
        calls = [r["collectives"][ph]["calls"] for r in per_rank]
        # ops: what the launches held (a coalesced launch holds several; else one each)
        op_count = [r["collectives"][ph].get("op_count", r["collectives"][ph]["calls"]) for r in per_rank]
        nbytes = [r["collectives"][ph]["bytes"] for r in per_rank]
        out["collectives"][ph] = {"calls": statistics.mean(calls), "ops": statistics.mean(op_count),
                                  "bytes": statistics.mean(nbytes),
                                  "per_rank": [r["collectives"][ph] for r in per_rank]}
    out["unknown_ops"] = sorted({o for r in per_rank for o in r["unknown_ops"]})
    peak = [r["peak_bytes"] for r in per_rank]
    out["memory"] = {"peak_mib": max(peak) / MIB, "per_rank_peak_mib": [b / MIB for b in peak],
                     "per_rank_state_mib": [r["state_bytes"] / MIB for r in per_rank]}
    if "live_at_start_bytes" in per_rank[0]:
        out["memory"]["per_rank_live_at_start_mib"] = [r["live_at_start_bytes"] / MIB
                                                       for r in per_rank]
        out["memory"]["per_rank_transient_peak_mib"] = [r["transient_peak_bytes"] / MIB
                                                        for r in per_rank]
    if name == "matrixfsdp":
        r0 = per_rank[0]
        step_cpu = out["phases"]["step"]["cpu_ms"]["per_rank_median"]
        ns = [r["ns_owned"]["wall_ms"] for r in per_rank]
        ns_cpu = [r["ns_owned"]["cpu_ms"] for r in per_rank]
        own = r0["comm_stats"]
        prof_ok = all(
            sum(v["calls"] for v in own[ph].values()) == out["collectives"][ph]["ops"]
            and sum(v["payload_bytes"] for v in own[ph].values()) == out["collectives"][ph]["bytes"]
            for ph in PHASES)
        out["matrixfsdp"] = {
            "imbalance": r0["plan"]["imbalance"], "imbalance_bound": r0["plan"]["imbalance_bound"],
            "plan_report": r0["plan"]["report"],
            "step_cpu_ms_per_rank": step_cpu,
            "step_cpu_spread": max(step_cpu) / min(step_cpu) if min(step_cpu) > 0 else math.inf,
            "ns_owned_ms_per_rank": ns,
            "ns_owned_cpu_ms_per_rank": ns_cpu,
            "ns_owned_matrices_per_rank": [r["ns_owned"]["matrices"] for r in per_rank],
            "ns_limit_ms": max(ns),
            "ns_limit_cpu_ms": max(ns_cpu),
            "comm_stats_rank0": own,
            "comm_stats_matches_profiler": prof_ok,
        }
    return out


# ------------------------------------------------------------------ tables and plot


def _fmt_range(st: dict[str, float]) -> str:
    return f"{st['median']:.1f} [{st['min']:.1f}, {st['max']:.1f}]"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a" if not (a == 0 and b == 0) else "—"
    return f"{a / b:.2f}x"


def _coll(res: dict[str, Any], ph: str) -> str:
    c = res["collectives"][ph]
    return f"{c['calls']:g} / {c['bytes'] / MIB:.1f}"


_REPLICATE_OPS = {"c10d::allreduce_": 2, "c10d::reduce_": 1, "c10d::broadcast_": 1}  # ring factor


def replicate_dim_bytes(res: dict[str, Any], replicas: int) -> dict[str, float]:
    """HSDP: the replicate-dim collectives of one system's profiled step, per rank (mean
    over ranks): payload per op kind, and ``wire`` = the bytes a rank sends in a ring (an
    all-reduce of n bytes 2n(R-1)/R, a reduce or broadcast n(R-1)/R)."""
    out = {op: 0.0 for op in _REPLICATE_OPS}
    for ph in PHASES:
        per_rank = res["collectives"][ph]["per_rank"]
        for rec in per_rank:
            for op in _REPLICATE_OPS:
                out[op] += rec["ops"].get(op, {}).get("bytes", 0) / len(per_rank)
    out["wire"] = sum(out[op] * f * (replicas - 1) / replicas for op, f in _REPLICATE_OPS.items())
    return out


class _View:
    """The ok systems of a run and the figures every table reads off them."""

    def __init__(self, results: dict[str, Any]):
        self.cfg, self.systems = results["config"], results["systems"]
        self.ok = {n: s for n, s in self.systems.items() if s["status"] == "ok"}
        self.replicas = self.cfg.get("replicas", 1)
        peers = [self.med(n, "step") for n in ("fsdp2_dist_muon", "fsdp2_muon_fsdp2") if n in self.ok]
        self.best_peer = min(peers) if peers else None

    def med(self, name: str, ph: str) -> float | None:
        return self.ok[name]["phases"][ph]["wall_ms"]["median"] if name in self.ok else None

    def fb(self, name: str) -> float | None:
        return None if name not in self.ok else self.med(name, "forward") + self.med(name, "backward")

    def total_bytes(self, name: str) -> float | None:
        return None if name not in self.ok else sum(self.ok[name]["collectives"][p]["bytes"]
                                                    for p in PHASES)

    def mem(self, name: str) -> float | None:
        return self.ok[name]["memory"]["peak_mib"] if name in self.ok else None


def _header(results: dict[str, Any], v: _View) -> list[str]:
    """The run's settings, the machine it ran on, and how to read the main table."""
    cfg, R = v.cfg, v.replicas
    mp = " with a bf16 MixedPrecisionPolicy (fp32 reduce)" if cfg.get("mp") == "bf16" else ""
    hsdp = f" as HSDP ({R} replicas x {cfg['world_size'] // R})" if R > 1 else ""
    exact_ref = next((s["exactness"]["reference"] for s in v.ok.values() if s.get("exactness")),
                     MUON_REFERENCE)
    return [
        f"MatrixFSDP benchmark: {cfg['world_size']} ranks{hsdp} on {results['device']} "
        f"({cfg['backend']}), GPT {cfg['layers']} layers, d_model {cfg['d_model']}, "
        f"{cfg['heads']} heads, MLP {cfg['mlp']}, seq {cfg['seq']}, batch {cfg['batch']}/rank, "
        f"{cfg['dtype']}{mp}; {cfg['warmup']} warm-up + {cfg['steps']} timed steps "
        f"(+1 profiled); torch {results['torch']}.",
        "",
        machine_line(results.get("machine")),
        "",
        "Times: wall ms, median [min, max] over timed steps x ranks; each phase starts after a "
        "barrier; total includes the barriers between phases. CPU ms: median process CPU time "
        "fwd/bwd/step. Collectives: calls / MiB per rank (mean over ranks), one profiled "
        "step, payload rule in the harness docstring. Peak: MiB, max over ranks. "
        f"max|Δ|: max abs parameter difference vs {exact_ref} (bound {EXACT_BOUND:g}).",
        "",
    ]


def _system_row(name: str, s: dict[str, Any], v: _View) -> str:
    if s["status"] != "ok":
        err = s["error"].splitlines()[0].replace("|", "\\|") if s.get("error") else ""
        return f"| {name} | does not run here: {err[:300]} |" + " |" * 14
    ph = s["phases"]
    cpu = "/".join(f"{ph[p]['cpu_ms']['median']:.0f}" for p in PHASES)
    ex = s.get("exactness")
    exs = "—" if ex is None else f"{ex['max_abs_diff']:.1e} " + ("ok" if ex["ok"] else "**FAIL**")
    return (
        f"| {name} | {_fmt_range(ph['forward']['wall_ms'])} | {_fmt_range(ph['backward']['wall_ms'])} "
        f"| {_fmt_range(ph['step']['wall_ms'])} | {_fmt_range(ph['total']['wall_ms'])} | {cpu} "
        f"| {_coll(s, 'forward')} | {_coll(s, 'backward')} | {_coll(s, 'step')} "
        f"| {s['memory']['peak_mib']:.1f} | {_ratio(v.fb(name), v.fb(BASELINE))} "
        f"| {_ratio(v.total_bytes(name), v.total_bytes(BASELINE))} "
        f"| {_ratio(v.mem(name), v.mem(BASELINE))} "
        f"| {_ratio(v.med(name, 'step'), v.med(MUON_REFERENCE, 'step'))} "
        f"| {_ratio(v.med(name, 'step'), v.best_peer)} | {exs} |")


def _systems_table(v: _View) -> list[str]:
    return [
        "| system | fwd ms | bwd ms | step ms | total ms | CPU ms f/b/s | coll fwd | coll bwd "
        "| coll step | peak MiB | fwd+bwd vs adamw | bytes vs adamw | mem vs adamw "
        "| step vs torch_muon | step vs best(dist_muon, muon_fsdp2) | max abs Δ |",
        "|" + "---|" * 16,
        *(_system_row(name, s, v) for name, s in v.systems.items()),
    ]


def _balance_table(v: _View) -> list[str]:
    m = v.ok.get("matrixfsdp", {}).get("matrixfsdp")
    if not m:
        return []
    step, cpu = v.med("matrixfsdp", "step"), m["step_cpu_ms_per_rank"]
    return [
        "",
        "MatrixFSDP plan balance. NS cost = Newton-Schulz FLOPs per rank. ns_limit = max over "
        "ranks of the median time of bf16 NS alone on the matrices a rank owns (all ranks at "
        "once; wall ms and process CPU ms): the floor of an owner-computes step here. "
        "The CPU-time ratio is the robust one on a shared machine.",
        "",
        "| NS-cost imbalance (max/mean) | best possible | step CPU ms per rank | "
        "step CPU spread (max/min) | ns_limit wall ms | ns_limit CPU ms | step wall ms "
        "| step wall / ns_limit wall | max step CPU / ns_limit CPU | comm_stats = profiler |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {m['imbalance']:.3f} | {m['imbalance_bound']:.3f} "
        f"| {', '.join(f'{c:.0f}' for c in cpu)} | {m['step_cpu_spread']:.2f} "
        f"| {m['ns_limit_ms']:.1f} | {m['ns_limit_cpu_ms']:.1f} | {step:.1f} "
        f"| {_ratio(step, m['ns_limit_ms'])} | {_ratio(max(cpu), m['ns_limit_cpu_ms'])} "
        f"| {'yes' if m['comm_stats_matches_profiler'] else 'NO'} |",
    ]


def _replicate_table(v: _View) -> list[str]:
    R, ok = v.replicas, v.ok
    if R <= 1 or not ok:
        return []
    base = replicate_dim_bytes(ok[BASELINE], R)["wire"] if BASELINE in ok else None
    lines = [
        "",
        "Across the replicate dim (HSDP), MiB per rank per step, one profiled step: payload "
        "per collective kind, and bytes each rank sends in a ring (all-reduce 2n(R-1)/R, "
        "reduce and broadcast n(R-1)/R). The first table counts payloads, where a reduce plus "
        "a broadcast count a matrix twice and an all-reduce once though both send the same: "
        "compare bytes sent here. NS matrices per rank: MatrixFSDP steps each "
        "matrix on its owner world rank only; FSDP2 + torch Muon runs every matrix's NS on "
        "every rank.",
        "",
        "| system | all_reduce | reduce | broadcast | sent (ring) | sent vs fsdp2_adamw "
        "| NS matrices per rank |",
        "|---|---|---|---|---|---|---|",
    ]
    owned = ok["matrixfsdp"]["matrixfsdp"]["ns_owned_matrices_per_rank"] if "matrixfsdp" in ok else None
    for name, s in ok.items():
        b = replicate_dim_bytes(s, R)
        ns = "—"
        if name == "matrixfsdp":
            ns = ", ".join(str(k) for k in owned)
        elif name == MUON_REFERENCE and owned is not None:
            ns = f"{sum(owned)} (all)"
        lines.append(
            f"| {name} | {b['c10d::allreduce_'] / MIB:.2f} | {b['c10d::reduce_'] / MIB:.2f} "
            f"| {b['c10d::broadcast_'] / MIB:.2f} | {b['wire'] / MIB:.2f} "
            f"| {_ratio(b['wire'], base)} | {ns} |")
    return lines


# ---- critical path (the most loaded rank of each collective) -------------------------------
# profiler op -> the factor of its payload a ring moves through every rank: all-gather and
# reduce-scatter (P-1)/P, all-reduce 2(P-1)/P (FSDP2's collectives are all of these kinds)
_RING_OPS = {"c10d::_allgather_base_": 1, "c10d::allgather_into_tensor_coalesced_": 1,
             "c10d::_reduce_scatter_base_": 1, "c10d::reduce_scatter_tensor_coalesced_": 1,
             "c10d::allreduce_": 2,
             # grouped_gloo's own count (bench --backend grouped_gloo): its even calls
             "all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


def critical_path(res: dict[str, Any], name: str, P: int) -> dict[str, float] | None:
    """Bytes on the critical path of forward+backward (each collective charged to its most
    loaded rank, summed) and the mean rank's, per step. MatrixFSDP: its own counters
    (NCCL's ring and pipelined models, :mod:`matrixfsdp.runtime.collectives`); FSDP2: its all-gathers,
    reduce-scatters and all-reduces by the ring rule (every rank moves the same, so the
    most loaded rank is the mean). Other systems: None (their all-to-alls, gathers and
    scatters are charged as sent, which the profiler's payloads do not tell per rank)."""
    phases = ("forward", "backward")
    if name == "matrixfsdp":
        own = res["matrixfsdp"]["comm_stats_rank0"]
        crit = sum(c["critical_bytes"] for ph in phases for c in own[ph].values())
        mean = sum(c["mean_bytes"] for ph in phases for c in own[ph].values())
        return {"critical": crit, "mean": mean}
    if not name.startswith("fsdp2"):
        return None
    total = 0.0
    for ph in phases:
        ops = res["collectives"][ph]["per_rank"][0].get("ops", {})
        if any(op not in _RING_OPS for op in ops):
            return None
        total += sum(rec["bytes"] * _RING_OPS[op] * (P - 1) / P for op, rec in ops.items())
    return {"critical": total, "mean": total}


def _critical_table(v: _View) -> list[str]:
    """1-D meshes only: under HSDP the collectives run on sub-groups of other sizes than the
    world's, which the ring rule here does not know; the replicate-dim table compares them."""
    if v.replicas > 1:
        return []
    P = v.cfg["world_size"]
    rows = {n: critical_path(s, n, P) for n, s in v.ok.items()}
    rows = {n: r for n, r in rows.items() if r is not None}
    if "matrixfsdp" not in rows or BASELINE not in rows:
        return []
    base = rows[BASELINE]["critical"]
    lines = ["", "Forward+backward bytes per step on the critical path (each collective "
             "charged to its most loaded rank, NCCL's algorithms), MiB, against "
             f"{BASELINE}. The mean is FSDP2's bytes; the busiest rank at most P/(P-1) = "
             f"{P / (P - 1):.3f} of FSDP2's critical path (docs/design.md, the owner floor):", "",
             "| system | critical path MiB | mean rank MiB | critical vs " + BASELINE + " |",
             "|---|---:|---:|---:|"]
    for n, r in rows.items():
        lines.append(f"| {n} | {r['critical'] / MIB:.2f} | {r['mean'] / MIB:.2f} | "
                     f"{_ratio(r['critical'], base)} |")
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    """The tables (and the run's settings and machine) as Markdown: every system, then
    MatrixFSDP's plan balance, then (HSDP) the replicate-dim bytes, then any exactness
    failure."""
    v = _View(results)
    lines = [*_header(results, v), *_systems_table(v), *_critical_table(v), *_balance_table(v),
             *_replicate_table(v)]
    failed = [n for n, s in v.ok.items() if s.get("exactness") and not s["exactness"]["ok"]]
    if failed:
        lines += ["", f"**Exactness check failed** (max abs diff > {EXACT_BOUND:g}): "
                  + ", ".join(failed)]
    return "\n".join(lines) + "\n"


def plot_phases(results: dict[str, Any], path: str) -> bool:
    """Stacked bars of the forward/backward/step median wall ms; False if no matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: phases.png skipped", stacklevel=2)
        return False
    ok = {n: s for n, s in results["systems"].items() if s["status"] == "ok"}
    fig, ax = plt.subplots(figsize=(1.6 * max(len(ok), 2) + 2, 4.5))
    bottom = [0.0] * len(ok)
    for ph, color in zip(PHASES, ("#4C72B0", "#DD8452", "#55A868")):
        vals = [s["phases"][ph]["wall_ms"]["median"] for s in ok.values()]
        ax.bar(list(ok), vals, bottom=bottom, label=ph, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    cfg = results["config"]
    ax.set_ylabel("median wall time per step (ms)")
    ax.set_title(f"{cfg['world_size']} ranks, {results['device']}, GPT {cfg['layers']}x"
                 f"{cfg['d_model']}, batch {cfg['batch']}x{cfg['seq']}/rank")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_results(results: dict[str, Any], out: str) -> str:
    """Write ``results.json``, ``results.md`` and ``phases.png`` (if matplotlib is there)
    into directory ``out``; returns the Markdown."""
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    md = render_markdown(results)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md)
    plot_phases(results, os.path.join(out, "phases.png"))
    return md
