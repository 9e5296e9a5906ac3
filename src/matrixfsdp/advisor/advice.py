"""``matrixfsdp plan``'s output: the advised layout next to FSDP2 + ``torch.optim.Muon`` and
DistMuon, the step-time breakdown, the layouts searched, the assumptions (text or JSON)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..costs.links import Links
from ..costs.steptime import BOUNDS, StepTime, Workload
from ..layout.report import fmt_bytes, format_report
from ..layout.traffic import Dtypes
from .evaluated import SYSTEMS, Evaluated, keep_text
from .search import RateRow, Search, best_of

_DTYPE = {2: "bf16", 4: "fp32"}
_SHORT = {"1F1B": "1F1B", "interleaved 1F1B": "I1F1B", "interleaved zero bubble": "ZB"}


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
        "collectives: the ops each system issues, each charged its own latency at its "
        "group's size (ring all-gather / reduce-scatter and pipelined broadcast / reduce: "
        "P-1 hops; all-reduce: ring or tree, the faster; all-to-all through the busiest "
        "rank's own NIC) plus its most loaded rank's bytes, and each launch its base latency; "
        f"groups {'coalesce' if st.links.coalesces else 'do not coalesce'} ops into one "
        "launch; MatrixFSDP per unit and direction: one even all-gather / reduce-scatter and "
        "one broadcast / reduce per holder over the shard group, the tp hop's all-to-all, "
        "each rank's own replicate-dim ops; a group across nodes with k ranks per node moves "
        "min(k x InfiniBand, NVLink) per GPU; every rank has its own queue per link (issue "
        "order, beside compute), the step is its slowest rank's",
        f"workload: {s.global_batch} sequences of {w.seq} tokens per step "
        f"({s.global_batch * w.seq / 2**20:g}Mi tokens), micro-batches of {w.micro_batch} "
        "sequence(s) per data-parallel rank (a layout whose data-parallel ranks cannot split "
        "the batch into whole micro-batches is skipped), so every layout trains the same "
        "tokens; without pipeline stages each micro-batch gathers and reduces (the runtime's "
        "default); with stages torch's 1F1B, interleaved 1F1B or interleaved zero-bubble "
        "schedule (2 stages per rank), stages gathered once and reduced once per step",
        f"compute: {w.tflops / 1e12:g} TFLOP/s reached by the model's matmuls, "
        f"{w.ns_rate / 1e12:g} TFLOP/s by Newton-Schulz (bf16); forward 2 x matrix elements "
        "+ causal attention 2 x seq x d_model per token and block, + the head; backward 2x "
        "forward; activation checkpointing recomputes the blocks' forward; tensor "
        "parallelism: 2 activation all-reduces per block pass (blocking); optimizer "
        f"element-wise updates at {(w.adamw_hbm or w.hbm) / 1e9:g} GB/s (AdamW) and "
        f"{(w.muon_hbm or w.hbm) / 1e9:g} GB/s (Muon); the compute floor: the step's model "
        "FLOPs (3x forward) over every rank at the matmul rate",
        "overlap as the runtime does it: one unit prefetched ahead in forward and backward, "
        "reduces asynchronous, HSDP's replicate reduce after each shard reduce and its "
        "broadcasts at the next forward (a unit's prefetch waits for its own)",
        f"memory per rank: the planner's owners (stored {_DTYPE.get(d.storage, d.storage)}: "
        "segments with padding and alignment, the gradient buffers .grad keeps, Muon "
        "momentum and AdamW moments, exactly as tests/advisor/test_plan_model.py checks on 8 ranks) + "
        f"gather buffers ({_DTYPE.get(d.gather)}: the root, the unit computing, the next, "
        f"its unsharded gradients) and two reduce buffers ({_DTYPE.get(d.reduce)}) + "
        "activations (bf16: each block matrix's input and output per token, or the block "
        "inputs with checkpointing; logits in bf16 and fp32; divided by tp); pipeline "
        "stages keep their units gathered and their gradients unreduced over the step",
        "baselines at the same layout and links: FSDP2's padded all-gather / reduce-scatter "
        "(HSDP: an all-reduce per unit); FSDP2 + torch.optim.Muon runs each matrix's NS on "
        "its DTensor as torch 2.13 does, one matrix after the other (wide: all-gathers of "
        "X^T, X X^T and X per iteration; tall: two all-reduces of the Gram per iteration and "
        "its cube on every rank; under tp colwise wide matrices gathered whole and NS run "
        "whole on every rank); DistMuon as torchtitan runs it: buckets of 1, 2, 4, ... "
        "blocks (the fastest searched) through two buffer slots (counted in its memory), "
        "each matrix gathered to an owner (longest processing time over a replica's ranks, "
        "repeated on every replica), NS, scattered back; it refuses tp > 1 and pp > 1 "
        "(torchtitan raises for both), so it has no time there",
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


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _layout_row(e: Evaluated) -> str:
    r = e.record()
    rep = r["replicate_bytes_vs_fsdp2_hsdp"]
    pp = f"{e.layout.pp} ({_SHORT[e.layout.schedule.name]})" if e.layout.pp > 1 else "1"
    k = sum(e.checkpointed)
    ac = "off" if not k else "on" if k == e.blocks else f"{k}/{e.blocks}"
    tp = ", ".join(f"{n} {kind}" for kind, n in sorted(e.tp_placements.items())) or ""
    return (f"| {e.layout.replicate} | {e.layout.shard} | {e.layout.tp} | {pp} | "
            f"{ac} | {e.keep} | {e.micro_batches} | {tp} | "
            f"{_gib(e.largest_rank_bytes)}{'' if e.fits else ' **no**'} | "
            f"{r['model_state_max_over_mean']:.2f} | {e.bytes_ratio:.3f} | {e.owner_floor:.3f} | "
            f"{'' if rep is None else f'{rep:.2f}'} | {r['ns_vs_bound']:.3f} | "
            f"**{_s(e.step.total)}** | {e.step.total / e.floor:.3f}x | {_pct(e.mfu())} | "
            f"{e.step.bound} | {_s(e.fsdp2.total)} | {_s(_dm(e))} |")


LAYOUT_HEAD = [
    "| replicate | shard | tp | pp | AC blocks | kept gathered | micro-batches | tp placements | "
    "largest rank | state max/mean | bytes vs FSDP2 | owner floor | replicate vs FSDP2 HSDP | "
    "NS / bound | step s | vs floor | MFU | bound | FSDP2 + Muon s | DistMuon s |",
    "|" + "---:|" * 4 + "---|---|---:|---|" + "---:|" * 9 + "---|---:|---:|",
]


def _breakdown(e: Evaluated) -> list[str]:
    rows = [("compute (forward, backward, recompute)", "compute"),
            ("of it recompute (checkpointed blocks)", "recompute"),
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
    out.append("| blocks checkpointed | " + " | ".join(
        f"{sum(e.checkpointed_of(k))}/{e.blocks}" if e.step_of(k) else "n/a" for k in SYSTEMS)
        + " |")
    for kind in BOUNDS:
        vals = [x.path.get(kind, 0.0) if x else None for x in (e.step, e.fsdp2, e.distmuon)]
        out.append(f"| critical path: {kind} | " + " | ".join(_s(v) for v in vals) + " |")
    out.append("| **bound by** (the critical path's largest) | " + " | ".join(
        x.bound if x else "n/a" for x in (e.step, e.fsdp2, e.distmuon)) + " |")
    return out


SYSTEM_LABELS = (("matrixfsdp", "MatrixFSDP"), ("fsdp2_torch_muon", "FSDP2 + torch.optim.Muon"),
           ("distmuon", "DistMuon"))


def step_of(e: Evaluated, system: str) -> StepTime | None:
    return e.step_of(system)


def _optimizer_term(e: Evaluated, system: str) -> str:
    if system == "matrixfsdp":
        name, (r, c), flops = e.busiest_matrix
        alone = ", one matrix: it cannot shrink" if flops >= 0.99 * e.ns_max else ""
        return f"the busiest owner's NS ({name} {r}x{c}{alone})"
    if system == "fsdp2_torch_muon":
        return "torch Muon's NS on DTensor"
    return f"DistMuon's bucket pipeline ({e.distmuon_blocks} block(s) per bucket)"


@dataclass
class Explained:
    """What bounds one system's step at one layout: the largest kind on the simulation's
    critical path (:data:`~matrixfsdp.costs.steptime.BOUNDS`), the largest of what it
    spends above the compute floor, and the step over the floor."""

    step: float
    bound: str
    overhead: str
    overhead_s: float
    over_floor: float


def explain(e: Evaluated, system: str, floor: float) -> Explained | None:
    """:class:`Explained` for ``system`` (``matrixfsdp``, ``fsdp2_torch_muon``,
    ``distmuon``) at layout ``e``; None where it cannot run."""
    st = step_of(e, system)
    if st is None:
        return None
    opt = _optimizer_term(e, system)  # its Newton-Schulz alone: the label says NS
    rest = "the rest of the optimizer step"
    above = {"recompute": st.recompute,
             "compute above the floor": st.compute - st.recompute - floor,
             "tensor-parallel all-reduces": st.tp_comm,
             "exposed data-parallel communication": st.exposed_comm,
             "pipeline bubble": st.bubble, "pipeline sends": st.p2p,
             opt: st.ns, rest: st.optimizer_other}
    worst = max(above, key=above.get)
    return Explained(st.total, st.bound, worst, above[worst],
                     st.total / floor if floor else 0.0)


BOUND_HEAD = ["| system | its best fitting layout | step s | vs compute floor | MFU | bound by "
              "(critical path) | largest term above the floor | its optimizer step |",
              "|---|---|---:|---:|---:|---|---|---|"]


def bound_rows(s: Search, dm: float) -> list[str]:
    """Per system its best fitting layout, the step, how far above the compute floor, its
    MFU, the kind that bounds it on its critical path and the largest term above the
    floor."""
    out = []
    for key, label in SYSTEM_LABELS:
        e = peers_best(s, dm)[key]
        x = explain(e, key, s.floor) if e is not None else None
        if x is None:
            out.append(f"| {label} | no layout it runs fits | | | | | | |")
            continue
        extra = f", {e.distmuon_blocks} block(s) per bucket" if key == "distmuon" else ""
        st = step_of(e, key)
        out.append(f"| {label} | {e.label(key)}{extra} | {_s(x.step)} | "
                   f"{x.over_floor:.3f}x ({100 * (x.over_floor - 1):+.1f}%) | "
                   f"{_pct(e.mfu(key))} | {x.bound} | "
                   f"{x.overhead} {_s(x.overhead_s)} s | {_s(st.ns + st.optimizer_other)} s: "
                   f"{_optimizer_term(e, key)} {_s(st.ns)} s, the rest {_s(st.optimizer_other)} s |")
    return out


def peers_best(s: Search, dm: float) -> dict[str, Evaluated | None]:
    """Each system's fastest layout that it can run and that fits its own memory."""
    return {k: best_of(s, k, dm) for k in SYSTEMS}


