"""Step time against link speed, with and without overlap.

``matrixfsdp bench --link 0.25,0.5,1,2,4`` (or ``python -m matrixfsdp.bench.link``) trains
the benchmark model on local ranks under a model of a slower network (:func:`use_link`):
every collective completes no earlier than ``issue + its most loaded rank's bytes / link
speed`` (a collective ends when its most loaded rank is done; the bytes are
:class:`~matrixfsdp.comm.CommStats`' NCCL model, sent and received), on one link per rank:
a transfer starts when the previous one ended.
For each speed (GB/s) it times forward+backward with overlap on (prefetched gathers,
asynchronous reduces) and off, and reports the fraction of the added communication time
that overlap hides: ``1 - (t_on - t_on_free) / (t_off - t_off_free)``, with ``*_free`` the
step without any delay. Each time is the fastest of the timed steps on the slowest rank.
Where the communication adds less than a quarter of the step, the fraction is not
reported (on a shared machine that is within the noise). Writes ``link.json``,
``link.md`` and ``link.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import matrixfsdp as mf
from matrixfsdp.bench.measure import machine_info, machine_line
from matrixfsdp.comm import Comm, Load, Pending
from matrixfsdp.models import GPT, GPTConfig
from matrixfsdp.ranks import device_for, launch, sync


class Link:
    """One rank's network link: transfers one at a time, ``bytes_per_s`` each."""

    def __init__(self, bytes_per_s: float, latency_s: float = 0.0):
        self.bytes_per_s, self.latency_s = bytes_per_s, latency_s
        self._free = 0.0

    def ready_at(self, nbytes: int) -> float:
        start = max(time.perf_counter(), self._free)
        self._free = start + self.latency_s + nbytes / self.bytes_per_s
        return self._free


class LinkComm(Comm):
    """A :class:`~matrixfsdp.comm.Comm` whose collectives are not done before ``link``
    has carried their most loaded rank's bytes (a wrapper: the runtime does not know)."""

    def __init__(self, inner: Comm, link: Link):
        super().__init__(inner.group, inner.stats, inner.prefix)
        self.link = link

    def pending(self, kind: str, load: Load, work, epilogue, keep: tuple) -> Pending:
        return Pending(work, epilogue, keep, ready_at=self.link.ready_at(load.critical))


def use_link(root, gbps: float | None) -> None:
    """Put every collective of ``root`` (shard and replicate dims) behind one modelled link
    of ``gbps`` GB/s per rank; None: the real collectives alone."""
    if gbps is None:
        return
    link = Link(gbps * 1e9)
    root.comm = LinkComm(root.comm, link)
    if root.replication.comm is not None:
        root.replication.comm = LinkComm(root.replication.comm, link)



def _time_steps(args, overlap: bool, gbps: float | None) -> tuple[float, int]:
    """Fastest forward+backward over the timed steps (the sample least disturbed by other
    work on a shared machine), in seconds, and bytes sent per step."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers,
                    d_mlp=4 * args.d_model, seq_len=args.seq)
    device = device_for(int(os.environ.get("LOCAL_RANK", dist.get_rank())))  # as launch chose
    model = GPT(cfg).to(device)
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh, overlap=overlap)
    opt = mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=3e-3))
    root = mf.get_root(model)
    use_link(root, gbps)
    g = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for _ in range(args.warmup + args.steps):
        x = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g).to(device)
        dist.barrier()
        root.stats.reset()
        t0 = time.perf_counter()
        model.loss(x[:, :-1], x[:, 1:]).backward()
        sync(device)
        times.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad()
    return min(times[args.warmup:]), root.stats.total("critical_bytes")


def _rank(args) -> None:
    rows = []
    free_on, sent = _time_steps(args, True, None)
    free_off, _ = _time_steps(args, False, None)
    for gbps in args.link:
        on, _ = _time_steps(args, True, gbps)
        off, _ = _time_steps(args, False, gbps)
        rows.append(dict(gbps=gbps, on_ms=on * 1e3, off_ms=off * 1e3))
    # the slowest rank's times decide a step
    device = device_for(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    flat = torch.tensor([free_on * 1e3, free_off * 1e3]
                        + [v for r in rows for v in (r["on_ms"], r["off_ms"])], device=device)
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    worst = torch.stack(every).max(dim=0).values.tolist()
    if dist.get_rank() != 0:
        return
    free_ms, free_off_ms = worst[0], worst[1]
    for i, r in enumerate(rows):
        r["on_ms"], r["off_ms"] = worst[2 + 2 * i], worst[3 + 2 * i]
        added = r["off_ms"] - free_off_ms  # the communication time overlap could hide
        r["hidden"] = 1 - (r["on_ms"] - free_ms) / added if added > 0.25 * free_off_ms else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(config=vars(args), machine=machine_info(), free_ms=free_ms,
                  free_off_ms=free_off_ms, critical_bytes_per_step=sent, rows=rows)
    (out / "link.json").write_text(json.dumps(result, indent=2))
    lines = [f"{dist.get_world_size()} ranks, GPT {args.layers} layers, d_model {args.d_model}, "
             f"seq {args.seq}, batch {args.batch}/rank; {sent / 2**20:.1f} MiB per step on the "
             f"critical path (each collective's most loaded rank); forward+backward without any "
             f"delay: {free_ms:.0f} ms with overlap, "
             f"{free_off_ms:.0f} ms without (slowest rank, fastest of {args.steps} steps).", "",
             machine_line(result["machine"]), "",
             "| link GB/s | overlap on ms | overlap off ms | communication hidden |",
             "|---:|---:|---:|---:|"]
    for r in rows:
        hidden = f"{r['hidden']:.0%}" if r["hidden"] is not None else "within noise"
        lines.append(f"| {r['gbps']:g} | {r['on_ms']:.0f} | {r['off_ms']:.0f} | {hidden} |")
    (out / "link.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("link.png skipped: matplotlib is not installed")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    speeds = [r["gbps"] for r in rows]
    ax.plot(speeds, [r["on_ms"] for r in rows], "o-", label="overlap on")
    ax.plot(speeds, [r["off_ms"] for r in rows], "s-", label="overlap off")
    ax.axhline(free_ms, color="gray", ls="--", label="no communication delay")
    ax.set_xscale("log")
    ax.set_xlabel("link speed per rank (GB/s, modelled)")
    ax.set_ylabel("forward + backward (ms)")
    ax.legend()
    ax.set_title("MatrixFSDP step time against link speed")
    fig.tight_layout()
    fig.savefig(out / "link.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="matrixfsdp bench --link", description=__doc__.split("\n\n")[0])
    p.add_argument("--link", type=lambda s: [float(v) for v in s.split(",")],
                   default=[0.25, 0.5, 1.0, 2.0, 4.0], help="link speeds in GB/s, comma list")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="runs/link")
    args = p.parse_args(argv)
    if args.ranks < 2 or any(v <= 0 for v in args.link) or args.steps < 1:
        p.error("--ranks >= 2, link speeds > 0 and --steps >= 1")
    launch(_rank, args, args.ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
