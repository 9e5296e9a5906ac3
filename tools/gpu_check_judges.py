"""The checks of ``make gpu-check`` (:mod:`tools.gpu_check`), their bounds with the
reasons, and the judges: pure functions of what was measured, each also handed a
deliberately broken input (:func:`self_tests`) which it must fail. Read by the command
(:mod:`tools.gpu_check`) and by the ranks it starts (:mod:`tools.gpu_check_ranks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ---- bounds, each with its reason (docs/gpu.md repeats them) -----------------------------

# Every rank reads the same batch, so the averaged gradient is the one-device gradient up to
# the rounding of a P-term fp32 sum of equal values, in whatever order NCCL adds them: at most
# (P - 1) + 1 roundings, 8 * 2^-24 ~ 5e-7 relative at P = 8; cuBLAS picking another kernel
# for a gathered parameter's alignment adds ~sqrt(k) * 2^-24 of the same kind. Both sides run
# Newton-Schulz in fp32 (torch's, patched for the reference; bf16 would turn a 5e-7 change into
# 2^-8 roundings). NS's 5 iterations amplify a relative change of their input by at most
# a^5 ~ 490 (a = 3.4445, the polynomial's largest slope, at small singular values), and a Muon
# update is lr * max(1, rows/cols)^0.5 <= 0.02 * 2 per element: a parameter moves differently by
# at most 0.04 * 490 * 1e-6 ~ 2e-5 per step, 6e-5 after 3 steps; AdamW's change is relative to
# the gradient's. Measured on CPU ranks over gloo (another summation order): 3.0e-7 at 3
# ranks, 0 at 4, 1.5e-7 at 8; with bf16 NS on both sides 2.3e-4 and 2.7e-4, above the bound,
# which is why both run fp32. A fault moves parameters by a step (a skipped step, a missing
# average, a wrong owner): the reference one step behind, measured in the same run (9.2e-3
# on CPU), must exceed the bound.
PARITY_TOL = 1e-4
PARITY_STEPS = 3
# The one host read the library documents (docs/design.md): a rank that had no gradient for
# some parameter reads the reduced flags of every such unit once, at the end of backward.
DOCUMENTED_SYNC = "attach_unused"
# Overlap. FSDP2 + AdamW on the same model, data and profiler shows what this machine's
# links and kernels allow; MatrixFSDP prefetches one unit ahead as FSDP2 does, so its exposed
# share should match FSDP2's. The margin covers the owner layout's extra bytes on the busiest
# rank (at most P/(P-1) of FSDP2's) and one profiled step's noise. Unavoidably exposed: the
# first unit's gather and the last unit's reduce, ~2 of 2L+2 collectives for L blocks (0.11 at
# L = 8), so 0.5 is far above a working schedule and below one that waits for every gather.
EXPOSED_MARGIN = 0.10
EXPOSED_MAX = 0.5
MIN_CONCURRENT = 0.05  # some communication must run beside compute at all
# Peak memory against FSDP2 + AdamW: Muon keeps one state (momentum) per matrix where AdamW
# keeps two, so MatrixFSDP's peak should be at or below FSDP2's; 10% covers the owner layout's
# imbalance (a rank's shard holds whole matrices: the plan's imbalance over 1/P) and the
# largest matrix's Newton-Schulz temporaries on its owner. Measured on CPU: 0.97x (make bench).
MEMORY_MAX = 1.10
# Speed. At P >= 2 each rank runs NS on its own matrices only (1/P of them), where FSDP2 +
# torch Muon runs every matrix's NS on every rank, through DTensor collectives: MatrixFSDP's
# step must be faster. At P = 1 both do the same work: 10% for noise. The iteration (forward
# + backward + step) must beat FSDP2 + torch Muon's by the same rule and cost at most FSDP2 +
# AdamW's (10% for noise and the owner layout's bytes) plus the NS the busiest rank must do
# (the bench's ns_limit_ms, NS alone on that rank's matrices).
SPEED_SLACK_ONE_GPU = 1.10
ITERATION_SLACK = 1.10
# Newton-Schulz at 8192 x 28672 is three GEMMs per iteration (elementwise work is O(1/8192)
# of it): cuBLAS bf16 reaches 0.6-0.75 of the dense peak at these sizes on an H100 SXM. 0.35
# is half that, room for clocks and power caps, and fails NS that misses the bf16 tensor
# cores (fp32: 67 of 989 TFLOP/s; TF32 at best ~0.3).
NS_MIN_FRACTION = 0.35
NS_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672))
NS_SHAPES_CPU = ((256, 256), (256, 1024))
NS_STEPS = 5
# Dense bf16 TFLOP/s by device name (no sparsity), first match wins; --peak-tflops for others.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                    ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0))
BENCH_SYSTEMS = "fsdp2_adamw,fsdp2_torch_muon,matrixfsdp"
BENCH_GPU = ["--preset", "gpu", "--steps", "5", "--warmup", "2"]
# the bench's code path on CPU, a tiny model: seconds, not a measurement of anything GPU
BENCH_CPU = ["--layers", "2", "--d-model", "64", "--heads", "4", "--mlp", "256", "--seq", "32",
             "--batch", "2", "--steps", "1", "--warmup", "1"]
CPU_RANKS = 2
CP_TOL = 1e-4  # per-step loss, fp32 parameters and Newton-Schulz: the CPU tests' bound
CP_STEPS = 10
MARK = "<!-- gpu-check -->"


@dataclass(frozen=True)
class Check:
    name: str
    measures: str
    passes: str  # the bound, as the report states it
    fails: str  # what fails it
    cpu: str  # what the dry run exercises on CPU
    broken: str  # the deliberately broken input it must fail


CHECKS: tuple[Check, ...] = (
    Check("parity",
          f"{PARITY_STEPS} steps of `mf.Muon` (fp32 Newton-Schulz) on a small GPT built on the CPU and "
          "sharded over the GPU mesh, against `torch.optim.Muon` (NS in fp32) + `torch.optim.AdamW` "
          "on one device, the same batch on every rank: the largest |ours - torch| / (1 + |torch|)",
          f"<= {PARITY_TOL:g}, every state on the GPU",
          "a difference above the bound (a skipped step, a missing average, a wrong owner move "
          "parameters by 1e-3 or more); a state left on the CPU",
          f"the same run on {CPU_RANKS} gloo ranks",
          "the reference one step behind (what a skipped step moves): must exceed the bound"),
    Check("host syncs",
          "`torch.cuda.set_sync_debug_mode(\"warn\")` around a steady step (forward, backward, "
          "`mf.clip_grad_norm_`, the step; batches made on the GPU), each warning's Python stack "
          "recorded; then a model with a parameter no rank uses",
          f"no sync in the steady step; exactly one with the unused parameter, in `{DOCUMENTED_SYNC}` "
          "(the documented read of the reduced flags)",
          "any other sync (the report names its file, line and phase)",
          "a stand-in for the debug mode: torch's warning from each host read (`.item()`, "
          "`.tolist()`, `bool()`, `.cpu()`, host data made on a device) outside torch's own code; "
          "the same recorder and judge",
          "a step with a deliberate `loss.item()`: must be recorded where it is"),
    Check("overlap",
          "`torch.profiler` (CUDA activity) over one steady step of a GPT (8 blocks, d_model 1024, "
          "sequence 1024, batch 8, bf16 compute): NCCL kernels against compute kernels, MatrixFSDP "
          "and FSDP2 + AdamW on the same model; the exposed share = NCCL time with no compute "
          "kernel running / NCCL time, worst rank",
          f"some NCCL time beside compute (>= {MIN_CONCURRENT:g} of it); exposed share <= FSDP2's "
          f"+ {EXPOSED_MARGIN:g} and <= {EXPOSED_MAX:g}",
          "communication serialised with compute (each gather waited for before its compute)",
          f"the same profile on {CPU_RANKS} gloo ranks: each collective in flight (its issue to the "
          "end of gloo's work) against the main thread's matmuls, the same interval function; "
          "judged on the order (a collective in flight while compute runs) and against FSDP2",
          "events with every collective after the compute (and, on CPU, a run with overlap off)"),
    Check("memory",
          "peak allocated bytes per rank (`torch.cuda.max_memory_allocated` over the timed steps: "
          "the bench's `peak_bytes`, max over ranks), `matrixfsdp bench --preset gpu` at the GPUs "
          "present, MatrixFSDP against FSDP2 + AdamW",
          f"<= {MEMORY_MAX:g}x FSDP2 + AdamW's",
          "a peak above the bound (a buffer held, states duplicated)",
          f"the bench on {CPU_RANKS} CPU ranks and a tiny model: its CPU accounting (live storages + "
          "the allocator's transient peak), the same judge; shown, not judged (that peak moves "
          "with gloo's timing)",
          "a result with MatrixFSDP at 1.2x FSDP2's"),
    Check("set-up memory",
          "bytes allocated after sharding (the model built on the CPU) against this rank's shards, "
          "the peak during it, and the device peak of `mf.full_state_dict(cpu_offload=True)`",
          "after set-up about the shards; at any time at most the shards + two units; nothing "
          "model-sized held",
          "a unit's buffers held after set-up, or a peak above the shards + two units",
          "the same set-up: no unsharded buffer held, every exported tensor on the CPU",
          "a unit's buffers held after set-up; a peak of the shards + three units"),
    Check("speed",
          "median step time and iteration time (forward + backward + step) of `matrixfsdp bench "
          "--preset gpu` at the GPUs present, against FSDP2 + torch Muon and FSDP2 + AdamW",
          "step and iteration <= FSDP2 + torch Muon's (1.1x at one GPU); iteration <= "
          f"{ITERATION_SLACK:g}x FSDP2 + AdamW's + the NS of the busiest rank (`ns_limit_ms`)",
          "a slower step or iteration than the bound",
          "the same bench path on a tiny model and 2 CPU ranks: ratios shown, not judged (CPU "
          "ranks on shared cores time nothing of a GPU)",
          "a result with MatrixFSDP's step slower than torch Muon's"),
    Check("Newton-Schulz",
          "bf16 TFLOP/s of the library's Newton-Schulz at Llama's shapes (4096 x 4096 to "
          "8192 x 28672), against the device's dense bf16 peak",
          f">= {NS_MIN_FRACTION:g} of the peak at 8192 x 28672",
          "NS below that fraction (fp32 or TF32 math, a copy per iteration); an unknown device "
          "without --peak-tflops",
          "the same timing code at small shapes; no peak known for a CPU: not judged",
          "a timing at 0.2 of the peak"),
    Check("several GPUs",
          "with 2+ GPUs: launches per unit and direction (NCCL's coalescing taken), and training "
          "with overlap on and off",
          "one launch per unit and direction; overlap on/off bit-identical",
          "more launches, or any difference between overlap on and off",
          f"{CPU_RANKS} gloo ranks: on/off bit-identical (gloo cannot coalesce)",
          "(none: bit-identity has no threshold)"),
    Check("context parallelism",
          "with 2+ GPUs in an even number and torchtitan installed: torchtitan's own Trainer at "
          "`context_parallel_degree` 2 through the one line (its `apply_cp_to_forward` unchanged, "
          "`mf.fully_shard` over its `fsdp` mesh, dp_shard x cp) against torchtitan + FSDP2 + "
          f"torch Muon from one seed checkpoint, {CP_STEPS} steps of the llama3 debug model at the "
          "tests' size, fp32 parameters and Newton-Schulz",
          f"per-step loss within {CP_TOL:g} over {CP_STEPS} steps",
          "a larger difference, fewer steps, or either trainer failing",
          "not run (SDPA's CPU flash kernel has no sharding strategy: both sides fail at cp 2); "
          "the same comparison at cp 1 on 2 CPU ranks is a heavy test",
          f"a run {2 * CP_TOL:g} apart: must fail"),
)
NAMES = tuple(c.name for c in CHECKS)


# ---- verdicts -----------------------------------------------------------------------------

def verdict(ok: bool | None, measured: dict[str, Any], note: str = "") -> dict[str, Any]:
    """``ok``: True pass, False fail, None not judged here."""
    return {"status": "pass" if ok else "not judged" if ok is None else "FAIL",
            "measured": measured, "note": note}


def _num(x: float | None, fmt: str = ".3g") -> str:
    return "n/a" if x is None else format(x, fmt)


def judge_parity(r: dict[str, Any]) -> dict[str, Any]:
    """``r``: ``diff`` (worst |ours - ref| / (1 + |ref|)), ``behind`` (the same against the
    reference one step behind), ``on_device``."""
    ok = r["diff"] <= PARITY_TOL and r["on_device"]
    m = {"worst |Δ| / (1 + |ref|)": f"{r['diff']:.2e}",
         "one step behind (a skipped step)": f"{r['behind']:.2e}",
         "states on the mesh's device": r["on_device"], "ranks": r["world"]}
    note = "" if ok else ("a state off the device" if not r["on_device"] else
                          f"difference {r['diff']:.2e} > {PARITY_TOL:g}")
    return verdict(ok, m, note)


def where_is(record: dict[str, Any]) -> str:
    return f"{record['phase']}: {record['where']}"


def judge_syncs(steady: list[dict], unused: list[dict]) -> dict[str, Any]:
    """``steady``: the records of a steady step (none allowed); ``unused``: of a step with a
    parameter no rank uses (exactly one, in :data:`DOCUMENTED_SYNC`). A record is
    ``{"phase", "where", "stack"}`` (:class:`tools.gpu_check_ranks.SyncRecorder`)."""
    documented = len(unused) == 1 and DOCUMENTED_SYNC in unused[0]["where"]
    ok = not steady and documented
    m = {"steady step": "none" if not steady else "; ".join(where_is(r) for r in steady[:4]),
         "with an unused parameter": "; ".join(where_is(r) for r in unused[:4]) or "none"}
    note = ""
    if steady:
        note = f"{len(steady)} sync(s) in a steady step"
    elif not documented:
        note = f"expected exactly one sync in {DOCUMENTED_SYNC}, saw {len(unused)}"
    return verdict(ok, m, note)


def judge_cp(r: dict[str, Any]) -> dict[str, Any]:
    """``r``: rank 0's ``steps`` and ``diff`` (the largest per-step loss difference), or
    ``skipped`` (why it did not run: not judged)."""
    if "skipped" in r:
        return verdict(None, {}, r["skipped"])
    ok = r["steps"] == CP_STEPS and r["diff"] <= CP_TOL
    m = {"steps": r["steps"], "largest per-step loss difference": f"{r['diff']:.2e}",
         "cp degree": r.get("degree", 2)}
    return verdict(ok, m, "" if ok else f"{r['steps']} steps, {r['diff']:.2e} apart (bound {CP_TOL:g})")


def judge_instrument(injected: list[dict], marker: str) -> bool:
    """The recorder saw the deliberate ``.item()`` (``marker`` names its function)."""
    return any(marker in r["where"] for r in injected)


# ---- overlap: intervals ---------------------------------------------------------------------
Event = tuple[str, float, float, Any]  # name, start, end, lane (stream or thread)
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"}


def merged(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def covered(u: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in u)


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_stats(comm: list[Event], compute: list[Event]) -> dict[str, float]:
    """Communication time, the part of it concurrent with compute, and the exposed share
    (communication with no compute running / communication), microseconds."""
    c, k = merged((s, e) for _, s, e, _ in comm), merged((s, e) for _, s, e, _ in compute)
    total, both = covered(c), intersection(c, k)
    beside = sum(1 for _, s, e, _ in comm if intersection([(s, e)], k) > 0)
    return {"comm_us": total, "compute_us": covered(k), "concurrent_us": both,
            "concurrent_share": both / total if total else 0.0,
            "exposed_share": 1 - both / total if total else 1.0,
            "collectives": len(comm), "collectives_beside_compute": beside}


def trace_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The complete ("X") events of a chrome trace exported by ``torch.profiler``."""
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def split_events(events: list[dict[str, Any]], device_type: str) -> tuple[list[Event], list[Event]]:
    """(communication, compute). CUDA: kernels, NCCL's (name contains "nccl") against all
    others, lane = stream. CPU: each collective in flight, from its issue on the rank's main
    thread (the thread that ran most operators; a ``c10d::`` operator) to the end of gloo's
    work on it (``gloo:*``, on gloo's threads, which take them in issue order), against the
    main thread's matmuls: a gather issued ahead is in flight while the unit before it
    computes, one issued when needed is waited for with nothing computing."""
    def ev(e):
        return (e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]),
                (e.get("args") or {}).get("stream", e.get("tid")))
    if device_type == "cuda":
        kernels = [e for e in events if e.get("cat") == "kernel"]
        comm = [ev(e) for e in kernels if "nccl" in e["name"].lower()]
        return comm, [ev(e) for e in kernels if "nccl" not in e["name"].lower()]
    ops: dict[Any, int] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e.get("tid")] = ops.get(e.get("tid"), 0) + 1
    main = max(ops, key=ops.get) if ops else None
    work = sorted((ev(e) for e in events if e.get("cat") == "user_annotation"
                   and e["name"].startswith("gloo:")), key=lambda x: x[1])
    issued = sorted((ev(e) for e in events if e.get("cat") == "cpu_op" and e.get("tid") == main
                     and e["name"].startswith("c10d::") and "barrier" not in e["name"]), key=lambda x: x[1])
    if len(issued) == len(work):
        work = [(w[0], i[1], max(w[2], i[2]), w[3]) for i, w in zip(issued, work)]
    return work, [ev(e) for e in events if e.get("cat") == "cpu_op" and e.get("tid") == main
                  and e["name"] in MATMULS]