def _fewest_bytes(s: Search) -> list[str]:
    few = min(s.fitting, key=lambda e: (e.bytes_ratio, e.step.total)) if s.fitting else None
    if few is None:
        return []
    return [f"Fewest bytes among MatrixFSDP's fitting layouts: {few.layout.label()}, "
            f"{few.bytes_ratio:.3f}x FSDP2's, {_s(few.step.total)} s.", ""]


def _runtime_lines(e: Evaluated, s: Search) -> list[str]:
    """What the runtime must be told to run the advice as the model charges it."""
    out = []
    k = sum(e.checkpointed)
    if k:
        per = e.checkpointed
        where = (f"blocks 0..{k - 1}" if len(per) == 1 else
                 "in each pipeline stage its first " + ", ".join(str(n) for n in per) + " blocks")
        out.append(f"* activation checkpointing: {k} of {e.blocks} blocks, the fewest that fit "
                   f"({where}: wrap those blocks in torch's checkpoint before `fully_shard`); "
                   f"recompute {_s(e.step.recompute)} s per step")
    else:
        out.append(f"* activation checkpointing: none of the {e.blocks} blocks (it fits "
                   "without)")
    m = e.micro_batches
    if e.keep != "each" and m == 1:  # "edges": the first and last blocks not gathered again
        out.append("* the first and last blocks kept gathered from their forward to their "
                   "backward (not gathered again in backward): tell the runtime "
                   "`model.layers[0].set_reshard_after_forward(False)` and "
                   "`model.layers[-1].set_reshard_after_forward(False)`")
    elif e.keep != "each":
        edges = e.keep == "edges"
        told = ["`model.set_reshard_after_backward(False, recurse=False)`"]
        if edges:
            told += ["`model.layers[0].set_reshard_after_forward(False)` and "
                     "`.set_reshard_after_backward(False)`",
                     "`model.layers[-1].set_reshard_after_forward(False)`"]
        out.append(f"* the root (embedding, head, norms){' and the first block' if edges else ''}"
                   f" gathered once per step of {m} micro-batches and reduced once"
                   + ("; the last block kept gathered from its forward to its backward"
                      if edges else "")
                   + f": tell the runtime {', '.join(told)}, and "
                   "`set_requires_gradient_sync(False, recurse=False)` on "
                   + ("the root and the first block" if edges else "the root")
                   + " before every micro-batch but the last (True before the last): their "
                   "gradients accumulate unreduced in the reduce dtype (counted in the buffers)")
    elif e.layout.pp == 1:
        out.append("* every unit gathered and reduced each micro-batch (the runtime's "
                   "default): keeping the root or the edge blocks gathered does not fit or "
                   "does not pay")
    if e.layout.tp > 1:
        names: dict[str, list[str]] = {}
        for name, kind in sorted(e.tp_by_name.items()):
            names.setdefault(kind, []).append(name.rsplit(".weight", 1)[0].split(".")[-1])
        where = {"group": "owned by their tp group (each tp rank its slice; NS over the group)",
                 "rank": "whole on one tp rank (slices hop to it)"}
        parts = [f"{e.tp_placements.get(kind, 0)} {where[kind]} ({', '.join(names.get(kind, []))})"
                 for kind in ("group", "rank") if e.tp_placements.get(kind)]
        kinds = [k for k in ("group", "rank") if e.tp_placements.get(k)]
        if s.tp_ownership != "auto":
            agree = f"`fully_shard(..., tp_ownership=\"{s.tp_ownership}\")` places them so"
        elif e.runtime_default_agrees:
            agree = "`fully_shard(..., tp_ownership=\"auto\")` (its default) places them alike"
        elif len(kinds) == 1:
            agree = (f"`fully_shard`'s own auto weighs one micro-batch and would place some "
                     f"otherwise: pass `tp_ownership=\"{kinds[0]}\"`")
        else:
            agree = ("`fully_shard`'s own auto weighs one micro-batch and would place some "
                     "otherwise, and it takes no rates: the runtime cannot place them so")
        out.append(f"* tensor parallelism, tp_ownership=\"{s.tp_ownership}\": the tp-split "
                   f"matrices {'; '.join(parts)}; {agree}")
    return out


