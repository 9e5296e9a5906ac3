"""``matrixfsdp calibrate``: measure, on the machine it runs on, the constants the step-time
model of ``matrixfsdp plan`` uses, and write them to a file ``plan --constants FILE`` reads
(:class:`~matrixfsdp.costs.constants.Constants`). On a GPU node or a cluster, run it after
``make gpu-check`` (docs/gpu.md: the first command there) and before ``matrixfsdp plan
--constants FILE``; without a GPU it runs on CPU ranks over gloo.

Every rank measures at once, doing the same work, so a rank's rate is what it gets while
its peers run too (on a shared CPU: its share of the cores), as in training:

* **matmul rates** per dtype (``bfloat16``, ``float32``): ``(m x k) @ (k x n)`` at a grid of
  shapes, and Newton-Schulz as the owners run it (:func:`matrixfsdp.zeropower_via_newtonschulz`,
  torch.optim.Muon's 5 quintic iterations) at matrix shapes, FLOPs as
  :func:`~matrixfsdp.layout.assign.ns_flops` counts them, over the median time of a few
  repetitions;
* **element-wise updates**: ``torch.optim.AdamW``'s step and Muon's momentum + update
  (``lerp_``, ``lerp``, ``mul_``, ``add_``) on ``2^22`` fp32 elements (``2^26`` on a GPU),
  in bytes per second as the model counts them (7 and 5 fp32 accesses per element);
* **collectives**: each kind the runtime issues (``all_gather_into_tensor``,
  ``reduce_scatter_tensor``, ``broadcast``, ``reduce``, ``all_reduce``,
  ``all_to_all_single``), over groups of every power-of-two size up to the world (the
  world's ranks split into groups of that size, all running at once), at a small and a large
  buffer: ``latency`` and ``bandwidth`` of ``t = latency + busiest / bandwidth``, ``busiest``
  the most loaded rank's bytes by NCCL's algorithms (a ring's ``(P-1)/P`` of the buffer, a
  pipelined broadcast's or reduce's whole buffer, an all-reduce's twice the ring's). Where
  the group coalesces ops into one launch (NCCL; asked of the group as the runtime asks it),
  ``launch``: one launch's cost beyond its ops' own latency, from a launch of 8 small
  broadcasts against one.

``matrixfsdp calibrate --ranks 4 --out constants.json`` starts its ranks as ``bench`` does
(local processes; CUDA: one per GPU); under torchrun it runs on torchrun's ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import _compat
from .._compat import all_gather_single, reduce_scatter_single
from ..costs.constants import OP_KINDS, Constants, OpFit
from ..layout.assign import ns_flops
from ..optim.muon import zeropower_via_newtonschulz
from ..runtime.collectives import coalescing_supported
from ..train.launch import DefaultsHelp, device_for, sync
from ..train.machine import barrier, machine_info
from ..train.rank_process import ranks_started

NS_COEFFS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's defaults
SHAPES = {  # (gemm m, k, n), (ns rows, cols): CPU ranks, GPUs
    "cpu": ([(m, k, n) for m in (256, 2048) for k in (256, 1024, 4096)
             for n in (256, 1024, 4096) if m * k * n <= 2**32],
            [(128, 128), (128, 512), (256, 256), (256, 1024), (512, 512), (512, 2048)]),
    "cuda": ([(m, k, n) for m in (2048, 8192, 32768) for k, n in ((1024, 1024), (4096, 4096),
                                                                  (4096, 14336), (14336, 4096),
                                                                  (8192, 28672))],
             [(1024, 1024), (1024, 4096), (4096, 4096), (4096, 14336), (8192, 8192),
              (8192, 28672), (16384, 53248)]),
}
MIN_SECONDS = (0.25, 0.02)  # one timed run at least (CPU, GPU): long enough that all ranks overlap
SIZES = {"cpu": (2**10, 2**22), "cuda": (2**12, 2**28)}  # bytes: latency, bandwidth
ELEMENTS = {"cpu": 2**22, "cuda": 2**26}


def _median_time(fn, device: torch.device, reps: int, group=None) -> float:
    """Median seconds of one ``fn()`` over ``reps`` timed runs after a warm-up; each run
    repeats ``fn`` for at least :data:`MIN_SECONDS` (the same count on every rank of
    ``group``, default the world) and starts after a barrier, so all ranks work at once."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    count = torch.tensor([max(1.0, MIN_SECONDS[device.type == "cuda"]
                               / max(time.perf_counter() - t0, 1e-9))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    k = int(min(count.item(), 10_000))
    times = []
    for _ in range(reps):
        barrier(device, group)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        sync(device)
        times.append((time.perf_counter() - t0) / k)
    return statistics.median(times)