def _worst(per_rank: list[dict[str, float]]) -> dict[str, float]:
    return max(per_rank, key=lambda s: s["exposed_share"])


def overlap_ok(ours: dict[str, float], fsdp2: dict[str, float] | None, cuda: bool) -> bool:
    """CUDA: a share of NCCL time beside compute, exposed no more than FSDP2's + a margin and
    :data:`EXPOSED_MAX`. CPU, where gloo's threads and the ranks share the cores (how much
    runs at once is the scheduler's): the order only, some collective in flight while the
    main thread computes; and no more exposed than FSDP2's + the margin."""
    if ours["comm_us"] <= 0:
        return False
    if fsdp2 is not None and ours["exposed_share"] > fsdp2["exposed_share"] + EXPOSED_MARGIN:
        return False
    if cuda:
        return ours["concurrent_share"] >= MIN_CONCURRENT and ours["exposed_share"] <= EXPOSED_MAX
    return ours["collectives_beside_compute"] >= 1


def judge_overlap(r: dict[str, Any]) -> dict[str, Any]:
    """``r``: ``world``, ``device``, and per system (``matrixfsdp``, ``matrixfsdp overlap
    off``, ``fsdp2``) the list of every rank's :func:`overlap_stats`. Judged on the worst
    rank (the most exposed)."""
    if r["world"] < 2:
        return verdict(None, {"ranks": 1}, "one rank communicates nothing")
    ours = _worst(r["matrixfsdp"])
    fsdp2 = _worst(r["fsdp2"]) if r.get("fsdp2") else None
    cuda = r["device"] == "cuda"
    ok = overlap_ok(ours, fsdp2, cuda)
    m = {"exposed share": f"{ours['exposed_share']:.2f}",
         "beside compute": f"{ours['concurrent_share']:.2f} of {ours['comm_us'] / 1e3:.1f} ms",
         "collectives beside compute": f"{ours['collectives_beside_compute']} of {ours['collectives']}",
         "FSDP2 + AdamW exposed": _num(fsdp2 and fsdp2["exposed_share"], ".2f")}
    if r.get("matrixfsdp overlap off"):
        off = _worst(r["matrixfsdp overlap off"])
        m["overlap off: exposed"] = f"{off['exposed_share']:.2f}"
    note = "" if ok else (f"exposed {ours['exposed_share']:.2f} against FSDP2's "
                          f"{_num(fsdp2 and fsdp2['exposed_share'], '.2f')}, beside compute "
                          f"{ours['concurrent_share']:.2f}")
    return verdict(ok, m, note)