def sensitivity_lines(rows: Sequence[RateRow], peak: float) -> list[str]:
    """The kernel-rate sensitivity table: each system's best layout at each rate."""
    if not rows:
        return []
    out = [f"Kernel-rate sensitivity (every matmul and Newton-Schulz at the rate; each system's "
           f"best layout above, planned again; MFU against {peak / 1e12:g} TFLOP/s):", "",
           "| TFLOP/s | compute floor s | MatrixFSDP s (vs floor, MFU, bound) | FSDP2 + "
           "torch.optim.Muon s | DistMuon s | ours / FSDP2 + Muon | ours / DistMuon |",
           "|---:|---:|---|---|---|---:|---:|"]
    for r in rows:
        cells, steps = [], {}
        for k in SYSTEMS:
            e = r.systems.get(k)
            st = e.step_of(k) if e is not None else None
            if st is None:
                cells.append("n/a")
                continue
            steps[k] = st.total
            cells.append(f"{_s(st.total)} ({st.total / r.floor:.3f}x, "
                         f"{_pct(r.floor * r.tflops / (st.total * peak))}, {st.bound})")
        ours = steps.get("matrixfsdp")
        ratio = [f"{ours / steps[k]:.3f}" if ours and k in steps else "n/a"
                 for k in SYSTEMS[1:]]
        out.append(f"| {r.tflops / 1e12:g} | {_s(r.floor)} | " + " | ".join(cells) + " | "
                   + " | ".join(ratio) + " |")
    return out + [""]


