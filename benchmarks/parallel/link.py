"""Step time against link speed and launch latency, with and without overlap.

``matrixfsdp bench --link 0.25,0.5,1,2,4`` (or ``python -m benchmarks.parallel.link``) trains
the benchmark model on local CPU ranks over process groups that model a slower network
(:mod:`matrixfsdp.testing.grouped_gloo`'s ``Link``, wrapped around the process group from
outside the runtime, so MatrixFSDP and FSDP2 pass through the same one): every call
completes no earlier than its issue plus the launch latency (``--latency-us``) plus its
most loaded rank's bytes (NCCL's algorithms) over the link speed, one transfer after the
other on each rank. For each speed (GB/s) it times forward+backward of MatrixFSDP on NCCL's
path (one uneven call per unit and direction) with overlap on (prefetched gathers,
asynchronous reduces) and off, of MatrixFSDP on gloo's path (a broadcast and a reduce per
matrix: a launch each), and of FSDP2, and reports the fraction of the added communication
time that overlap hides: ``1 - (t_on - t_on_free) / (t_off - t_off_free)``, with
``*_free`` the step without any delay. Each time is the fastest of the timed steps on the
slowest rank. Where the communication adds less than a quarter of the step, the fraction is
not reported (on a shared machine that is within the noise). Writes ``link.json``,
``link.md`` and ``link.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import matrixfsdp as mf
from matrixfsdp import testing
from matrixfsdp.testing import Link
from matrixfsdp.train.launch import DefaultsHelp, launch
from matrixfsdp.train.machine import machine_info, machine_line
from matrixfsdp.train.models import GPT, GPTConfig

# (system, overlap, coalescing): what each column times
SETUPS = (("matrixfsdp", True, True), ("matrixfsdp", False, True), ("matrixfsdp", True, False),
        ("fsdp2", False, True))
COLUMN = {k: f"{k[0]}_{'on' if k[1] else 'off'}{'' if k[2] else '_gloo_path'}" for k in SETUPS}


def _mesh(gbps: float | None, latency_s: float, coalesce: bool) -> tuple[DeviceMesh, Link]:
    """A 1-D mesh over a new group of every rank whose calls go through ``Link`` (speed
    ``gbps``, None: no delay, only the bytes charged)."""
    link = Link(gbps * 1e9 if gbps else math.inf, latency_s if gbps else 0.0)
    testing.register("grouped_gloo", coalesce=coalesce, link=link)
    return DeviceMesh.from_group(dist.new_group(backend="grouped_gloo"), "cpu"), link


def _build(args, system: str, overlap: bool, mesh: DeviceMesh):
    """The benchmark GPT, sharded by ``system`` ("matrixfsdp" or "fsdp2"), and its optimizers."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers,
                    d_mlp=4 * args.d_model, seq_len=args.seq)
    model = GPT(cfg)
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh, overlap=overlap)
    # fp32 NS: the step is not timed here, and bf16 matmuls are slow on CPUs without AMX
    return model, mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32))


def _time_steps(args, key: tuple, gbps: float | None) -> tuple[float, int, int]:
    """Fastest forward+backward over the timed steps (the sample least disturbed by other
    work on a shared machine), in seconds; critical-path bytes and launches per step."""
    system, overlap, coalesce = key
    mesh, link = _mesh(gbps, args.latency_us * 1e-6, coalesce)
    model, opt = _build(args, system, overlap, mesh)
    g = torch.Generator().manual_seed(dist.get_rank())
    times, sent, launches = [], 0, 0
    for _ in range(args.warmup + args.steps):
        x = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
        dist.barrier()
        before, calls = link.charged, sum(testing.COUNTS.launches.values())
        t0 = time.perf_counter()
        model.loss(x[:, :-1], x[:, 1:]).backward()
        times.append(time.perf_counter() - t0)
        sent, launches = link.charged - before, sum(testing.COUNTS.launches.values()) - calls
        opt.step()
        opt.zero_grad()
    return min(times[args.warmup:]), sent, launches


def _measure(args) -> tuple[dict, list[dict]]:
    """Every configuration's time on this rank, then the slowest rank's (rank 0 only)."""
    free = {k: _time_steps(args, k, None) for k in SETUPS}
    rows = [dict(gbps=gbps, **{f"{COLUMN[k]}_ms": _time_steps(args, k, gbps)[0] * 1e3 for k in SETUPS})
            for gbps in args.link]
    flat = torch.tensor([free[k][0] * 1e3 for k in SETUPS] + [v for r in rows for k, v in r.items()
                                                           if k != "gbps"])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)  # the slowest rank's times decide a step
    worst = iter(torch.stack(every).max(dim=0).values.tolist())
    base = {f"{COLUMN[k]}_free_ms": next(worst) for k in SETUPS}
    base.update(critical_bytes_per_step=free[SETUPS[0]][1],
                fsdp2_critical_bytes_per_step=free[SETUPS[3]][1],
                launches_per_step={COLUMN[k]: free[k][2] for k in SETUPS})
    for r in rows:
        for k in [k for k in r if k != "gbps"]:
            r[k] = next(worst)
        on, off = COLUMN[SETUPS[0]], COLUMN[SETUPS[1]]
        added = r[f"{off}_ms"] - base[f"{off}_free_ms"]  # the time overlap could hide
        r["hidden"] = (1 - (r[f"{on}_ms"] - base[f"{on}_free_ms"]) / added
                       if added > 0.25 * base[f"{off}_free_ms"] else None)
    return base, rows


