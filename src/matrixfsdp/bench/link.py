"""Step time against link speed, with and without overlap.

``matrixfsdp bench --link 0.25,0.5,1,2,4`` (or ``python -m matrixfsdp.bench.link``) trains
the benchmark model on local ranks under a model of a slower network (:func:`use_link`):
every collective completes no earlier than ``issue + its most loaded rank's bytes / link
speed`` (a collective ends when its most loaded rank is done; the bytes are
:class:`~matrixfsdp.runtime.collectives.CommStats`' NCCL model, sent and received), on one link per rank:
a transfer starts when the previous one ended.
For each speed (GB/s) it times forward+backward of MatrixFSDP with overlap on (prefetched
gathers, asynchronous reduces) and off, and of FSDP2 under the same link model
(:func:`torch_link` wraps torch.distributed's collectives, charged alike), and reports the
fraction of the added communication time that overlap hides:
``1 - (t_on - t_on_free) / (t_off - t_off_free)``, with ``*_free`` the step without any
delay. Each time is the fastest of the timed steps on the slowest rank.
Where the communication adds less than a quarter of the step, the fraction is not
reported (on a shared machine that is within the noise). Writes ``link.json``,
``link.md`` and ``link.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

import matrixfsdp as mf
from matrixfsdp.bench.measure import machine_info, machine_line

from ..runtime.collectives import Comm, Load, Pending, ring_load
from ..train.launch import device_for, launch, sync
from ..train.models import GPT, GPTConfig


class Link:
    """One rank's network link: transfers one at a time, ``bytes_per_s`` each."""

    def __init__(self, bytes_per_s: float, latency_s: float = 0.0):
        self.bytes_per_s, self.latency_s = bytes_per_s, latency_s
        self._free = 0.0
        self.charged = 0  # bytes put on the link

    def ready_at(self, nbytes: int) -> float:
        start = max(time.perf_counter(), self._free)
        self._free = start + self.latency_s + nbytes / self.bytes_per_s
        return self._free


class LinkComm(Comm):
    """A :class:`~matrixfsdp.runtime.collectives.Comm` whose collectives are not done before ``link``
    has carried their most loaded rank's bytes: its :meth:`pending` hook hands the runtime's
    :class:`~matrixfsdp.runtime.collectives.Pending` a delayed work (the runtime does not know)."""

    def __init__(self, inner: Comm, link: Link):
        super().__init__(inner.group, inner.stats, inner.prefix)
        self.link = link

    def pending(self, kind: str, load: Load, work, epilogue, keep: tuple) -> Pending:
        return Pending(_DelayedWork(work, self.link.ready_at(load.critical)), epilogue, keep)


def use_link(root, gbps: float | None) -> None:
    """Put every collective of ``root`` (shard and replicate dims) behind one modelled link
    of ``gbps`` GB/s per rank; None: the real collectives alone."""
    if gbps is None:
        return
    link = Link(gbps * 1e9)
    root.comm = LinkComm(root.comm, link)
    if root.replication.comm is not None:
        root.replication.comm = LinkComm(root.replication.comm, link)



class _DelayedWork(dist.Work):
    """An asynchronous collective's work (torch's own, or a :class:`LinkComm`'s) that is not
    done before ``ready_at``: ``wait()`` sleeps until then, ``is_completed()`` is False before."""

    def __init__(self, inner, ready_at: float):
        super().__init__()
        self.inner, self.ready_at = inner, ready_at

    def wait(self, timeout=None) -> bool:
        done = self.inner.wait() if self.inner is not None else True
        _sleep_until(self.ready_at)
        return done

    def is_completed(self) -> bool:
        return ((self.inner is None or self.inner.is_completed())
                and time.perf_counter() >= self.ready_at)


def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# torch.distributed's collectives FSDP2 issues, and their ring factor (CommStats' model)
_TORCH_OPS = {"all_gather_single": 1, "all_gather_into_tensor": 1, "reduce_scatter_single": 1,
              "reduce_scatter_tensor": 1, "all_reduce": 2}