def setup_memory_ok(held: int, shards: int, unit: int, after: int | None = None,
                    peak: int | None = None, export: int | None = None) -> bool:
    """Nothing model-sized held after set-up: no unit's unsharded buffer (``held`` bytes);
    on a GPU (the byte counts given) about the shards allocated after it, at most the shards
    + two units at its peak and during ``full_state_dict(cpu_offload=True)``."""
    if held:
        return False
    if after is None:
        return True
    return after <= 1.05 * shards + (1 << 20) and peak <= shards + 2 * unit and export <= shards + 2 * unit


# ---- memory and speed: the bench's results.json ---------------------------------------------

def _system(bench: dict[str, Any], name: str) -> dict[str, Any] | None:
    s = bench.get("systems", {}).get(name)
    return s if s and s.get("status") == "ok" else None


def _missing(bench: dict[str, Any], names: tuple[str, ...]) -> str:
    gone = [n for n in names if _system(bench, n) is None]
    errors = [f"{n}: {(bench.get('systems', {}).get(n) or {}).get('error') or 'not run'}" for n in gone]
    return "; ".join(e.splitlines()[0][:200] for e in errors)


def judge_memory(bench: dict[str, Any], judged: bool = True) -> dict[str, Any]:
    """``judged=False`` (CPU): the figures and the bound's answer, shown, not counted: the CPU
    accounting's transient peak moves with gloo's timing (FSDP2 + AdamW's 6.5 to 7.2 MiB in
    two runs of the same tiny model)."""
    missing = _missing(bench, ("fsdp2_adamw", "matrixfsdp"))
    if missing:
        return verdict(False, {}, f"the bench did not run: {missing}")
    ours = _system(bench, "matrixfsdp")["memory"]["peak_mib"]
    base = _system(bench, "fsdp2_adamw")["memory"]["peak_mib"]
    ratio = ours / base
    m = {"MatrixFSDP peak": f"{ours:.1f} MiB", "FSDP2 + AdamW peak": f"{base:.1f} MiB",
         "ratio": f"{ratio:.2f}x", "ranks": bench["config"]["world_size"]}
    ok = ratio <= MEMORY_MAX
    if not judged:
        return verdict(None, m, f"CPU: the bound would say {'pass' if ok else 'FAIL'}")
    return verdict(ok, m, "" if ok else f"{ratio:.2f}x > {MEMORY_MAX:g}x")


