"""``matrixfsdp plan``'s output: the advised layout next to FSDP2 + ``torch.optim.Muon`` and
DistMuon, the step-time breakdown, the layouts searched, the assumptions (text or JSON)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .links import Links
from .report import fmt_bytes, format_report
from .search import Evaluated, Search
from .steptime import Workload
from .traffic import Dtypes

_DTYPE = {2: "bf16", 4: "fp32"}


@dataclass
class Setting:
    """What a search assumed, for the output."""

    links: Links
    workload: Workload
    dtypes: Dtypes
    device_memory: float


def assumptions(st: Setting, s: Search) -> list[str]:
    w, d = st.workload, st.dtypes
    return [
        f"cluster: {st.links.describe()}; ranks numbered (pp, replicate, shard, tp), tp "
        "innermost, tp within a node",
        "collectives: NCCL's ring all-gather / reduce-scatter, ring or tree all-reduce "
        "(the faster), an uneven all-gather / reduce-scatter as one launch (one ring fill, "
        "then its most loaded rank's bytes), all-to-all through the busiest rank's own NIC; "
        "a group across nodes with k ranks per node moves min(k x InfiniBand, NVLink) per "
        "GPU; MatrixFSDP on NCCL: one call per unit and direction over the shard group, "
        "the tp hop, each rank's own replicate-dim calls; every rank has its own queue per "
        "link (issue order, beside compute), the step is its slowest rank's",
        f"workload: {s.global_batch} sequences of {w.seq} tokens per step, micro-batches of "
        f"{w.micro_batch} sequence(s) per data-parallel rank, so every layout trains the same "
        "tokens; without pipeline stages each micro-batch gathers and reduces (the runtime's "
        "default); with stages 1F1B, stages gathered once and reduced once per step",
        f"compute: {w.tflops / 1e12:g} TFLOP/s reached by every matmul and by Newton-Schulz "
        "(bf16); forward 2 x matrix elements + causal attention 2 x seq x d_model per token "
        "and block, + the head; backward 2x forward; activation checkpointing recomputes the "
        "blocks' forward; tensor parallelism: 2 activation all-reduces per block pass "
        f"(blocking); optimizer element-wise updates at {w.hbm / 1e9:g} GB/s",
        "overlap as the runtime does it: one unit prefetched ahead in forward and backward, "
        "reduces asynchronous, HSDP's replicate reduce after each shard reduce and its "
        "broadcasts at the next forward (a unit's prefetch waits for its own)",
        f"memory per rank: the planner's owners (stored {_DTYPE.get(d.storage, d.storage)}: "
        "segments with padding and alignment, the gradient buffers .grad keeps, Muon "
        "momentum and AdamW moments, exactly as tests/test_plan_model.py checks on 8 ranks) + "
        f"gather buffers ({_DTYPE.get(d.gather)}: the root, the unit computing, the next, "
        f"its unsharded gradients) and two reduce buffers ({_DTYPE.get(d.reduce)}) + "
        "activations (bf16: each block matrix's input and output per token, or the block "
        "inputs with checkpointing; logits in bf16 and fp32; divided by tp); pipeline "
        "stages keep their units gathered and their gradients unreduced over the step",
        "baselines at the same layout and links: FSDP2's padded all-gather / reduce-scatter "
        "(HSDP: an all-reduce per unit); FSDP2 + torch.optim.Muon runs each matrix's NS on "
        "its DTensor, every matmul split over a replica's ranks with an all-gather of its "
        "operand (X twice, X X^T once per iteration, bf16), one matrix after the other; "
        "DistMuon as torchtitan runs it: one bucket per block through two buffer slots, "
        "each matrix gathered to an owner (longest processing time over a replica's ranks, "
        "repeated on every replica), NS, scattered back; it refuses tp-split matrices, so "
        "it has no time at tp > 1",
    ]


def _gib(n: float) -> str:
    return fmt_bytes(n)


def _s(x: float | None) -> str:
    """Seconds: two decimals, or three significant digits below one; "n/a" where the system
    cannot run."""
    if x is None:
        return "n/a"
    return f"{x:.2f}" if x >= 1 or x == 0 else f"{x:.3g}"


def _dm(e: Evaluated) -> float | None:
    return e.distmuon.total if e.distmuon else None


def _layout_row(e: Evaluated) -> str:
    r = e.record()
    rep = r["replicate_bytes_vs_fsdp2_hsdp"]
    return (f"| {e.layout.replicate} | {e.layout.shard} | {e.layout.tp} | {e.layout.pp} | "
            f"{'on' if e.layout.checkpointing else 'off'} | {e.micro_batches} | "
            f"{_gib(e.largest_rank_bytes)}{'' if e.fits else ' **no**'} | "
            f"{r['model_state_max_over_mean']:.2f} | {e.bytes_ratio:.3f} | {e.owner_floor:.3f} | "
            f"{'' if rep is None else f'{rep:.2f}'} | {r['ns_vs_bound']:.3f} | "
            f"**{_s(e.step.total)}** | {_s(e.fsdp2.total)} | {_s(_dm(e))} |")


LAYOUT_HEAD = [
    "| replicate | shard | tp | pp | AC | micro-batches | largest rank | state max/mean | "
    "bytes vs FSDP2 | owner floor | replicate vs FSDP2 HSDP | NS / bound | step s | "
    "FSDP2 + Muon s | DistMuon s |",
    "|" + "---:|" * 4 + "---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def _breakdown(e: Evaluated) -> list[str]:
    rows = [("compute (forward, backward, recompute)", "compute"),
            ("tensor-parallel all-reduces", "tp_comm"),
            ("data-parallel collectives not hidden", "exposed_comm"),
            ("pipeline bubble", "bubble"), ("pipeline sends", "p2p"),
            ("Newton-Schulz", "ns"), ("rest of the optimizer step", "optimizer_other"),
            ("**step**", "total")]
    out = ["| seconds per step | MatrixFSDP | FSDP2 + torch.optim.Muon | DistMuon |",
           "|---|---:|---:|---:|"]
    for label, key in rows:
        vals = [getattr(x, key) if x else None for x in (e.step, e.fsdp2, e.distmuon)]
        out.append(f"| {label} | " + " | ".join(_s(v) for v in vals) + " |")
    return out


def _best(layouts: Sequence[Evaluated], fits: Callable[[Evaluated], bool],
          secs: Callable[[Evaluated], float]) -> Evaluated | None:
    pool = [e for e in layouts if fits(e)]
    return min(pool, key=secs) if pool else None


def peers_best(s: Search, dm: float) -> dict[str, Evaluated | None]:
    """Each system's fastest layout that it can run and that fits its own memory."""
    return {"matrixfsdp": s.recommended if s.recommended and s.recommended.fits else None,
            "fsdp2_torch_muon": _best(s.layouts, lambda e: e.fsdp2_memory <= dm,
                                      lambda e: e.fsdp2.total),
            "distmuon": _best(s.layouts, lambda e: e.distmuon_feasible
                              and e.distmuon_memory <= dm, lambda e: e.distmuon.total)}