@contextmanager
def torch_link(gbps: float | None):
    """torch.distributed's collectives (looked up at call time, as FSDP2 does) behind one
    modelled link of ``gbps`` GB/s per rank, charged as ours are: ring all-gather /
    reduce-scatter / all-reduce of the larger buffer (:func:`~matrixfsdp.runtime.collectives.ring_load`).
    A synchronous call returns once the link has carried its bytes; an asynchronous one
    returns a work whose ``wait()`` does. Yields the :class:`Link` (``charged`` bytes)."""
    link = Link(gbps * 1e9 if gbps else math.inf)
    saved = {name: getattr(dist, name) for name in _TORCH_OPS if hasattr(dist, name)}

    def wrap(name, fn):
        def delayed(*args, **kwargs):
            n = max(t.numel() * t.element_size() for t in (*args, *kwargs.values())
                    if isinstance(t, torch.Tensor))
            critical = ring_load(n, dist.get_world_size(kwargs.get("group")), _TORCH_OPS[name]).critical
            link.charged += critical
            ready = link.ready_at(critical)
            work = fn(*args, **kwargs)
            if kwargs.get("async_op"):
                return _DelayedWork(work, ready)
            _sleep_until(ready)
            return work
        return delayed
    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield link
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _build(args, system: str, overlap: bool, device: torch.device):
    """The benchmark GPT, sharded by ``system`` ("matrixfsdp" or "fsdp2"), and its optimizers."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers,
                    d_mlp=4 * args.d_model, seq_len=args.seq)
    model = GPT(cfg).to(device)
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
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


def _time_steps(args, system: str, overlap: bool, gbps: float | None) -> tuple[float, int]:
    """Fastest forward+backward over the timed steps (the sample least disturbed by other
    work on a shared machine), in seconds, and critical-path bytes per step."""
    device = device_for(int(os.environ.get("LOCAL_RANK", dist.get_rank())))  # as launch chose
    model, opt = _build(args, system, overlap, device)
    if system == "matrixfsdp":
        root = mf.get_root(model)
        use_link(root, gbps)
    g = torch.Generator().manual_seed(dist.get_rank())
    times, sent = [], 0
    with torch_link(gbps) if system == "fsdp2" else contextlib.nullcontext() as link:
        charged = (lambda: link.charged) if link is not None else (
            lambda: root.stats.total("critical_bytes"))
        for _ in range(args.warmup + args.steps):
            x = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g).to(device)
            dist.barrier()
            before = charged()
            t0 = time.perf_counter()
            model.loss(x[:, :-1], x[:, 1:]).backward()
            sync(device)
            times.append(time.perf_counter() - t0)
            sent = charged() - before
            opt.step()
            opt.zero_grad()
    return min(times[args.warmup:]), sent


def _measure(args) -> tuple[dict, list[dict]]:
    """Every configuration's time on this rank, then the slowest rank's (rank 0 only)."""
    keys = [("matrixfsdp", True), ("matrixfsdp", False), ("fsdp2", False)]
    free = {k: _time_steps(args, *k, None) for k in keys}
    rows = [dict(gbps=gbps, **{f"{s}_{'on' if o else 'off'}_ms": _time_steps(args, s, o, gbps)[0] * 1e3
                               for s, o in keys}) for gbps in args.link]
    device = device_for(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    flat = torch.tensor([free[k][0] * 1e3 for k in keys] + [v for r in rows for k, v in r.items()
                                                           if k != "gbps"], device=device)
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)  # the slowest rank's times decide a step
    worst = iter(torch.stack(every).max(dim=0).values.tolist())
    base = dict(free_on_ms=next(worst), free_off_ms=next(worst), fsdp2_free_ms=next(worst),
                critical_bytes_per_step=free[keys[0]][1], fsdp2_critical_bytes_per_step=free[keys[2]][1])
    for r in rows:
        for k in [k for k in r if k != "gbps"]:
            r[k] = next(worst)
        added = r["matrixfsdp_off_ms"] - base["free_off_ms"]  # the time overlap could hide
        r["hidden"] = (1 - (r["matrixfsdp_on_ms"] - base["free_on_ms"]) / added
                       if added > 0.25 * base["free_off_ms"] else None)
    return base, rows


def _table(args, base: dict, rows: list[dict], machine: dict) -> list[str]:
    lines = [f"{dist.get_world_size()} ranks, GPT {args.layers} layers, d_model {args.d_model}, "
             f"seq {args.seq}, batch {args.batch}/rank. Critical path per step (each collective's "
             f"most loaded rank, NCCL's algorithms): MatrixFSDP "
             f"{base['critical_bytes_per_step'] / 2**20:.2f} MiB, FSDP2 "
             f"{base['fsdp2_critical_bytes_per_step'] / 2**20:.2f} MiB. Forward+backward without "
             f"any delay: MatrixFSDP {base['free_on_ms']:.0f} ms with overlap, "
             f"{base['free_off_ms']:.0f} ms without; FSDP2 {base['fsdp2_free_ms']:.0f} ms "
             f"(slowest rank, fastest of {args.steps} steps). FSDP2 overlaps only through CUDA "
             "streams, so on CPU its collectives are synchronous: compare it with overlap off.",
             "", machine_line(machine), "",
             "| link GB/s | MatrixFSDP, overlap on ms | overlap off ms | FSDP2 ms "
             "| FSDP2 / MatrixFSDP (off) | communication hidden by overlap |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        hidden = f"{r['hidden']:.0%}" if r["hidden"] is not None else "within noise"
        lines.append(f"| {r['gbps']:g} | {r['matrixfsdp_on_ms']:.0f} | {r['matrixfsdp_off_ms']:.0f} "
                     f"| {r['fsdp2_off_ms']:.0f} | {r['fsdp2_off_ms'] / r['matrixfsdp_off_ms']:.2f}x "
                     f"| {hidden} |")
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
                              ("fsdp2_off_ms", "^--", "FSDP2")):
        ax.plot(speeds, [r[key] for r in rows], style, label=label)
    ax.axhline(base["free_on_ms"], color="gray", ls="--", label="no communication delay")
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