def speed_figures(bench: dict[str, Any]) -> dict[str, float]:
    def med(name, phase):
        return _system(bench, name)["phases"][phase]["wall_ms"]["median"]
    ns = _system(bench, "matrixfsdp").get("matrixfsdp", {}).get("ns_limit_ms", 0.0)
    return {"step": med("matrixfsdp", "step"), "iteration": med("matrixfsdp", "total"),
            "muon_step": med("fsdp2_torch_muon", "step"), "muon_iteration": med("fsdp2_torch_muon", "total"),
            "adamw_iteration": med("fsdp2_adamw", "total"), "ns_limit": ns,
            "world": bench["config"]["world_size"]}


def speed_ok(f: dict[str, float]) -> tuple[bool, str]:
    slack = 1.0 if f["world"] > 1 else SPEED_SLACK_ONE_GPU
    faults = []
    if f["step"] > slack * f["muon_step"]:
        faults.append(f"step {f['step']:.1f} ms > {slack:g} x torch Muon's {f['muon_step']:.1f}")
    if f["iteration"] > slack * f["muon_iteration"]:
        faults.append(f"iteration {f['iteration']:.1f} ms > {slack:g} x torch Muon's "
                      f"{f['muon_iteration']:.1f}")
    allowed = ITERATION_SLACK * f["adamw_iteration"] + f["ns_limit"]
    if f["iteration"] > allowed:
        faults.append(f"iteration {f['iteration']:.1f} ms > {ITERATION_SLACK:g} x AdamW's "
                      f"{f['adamw_iteration']:.1f} + NS {f['ns_limit']:.1f}")
    return not faults, "; ".join(faults)