def format_search(name: str, n_params: int, blocks: int, s: Search, st: Setting,
                  top: int = 12, max_rows: int = 16, rates: Sequence[RateRow] = ()) -> str:
    """The full text for one model and world size."""
    dm = st.device_memory
    head = [f"{name}: {n_params / 1e9:.2f}B parameters, {blocks} blocks, {s.world_size} ranks: "
            f"{len(s.layouts)} layouts searched in {s.seconds:.2f} s, {len(s.fitting)} fit in "
            f"{_gib(dm)}", ""]
    e = s.recommended
    if e is None:
        return "\n".join(head + [
            f"No layout of this world size could be planned: {s.global_batch} sequences per "
            f"step do not split into whole micro-batches of {st.workload.micro_batch} "
            "sequence(s) over the data-parallel sizes searched (every data-parallel rank "
            "needs at least one); raise --global-batch / --global-tokens, or allow more tp "
            "and pp."])
    what = "Advice" if e.fits else "No layout fits; the smallest"
    S = e.layout.shard
    x = explain(e, "matrixfsdp", s.floor)
    sched = f" ({e.layout.schedule.name})" if e.layout.pp > 1 else ""
    k = sum(e.checkpointed)
    path = e.step.path
    head += [
        f"{what}: **replicate {e.layout.replicate} x shard {S} x tp {e.layout.tp} x pp "
        f"{e.layout.pp}{sched}**, activation checkpointing {k} of {e.blocks} blocks, "
        f"{keep_text(e.keep, e.micro_batches)}, {e.micro_batches} micro-batch(es) per step of "
        f"{s.global_batch} sequences",
        f"* modelled step {_s(e.step.total)} s, {x.over_floor:.3f}x the compute floor "
        f"({_s(s.floor)} s), MFU {_pct(e.mfu())} of the GPU's dense bf16 peak "
        f"({s.peak / 1e12:g} TFLOP/s); bound by {x.bound} (its critical path: "
        + ", ".join(f"{kind} {_s(path.get(kind, 0.0))} s" for kind in BOUNDS
                    if path.get(kind)) + f"); largest above the floor: {x.overhead} "
        f"{_s(x.overhead_s)} s",
        f"* at the same layout FSDP2 + torch.optim.Muon {_s(e.fsdp2.total)} s, DistMuon "
        f"{_s(_dm(e))} s" + ("" if e.distmuon else " (torchtitan refuses tp > 1 and pp > 1)"),
        f"* {e.launches} data-parallel launches holding {e.ops} NCCL ops per step on a rank "
        f"(FSDP2: {e.fsdp2_launches})",
        f"* largest rank {_gib(e.largest_rank_bytes)} of {_gib(dm)}: model state "
        f"{_gib(e.state_max)} (max/mean {e.state_max / e.state_mean:.2f}) + buffers "
        f"{_gib(e.buffers)} + activations {_gib(e.activations)}",
        f"* bytes per step on the critical path {e.bytes_ratio:.3f}x FSDP2's at this layout; "
        f"the owner floor here {e.owner_floor:.3f}x (1-D floor P/(P-1) at {S} shard ranks: "
        f"{S / (S - 1) if S > 1 else 1:.3f})",
        f"* Newton-Schulz {e.ns_max / e.ns_bound if e.ns_bound else 1:.3f}x its bound: "
        f"{_optimizer_term(e, 'matrixfsdp')} {_s(e.step.ns)} s"
        + (f" (of it the tp group's all-reduces {_s(e.ns_comm)} s)" if e.ns_comm else ""),
        *_runtime_lines(e, s), "",
        *_breakdown(e), "",
        f"Each system at its best (its fastest layout that it runs and that fits its own "
        f"memory, each checkpointing the fewest blocks that fit it); the compute floor "
        f"{_s(s.floor)} s is the step's model FLOPs over all {s.world_size} ranks:", "",
        *BOUND_HEAD, *bound_rows(s, dm), "",
        *sensitivity_lines(rates, s.peak),
        *_fewest_bytes(s),
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


def search_json(name: str, n_params: int, s: Search, st: Setting,
                rates: Sequence[RateRow] = ()) -> dict:
    """The ``--json`` object for one model and world size."""
    return {"model": name, "parameters": n_params, "world_size": s.world_size,
            "global_batch": s.global_batch, "search_seconds": s.seconds,
            "layouts_searched": len(s.layouts), "layouts_fitting": len(s.fitting),
            "compute_floor_seconds": s.floor, "peak_tflops": s.peak / 1e12,
            "tp_ownership": s.tp_ownership,
            "assumptions": assumptions(st, s),
            "recommended": s.recommended.record() if s.recommended else None,
            "runtime_settings": [line[2:] for line in _runtime_lines(s.recommended, s)]
            if s.recommended else [],
            "best_per_system": {k: e.record() if e else None
                                for k, e in peers_best(s, st.device_memory).items()},
            "tflops_sensitivity": [r.record(s.peak) for r in rates],
            "layouts": [e.record() for e in s.layouts]}


SUMMARY_HEAD = [
    "| model | ranks | advice (replicate x shard x tp x pp, AC) | fits | largest rank | step s | "
    "vs floor | MFU | bound | FSDP2 + Muon s | DistMuon s | bytes vs FSDP2 | owner floor | "
    "layouts (fit) | search s |",
    "|---|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
]


def summary_row(name: str, s: Search) -> str:
    e = s.recommended
    if e is None:
        return f"| {name} | {s.world_size} | none |" + " |" * 12
    return (f"| {name} | {s.world_size} | {e.label()} | {'yes' if e.fits else '**no**'} | "
            f"{_gib(e.largest_rank_bytes)} | {_s(e.step.total)} | "
            f"{e.step.total / s.floor:.3f}x | {_pct(e.mfu())} | {e.step.bound} | "
            f"{_s(e.fsdp2.total)} | {_s(_dm(e))} | {e.bytes_ratio:.3f} | {e.owner_floor:.3f} | "
            f"{len(s.layouts)} ({len(s.fitting)}) | {s.seconds:.1f} |")