def _per_system(s: Search, dm: float) -> list[str]:
    best = peers_best(s, dm)
    ours, f2, dist = best["matrixfsdp"], best["fsdp2_torch_muon"], best["distmuon"]
    few = min(s.fitting, key=lambda e: (e.bytes_ratio, e.step.total)) if s.fitting else None

    def say(name: str, e: Evaluated | None, secs: float | None) -> str:
        if e is None:
            return f"* {name}: no layout it can run fits"
        return f"* {name}: {_s(secs)} s at {e.layout.label()}"
    return ["Fastest fitting layout per system (each with its own memory):",
            say("MatrixFSDP", ours, ours.step.total if ours else None),
            say("FSDP2 + torch.optim.Muon", f2, f2.fsdp2.total if f2 else None),
            say("DistMuon", dist, dist.distmuon.total if dist else None),
            (f"* fewest bytes among MatrixFSDP's fitting layouts: {few.layout.label()}, "
             f"{few.bytes_ratio:.3f}x FSDP2's, {_s(few.step.total)} s" if few else "")]


def format_search(name: str, n_params: int, blocks: int, s: Search, st: Setting,
                  top: int = 12, max_rows: int = 16) -> str:
    """The full text for one model and world size."""
    dm = st.device_memory
    head = [f"{name}: {n_params / 1e9:.2f}B parameters, {blocks} blocks, {s.world_size} ranks: "
            f"{len(s.layouts)} layouts searched in {s.seconds:.2f} s, {len(s.fitting)} fit in "
            f"{_gib(dm)}", ""]
    e = s.recommended
    if e is None:
        return "\n".join(head + ["No layout of this world size could be planned."])
    what = "Advice" if e.fits else "No layout fits; the smallest"
    S = e.layout.shard
    head += [
        f"{what}: **replicate {e.layout.replicate} x shard {S} x tp {e.layout.tp} x pp "
        f"{e.layout.pp}**, activation checkpointing {'on' if e.layout.checkpointing else 'off'}, "
        f"{e.micro_batches} micro-batch(es) per step",
        f"* modelled step {_s(e.step.total)} s against FSDP2 + torch.optim.Muon "
        f"{_s(e.fsdp2.total)} s and DistMuon {_s(_dm(e))} s at the same layout"
        + ("" if e.distmuon else " (torchtitan's DistMuon refuses tp-split matrices)"),
        f"* {e.launches} data-parallel process-group calls per step on a rank (FSDP2: "
        f"{e.fsdp2_launches})",
        f"* largest rank {_gib(e.largest_rank_bytes)} of {_gib(dm)}: model state "
        f"{_gib(e.state_max)} (max/mean {e.state_max / e.state_mean:.2f}) + buffers "
        f"{_gib(e.buffers)} + activations {_gib(e.activations)}",
        f"* bytes per step on the critical path {e.bytes_ratio:.3f}x FSDP2's at this layout; "
        f"the owner floor here {e.owner_floor:.3f}x (1-D floor P/(P-1) at {S} shard ranks: "
        f"{S / (S - 1) if S > 1 else 1:.3f})",
        f"* Newton-Schulz {e.ns_max / e.ns_bound if e.ns_bound else 1:.3f}x its bound", "",
        *_breakdown(e), "", *_per_system(s, dm), "",
        f"Layouts (the {top} fastest that fit, then the {min(top, 4)} smallest that do not):", "",
        *LAYOUT_HEAD]
    fast = sorted(s.fitting, key=lambda x: x.step.total)[:top]
    big = sorted((x for x in s.layouts if not x.fits), key=lambda x: x.largest_rank_bytes)
    rows = [_layout_row(x) for x in fast + big[:min(top, 4)]]
    text = head + rows + ["", "Assumptions:", *[f"* {a}" for a in assumptions(st, s)]]
    if e.plan is not None:
        text += ["", f"The advised layout's plan (pipeline stage 0 over its {e.plan.world_size} "
                 "data-parallel ranks):", "", format_report(e.plan, max_rows=max_rows)]
    return "\n".join(text)