def judge_speed(bench: dict[str, Any], judged: bool = True) -> dict[str, Any]:
    """``judged=False`` (CPU): the same figures and the bound's answer, shown, not counted."""
    missing = _missing(bench, ("fsdp2_adamw", "fsdp2_torch_muon", "matrixfsdp"))
    if missing:
        return verdict(False, {}, f"the bench did not run: {missing}")
    f = speed_figures(bench)
    ok, why = speed_ok(f)
    exact = _system(bench, "matrixfsdp").get("exactness")  # against FSDP2 + torch Muon's parameters
    if exact is not None and not exact["ok"]:  # faster by computing something else is no speed
        ok, why = False, "; ".join(x for x in (why, f"parameters {exact['max_abs_diff']:.1e} from "
                                                   "torch Muon's, past the bench's exactness bound") if x)
    m = {"step": f"{f['step']:.1f} ms ({f['step'] / f['muon_step']:.2f}x torch Muon's)",
         "iteration": f"{f['iteration']:.1f} ms ({f['iteration'] / f['muon_iteration']:.2f}x torch "
                      f"Muon's, {f['iteration'] / f['adamw_iteration']:.2f}x AdamW's)",
         "NS of the busiest rank": f"{f['ns_limit']:.1f} ms", "ranks": f["world"],
         "max abs Δ vs torch Muon": "n/a" if exact is None else f"{exact['max_abs_diff']:.1e}"}
    if not judged:
        return verdict(None, m, f"CPU: the bound would say {'pass' if ok else 'FAIL: ' + why}")
    return verdict(ok, m, why)