def model_matmul_shapes(matrices: list[tuple[int, int]], tokens: int
                 ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """A model's own matmul shapes (per ``rows x cols`` weight and ``tokens`` per
    micro-batch: its forward, input-gradient and weight-gradient matmuls) and its
    Newton-Schulz shapes, to measure beside the grid (``calibrate --model``)."""
    gemm = sorted({shape for r, c in matrices
                   for shape in ((tokens, c, r), (tokens, r, c), (r, tokens, c))})
    return gemm, sorted(set(matrices))


def matmul_rates(device: torch.device, reps: int, extra: tuple[list, list] = ([], []),
                 grid: bool = True) -> tuple[dict, dict]:
    gemm_shapes, ns_shapes = SHAPES["cuda" if device.type == "cuda" else "cpu"] if grid \
        else ([], [])
    gemm_shapes = sorted(set(gemm_shapes) | set(extra[0]))
    ns_shapes = sorted(set(ns_shapes) | set(extra[1]))
    gemm: dict[str, list] = {}
    ns: dict[str, list] = {}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        rows = []
        for m, k, n in gemm_shapes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            rows.append([m, k, n, 2.0 * m * k * n / _median_time(lambda a=a, b=b: a @ b, device,
                                                                 reps)])
        gemm[name] = rows
        rows = []
        for r, c in ns_shapes:
            x = torch.randn(r, c, device=device)
            secs = _median_time(lambda x=x, d=dtype: zeropower_via_newtonschulz(
                x, NS_COEFFS, 5, 1e-7, d), device, reps)
            rows.append([r, c, ns_flops((r, c), 5) / secs])
        ns[name] = rows
    return gemm, ns


def elementwise_rates(device: torch.device, reps: int) -> tuple[float, float]:
    n = ELEMENTS[device.type if device.type in ELEMENTS else "cpu"]
    p = torch.zeros(n, device=device, requires_grad=True)
    p.grad = torch.randn(n, device=device)
    opt = torch.optim.AdamW([p], lr=1e-3)
    adamw = _median_time(opt.step, device, reps)
    buf, g, u = torch.zeros(n, device=device), torch.randn(n, device=device), torch.empty(n, device=device)
    w = torch.zeros(n, device=device)

    def muon():
        buf.lerp_(g, 0.05)
        torch.lerp(g, buf, 0.95, out=u)
        w.mul_(0.999)
        w.add_(u, alpha=-0.02)
    return 7 * 4 * n / adamw, 5 * 4 * n / _median_time(muon, device, reps)


def _busiest(kind: str, nbytes: int, P: int) -> float:
    """The most loaded rank's bytes of one op on an ``nbytes`` buffer (NCCL's algorithms)."""
    if kind in ("broadcast", "reduce"):
        return float(nbytes)
    if kind == "all_reduce":
        return 2.0 * nbytes * (P - 1) / P
    return float(nbytes) * (P - 1) / P  # ring all-gather / reduce-scatter; all-to-all


def _op(kind: str, group, P: int, me: int, nbytes: int, device: torch.device):
    """A callable issuing one ``kind`` op on an ``nbytes`` buffer (fp32) over ``group``."""
    n = max(P, nbytes // 4 // P * P)
    if kind == "all_gather":
        out, inp = torch.empty(n, device=device), torch.ones(n // P, device=device)
        return lambda: all_gather_single(out, inp, group=group)
    if kind == "reduce_scatter":
        out, inp = torch.empty(n // P, device=device), torch.ones(n, device=device)
        return lambda: reduce_scatter_single(out, inp, group=group)
    t = torch.ones(n, device=device)
    if kind == "broadcast":
        return lambda: dist.broadcast(t, group_src=0, group=group)
    if kind == "reduce":
        return lambda: dist.reduce(t, group_dst=0, group=group)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(t, group=group)
    out = torch.empty(n, device=device)
    return lambda: dist.all_to_all_single(out, t, group=group)


def collective_fits(device: torch.device, reps: int) -> tuple[dict, bool, float]:
    """Per kind, ``[ranks, latency, bandwidth]`` for every power-of-two group size up to the
    world; whether the world coalesces; one launch's own cost (0 where it does not)."""
    W, rank = dist.get_world_size(), dist.get_rank()
    small, large = SIZES["cuda" if device.type == "cuda" else "cpu"]
    sizes = [P for P in (2 ** i for i in range(1, W.bit_length())) if W % P == 0]
    fits: dict[str, list] = {k: [] for k in OP_KINDS}
    coalesced, launch = coalescing_supported(dist.group.WORLD, device), 0.0
    for P in sizes:
        groups = [dist.new_group(list(range(s, s + P))) for s in range(0, W, P)]
        group, me = groups[rank // P], rank % P
        for kind in OP_KINDS:
            t_small = _median_time(_op(kind, group, P, me, small, device), device, reps, group)
            t_large = _median_time(_op(kind, group, P, me, large, device), device, reps, group)
            b_small, b_large = (_busiest(kind, max(P, n // 4 // P * P) * 4, P)
                                for n in (small, large))
            bw = (b_large - b_small) / max(t_large - t_small, 1e-9)
            fits[kind].append([P, max(t_small - b_small / bw, 0.0), bw])
        if coalesced and P == W:
            one = torch.ones(8, device=device)
            single = _median_time(lambda one=one, group=group: dist.broadcast(
                one, group_src=0, group=group), device, reps, group)

            def eight(one=one, group=group):
                with _compat.coalescing(group, device) as works:
                    for _ in range(8):
                        dist.broadcast(one, group_src=0, group=group, async_op=True)
                works[0].wait()
            per_op = (_median_time(eight, device, reps, group) - single) / 7
            launch = max(single - per_op, 0.0)
    if launch:  # an op's own latency inside a launch: what a single op costs beyond it
        for rows in fits.values():
            for row in rows:
                row[1] = max(row[1] - launch, 0.0)
    return fits, coalesced, launch


def _rank(rank: int, from_launcher, world: int, init_file: str, out: str, reps: int,
          extra: tuple[list, list], grid: bool) -> None:
    from_launcher.adopt()
    torch.set_num_threads(1)
    device = device_for(rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    try:
        measure(device, out, reps, extra, grid)
    finally:
        dist.destroy_process_group()


def measure(device: torch.device, out: str, reps: int, extra: tuple[list, list] = ([], []),
            grid: bool = True) -> Constants:
    """Every constant (module docstring), on the initialised world; rank 0 writes ``out``.
    ``extra``: a model's own matmul and Newton-Schulz shapes (:func:`model_matmul_shapes`);
    ``grid`` False: those alone."""
    rank = dist.get_rank()
    say = (lambda s: print(f"[calibrate] {s}", flush=True)) if rank == 0 else (lambda s: None)
    t0 = time.perf_counter()
    say("matmul and Newton-Schulz rates ...")
    gemm, ns = matmul_rates(device, reps, extra, grid)
    say("element-wise updates ...")
    adamw, muon = elementwise_rates(device, reps)
    say("collectives ...")
    fits, coalesced, launch = collective_fits(device, reps)
    # the median rank's rates (a rank's own noise, e.g. another process, is not the machine's)
    mine = [gemm, ns, adamw, muon]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for d in gemm:
        for i, row in enumerate(gemm[d]):
            row[3] = statistics.median(e[0][d][i][3] for e in every)
        for i, row in enumerate(ns[d]):
            row[2] = statistics.median(e[1][d][i][2] for e in every)
    adamw = statistics.median(e[2] for e in every)
    muon = statistics.median(e[3] for e in every)
    c = Constants(device.type, dist.get_backend(), dist.get_world_size(), coalesced, launch,
                  gemm, ns, adamw, muon,
                  {k: [OpFit(*row) for row in rows] for k, rows in fits.items()}, machine_info())
    if rank == 0:
        data = c.to_json()
        data["seconds"] = time.perf_counter() - t0
        with open(out, "w") as f:
            json.dump(data, f, indent=1)
        say(f"wrote {out} ({data['seconds']:.0f} s)")
    return c


def summary(c: Constants) -> str:
    """A few lines saying what was measured."""
    lines = [c.describe()]
    for d in c.gemm:
        g = max(r[3] for r in c.gemm[d]) / 1e9
        n = max(r[2] for r in c.ns[d]) / 1e9
        lines.append(f"  {d}: matmul up to {g:.1f} GFLOP/s, Newton-Schulz up to {n:.1f} GFLOP/s")
    lines.append(f"  element-wise: AdamW {c.adamw_bytes_per_s / 1e9:.1f} GB/s, Muon "
                 f"{c.muon_bytes_per_s / 1e9:.1f} GB/s (as the model counts bytes)")
    for k, fits in c.collectives.items():
        lines.append(f"  {k}: " + ", ".join(f"{f.ranks} ranks {f.latency * 1e6:.0f} us + "
                                            f"{f.bandwidth / 1e9:.2f} GB/s" for f in fits))
    return "\n".join(lines)


def main(argv: list[str] | None = None, model_matrices=None) -> int:
    """``matrixfsdp calibrate``. ``model_matrices(name)``: the ``(rows, cols)`` of a model's
    2-D weights (the command's ``--model``, resolved as ``plan`` resolves it)."""
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="matrixfsdp calibrate", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelp)
    p.add_argument("--ranks", type=int, default=None,
                   help="local ranks (default: 4 on CPU, the GPU count with CUDA; under "
                        "torchrun, its own)")
    p.add_argument("--out", default="constants.json", help="the file to write")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of each measurement")
    p.add_argument("--model", default=None, metavar="NAME|CONFIG",
                   help="also measure this model's own matmul and Newton-Schulz shapes (a "
                        "plan preset or a transformers config.json)")
    p.add_argument("--seq", type=int, default=8192, help="with --model: tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=1,
                   help="with --model: sequences per micro-batch")
    p.add_argument("--no-grid", action="store_true",
                   help="with --model: measure its shapes only, not the grid (faster)")
    a = p.parse_args(argv)
    if a.reps < 1 or a.seq < 1 or a.micro_batch < 1:
        p.error("--reps, --seq and --micro-batch must be >= 1")
    extra: tuple[list, list] = ([], [])
    if a.model:
        if model_matrices is None:
            p.error("--model: no model loader here (run it as `matrixfsdp calibrate`)")
        extra = model_matmul_shapes(model_matrices(a.model), a.seq * a.micro_batch)
    elif a.no_grid:
        p.error("--no-grid needs --model (there would be no shapes to measure)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun's ranks
        device = device_for(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        try:
            c = measure(device, a.out, a.reps, extra, not a.no_grid)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) == 0:
            print(summary(c))
        return 0
    cuda = torch.cuda.is_available()
    world = a.ranks or (torch.cuda.device_count() if cuda else 4)
    if world < 1:
        p.error("--ranks must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="matrixfsdp_calibrate_") as tmp:
        with ranks_started(_rank, (world, os.path.join(tmp, "init"), a.out, a.reps, extra,
                                   not a.no_grid), world) as ranks:
            while not ranks.join():
                pass
    print(summary(Constants.load(a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