def _table(args, base: dict, rows: list[dict], machine: dict) -> list[str]:
    calls = base["launches_per_step"]
    lines = [f"{dist.get_world_size()} ranks, GPT {args.layers} layers, d_model {args.d_model}, "
             f"seq {args.seq}, batch {args.batch}/rank; launch latency {args.latency_us:g} us. "
             "Critical path per forward+backward (each collective's most loaded rank, NCCL's "
             f"algorithms): MatrixFSDP {base['critical_bytes_per_step'] / 2**20:.2f} MiB, FSDP2 "
             f"{base['fsdp2_critical_bytes_per_step'] / 2**20:.2f} MiB; process-group calls: "
             f"MatrixFSDP {calls['matrixfsdp_on']} (gloo's path: "
             f"{calls['matrixfsdp_on_gloo_path']}), FSDP2 {calls['fsdp2_off']}. Forward+backward "
             f"without any delay: MatrixFSDP {base['matrixfsdp_on_free_ms']:.0f} ms with overlap, "
             f"{base['matrixfsdp_off_free_ms']:.0f} ms without; FSDP2 "
             f"{base['fsdp2_off_free_ms']:.0f} ms (slowest rank, fastest of {args.steps} steps). "
             "FSDP2 overlaps only through CUDA streams, so on CPU its collectives are "
             "synchronous: compare it with overlap off.",
             "", machine_line(machine), "",
             "| link GB/s | MatrixFSDP, overlap on ms | overlap off ms | gloo's path (a launch "
             "per op), overlap on ms | FSDP2 ms | FSDP2 / MatrixFSDP (off) | communication "
             "hidden by overlap |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        hidden = f"{r['hidden']:.0%}" if r["hidden"] is not None else "within noise"
        lines.append(f"| {r['gbps']:g} | {r['matrixfsdp_on_ms']:.0f} | {r['matrixfsdp_off_ms']:.0f} "
                     f"| {r['matrixfsdp_on_gloo_path_ms']:.0f} | {r['fsdp2_off_ms']:.0f} "
                     f"| {r['fsdp2_off_ms'] / r['matrixfsdp_off_ms']:.2f}x | {hidden} |")
    return lines


def _plot(out: Path, base: dict, rows: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("link.png skipped: matplotlib is not installed")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    speeds = [r["gbps"] for r in rows]
    for key, style, label in (("matrixfsdp_on_ms", "o-", "MatrixFSDP, overlap on"),
                              ("matrixfsdp_off_ms", "s-", "MatrixFSDP, overlap off"),
                              ("matrixfsdp_on_gloo_path_ms", "d:", "MatrixFSDP, a launch per op"),
                              ("fsdp2_off_ms", "^--", "FSDP2")):
        ax.plot(speeds, [r[key] for r in rows], style, label=label)
    ax.axhline(base["matrixfsdp_on_free_ms"], color="gray", ls="--",
               label="no communication delay")
    ax.set_xscale("log")
    ax.set_xlabel("link speed per rank (GB/s, modelled)")
    ax.set_ylabel("forward + backward (ms)")
    ax.legend()
    ax.set_title("Step time against link speed")
    fig.tight_layout()
    fig.savefig(out / "link.png", dpi=120)


def _rank(args) -> None:
    base, rows = _measure(args)
    if dist.get_rank() != 0:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(config=vars(args), machine=machine_info(), **base, rows=rows)
    (out / "link.json").write_text(json.dumps(result, indent=2))
    lines = _table(args, base, rows, result["machine"])
    (out / "link.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(out, base, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="matrixfsdp bench --link", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelp)
    p.add_argument("--link", type=lambda s: [float(v) for v in s.split(",")],
                   default=[0.25, 0.5, 1.0, 2.0, 4.0], help="link speeds in GB/s, comma list")
    p.add_argument("--ranks", type=int, default=4,
                   help="local ranks (--world-size is another name for it) (default: 4)")
    p.add_argument("--world-size", dest="ranks", type=int, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--latency-us", type=float, default=25.0,
                   help="each call's launch latency (NCCL: ~14 us plus a hop per ring step)")
    p.add_argument("--out", default="runs/link")
    args = p.parse_args(argv)
    if args.ranks < 2 or any(v <= 0 for v in args.link) or args.steps < 1 or args.latency_us < 0:
        p.error("--ranks >= 2, link speeds > 0, --latency-us >= 0 and --steps >= 1")
    if torch.cuda.is_available():
        p.error("the modelled link wraps gloo groups of CPU ranks; on GPUs, time the real links")
    launch(_rank, args, args.ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