# ---- Newton-Schulz ----------------------------------------------------------------------------

def ns_flops(m: int, n: int, steps: int = NS_STEPS) -> float:
    """FLOPs of ``steps`` quintic NS iterations on an m x n matrix (a = min, b = max side):
    X X^T (2a^2 b), the polynomial's square (2a^3), its product with X (2a^2 b)."""
    a, b = min(m, n), max(m, n)
    return steps * (4 * a * a * b + 2 * a ** 3)


def peak_tflops(device_name: str, given: float | None = None) -> float | None:
    if given:
        return given
    return next((v for k, v in PEAK_BF16_TFLOPS if k in device_name), None)


def judge_ns(r: dict[str, Any], peak: float | None, judged: bool = True) -> dict[str, Any]:
    """``r``: ``device`` (name) and ``timings``: ``[[m, n, seconds], ...]``, the largest shape
    last; judged at the largest against ``peak`` (TFLOP/s)."""
    tf = [(m, n, ns_flops(m, n) / s / 1e12) for m, n, s in r["timings"]]
    meas = {f"{m}x{n}": f"{t:.3g} TFLOP/s" for m, n, t in tf}
    meas["device"] = r["device"]
    if not judged:
        return verdict(None, meas, "CPU: no bf16 peak to compare with")
    if peak is None:
        return verdict(False, meas, f"no bf16 peak known for {r['device']!r}: pass --peak-tflops")
    frac = tf[-1][2] / peak
    meas["largest vs peak"] = f"{frac:.2f} of {peak:.0f}"
    ok = frac >= NS_MIN_FRACTION
    return verdict(ok, meas, "" if ok else f"{frac:.2f} of the peak < {NS_MIN_FRACTION:g}")