def search_json(name: str, n_params: int, s: Search, st: Setting) -> dict:
    """The ``--json`` object for one model and world size."""
    return {"model": name, "parameters": n_params, "world_size": s.world_size,
            "global_batch": s.global_batch, "search_seconds": s.seconds,
            "layouts_searched": len(s.layouts), "layouts_fitting": len(s.fitting),
            "assumptions": assumptions(st, s),
            "recommended": s.recommended.record() if s.recommended else None,
            "best_per_system": {k: e.record() if e else None
                                for k, e in peers_best(s, st.device_memory).items()},
            "layouts": [e.record() for e in s.layouts]}


SUMMARY_HEAD = [
    "| model | ranks | advice (replicate x shard x tp x pp, AC) | fits | largest rank | step s | "
    "FSDP2 + Muon s | DistMuon s | bytes vs FSDP2 | owner floor | layouts (fit) | search s |",
    "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def summary_row(name: str, s: Search) -> str:
    e = s.recommended
    if e is None:
        return f"| {name} | {s.world_size} | none |" + " |" * 9
    return (f"| {name} | {s.world_size} | {e.layout.label()} | {'yes' if e.fits else '**no**'} | "
            f"{_gib(e.largest_rank_bytes)} | {_s(e.step.total)} | {_s(e.fsdp2.total)} | "
            f"{_s(_dm(e))} | {e.bytes_ratio:.3f} | {e.owner_floor:.3f} | "
            f"{len(s.layouts)} ({len(s.fitting)}) | {s.seconds:.1f} |")