# ---- the deliberately broken inputs --------------------------------------------------------------

def _fake_bench(world: int = 8, mem: float = 1.0, step: float = 0.1) -> dict[str, Any]:
    def system(peak, step_ms, total_ms):
        return {"status": "ok", "memory": {"peak_mib": peak},
                "phases": {"step": {"wall_ms": {"median": step_ms}},
                           "total": {"wall_ms": {"median": total_ms}}},
                "matrixfsdp": {"ns_limit_ms": 10.0}}
    return {"config": {"world_size": world}, "systems": {
        "fsdp2_adamw": system(1000.0, 5.0, 300.0), "fsdp2_torch_muon": system(1000.0, 200.0, 500.0),
        "matrixfsdp": system(1000.0 * mem, 200.0 * step, 300.0 + 200.0 * step)}}


def serialized_events(units: int = 8, comm_us: float = 100.0,
                      compute_us: float = 400.0) -> tuple[list[Event], list[Event]]:
    """Every unit's collective, then its compute, one after the other: nothing overlaps."""
    comm, compute, t = [], [], 0.0
    for i in range(units):
        comm.append((f"ncclDevKernel_AllGather {i}", t, t + comm_us, 20))
        t += comm_us
        compute.append((f"gemm {i}", t, t + compute_us, 7))
        t += compute_us
    return comm, compute


def prefetched_events(units: int = 8, comm_us: float = 100.0,
                      compute_us: float = 400.0) -> tuple[list[Event], list[Event]]:
    """The gather of unit i + 1 runs while unit i computes: only the first is exposed."""
    comm = [(f"ncclDevKernel_AllGather {i}", i * compute_us + (0 if i == 0 else comm_us),
             i * compute_us + (comm_us if i == 0 else 2 * comm_us), 20) for i in range(units)]
    compute = [(f"gemm {i}", comm_us + i * compute_us, comm_us + (i + 1) * compute_us, 7)
               for i in range(units)]
    return comm, compute


def self_tests() -> dict[str, bool]:
    """Each judge on a deliberately broken input: True where it fails it, as it must."""
    record = {"phase": "step", "where": "tools/gpu_check_ranks.py:1 in broken_step", "stack": []}
    documented = {"phase": "backward", "where": f"root.py:245 in {DOCUMENTED_SYNC}", "stack": []}
    bad = overlap_stats(*serialized_events())
    good = overlap_stats(*prefetched_events())
    return {
        "parity": judge_parity({"diff": 3e-3, "behind": 3e-3, "on_device": True,
                                "world": 8})["status"] == "FAIL",
        "host syncs": judge_syncs([record], [documented])["status"] == "FAIL"
        and judge_syncs([], [documented, record])["status"] == "FAIL",
        "overlap": judge_overlap({"world": 8, "device": "cuda", "matrixfsdp": [bad],
                                  "fsdp2": [good]})["status"] == "FAIL",
        "memory": judge_memory(_fake_bench(mem=1.2))["status"] == "FAIL",
        "set-up memory": not setup_memory_ok(held=1 << 20, shards=1 << 30, unit=1 << 26)
        and not setup_memory_ok(0, 1 << 30, 1 << 26, after=1 << 30, peak=(1 << 30) + (3 << 26), export=0),
        "speed": judge_speed(_fake_bench(step=1.05))["status"] == "FAIL",
        "context parallelism": judge_cp({"steps": CP_STEPS, "diff": 2 * CP_TOL})["status"] == "FAIL",
        "Newton-Schulz": judge_ns({"device": "NVIDIA H100 80GB HBM3", "timings": [
            [8192, 28672, ns_flops(8192, 28672) / (0.2 * 989e12)]]}, 989.0)["status"] == "FAIL",
    }


