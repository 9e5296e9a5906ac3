"""``matrixfsdp train | plan | bench``: thin wrappers over the library."""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ._exit import exit_rank

log = logging.getLogger("matrixfsdp")


# ---- launching ---------------------------------------------------------------------------
def _device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    """Wait for queued device work, so host clocks time it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _spawned(rank: int, fn, world_size: int, init_file: str, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    _device_for(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=5))
    try:
        fn(args)
    finally:
        dist.destroy_process_group()
    exit_rank(0)  # finished: leave without interpreter finalization (see _exit.py)


def launch(fn, args, world_size: int) -> None:
    """Run ``fn(args)`` on ``world_size`` ranks: in place under torchrun (RANK is set),
    else as local processes (gloo on CPU, NCCL on CUDA)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        _device_for(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            fn(args)
        finally:
            dist.destroy_process_group()
        exit_rank(0)  # finished: leave without interpreter finalization (see _exit.py)
    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        raise SystemExit(f"--ranks {world_size} needs {world_size} GPUs, found "
                         f"{torch.cuda.device_count()}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_spawned, args=(fn, world_size, os.path.join(tmp, "init"), args),
                                    nprocs=world_size)


# ---- data ---------------------------------------------------------------------------------
def stdlib_corpus(max_bytes: int = 8 << 20) -> torch.Tensor:
    """Bytes of the Python standard library's own source files (sorted, so every rank and
    every run reads the same corpus). Nothing is downloaded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise SystemExit(f"no Python sources found under {root} for the demo corpus")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def batch_at(corpus: torch.Tensor, step: int, rank: int, world: int, batch: int, seq: int,
             seed: int, split: str = "train") -> torch.Tensor:
    """``batch`` windows of ``seq + 1`` bytes for one rank: ranks read different windows of
    the same global batch. The last 5% of the corpus is held out for validation."""
    cut = int(len(corpus) * 0.95)
    lo, hi = (0, cut) if split == "train" else (cut, len(corpus))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + (split == "val"))
    starts = torch.randint(lo, hi - seq - 1, (world * batch,), generator=g)[rank * batch:(rank + 1) * batch]
    return torch.stack([corpus[s:s + seq + 1] for s in starts.tolist()])


# ---- train --------------------------------------------------------------------------------
def _train(args) -> None:
    import matrixfsdp as mf
    from matrixfsdp.models import GPT, GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device_for(int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, d_model=args.d_model, n_heads=args.heads,
                    n_layers=args.layers, d_mlp=args.mlp)
    model = GPT(cfg).to(device)
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    opt = mf.Muon(mf.muon_param_groups(model, lr=args.lr, adamw_lr=args.adamw_lr,
                                       weight_decay=0.1, adamw_weight_decay=0.01,
                                       adamw_betas=(0.9, 0.95)))
    warm = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.1, 1 - s / args.steps))
    plan = mf.plan_of(model)
    corpus = stdlib_corpus()
    stats = mf.comm_stats(model)
    if rank == 0:
        print(mf.plan_report(model))
        print(f"\ncorpus: {len(corpus) / 1e6:.1f} MB of the Python standard library's sources; "
              f"{world} ranks on {device.type}; model of "
              f"{sum(pl.spec.numel for pl in plan.placements.values()) / 1e6:.2f}M parameters\n")

    from tqdm import tqdm
    bar = tqdm(range(args.steps), disable=rank != 0, unit="step", file=sys.stdout)
    losses, step_ms, tok_s, step_bytes = [], [], [], []
    for step in bar:
        x = batch_at(corpus, step, rank, world, args.batch, args.seq, args.seed).to(device)
        stats.reset()
        t0 = time.perf_counter()
        loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        _sync(device)
        t2 = time.perf_counter()
        step_bytes.append(sum(stats.payload_bytes.values()))
        step_calls = dict(stats.calls)
        step_ms.append((t2 - t1) * 1e3)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # for the log only; not part of the step
        losses.append(mean_loss.item() / world)
        tok_s.append(world * args.batch * args.seq / (t2 - t0))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tok_s[-1]:.0f}")

    with torch.no_grad():
        x = batch_at(corpus, 0, rank, world, args.batch, args.seq, args.seed, "val").to(device)
        val = model.loss(x[:, :-1], x[:, 1:]).detach()
        dist.all_reduce(val)
    step_ms_all: list = [None] * world
    dist.all_gather_object(step_ms_all, statistics.median(step_ms[1:] or step_ms))
    if rank == 0:
        k = max(1, min(5, len(losses) // 4))
        summary = {
            "ranks": world, "steps": args.steps, "device": device.type,
            "loss_start": statistics.mean(losses[:k]), "loss_end": statistics.mean(losses[-k:]),
            "val_loss_end": val.item() / world,
            "optimizer_step_ms_median_per_rank": step_ms_all,
            "tokens_per_s_median": statistics.median(tok_s[1:] or tok_s),
            "bytes_per_step": statistics.median(step_bytes),
            "collectives_per_step": step_calls,
            "plan_imbalance": plan.imbalance, "plan_imbalance_bound": plan.imbalance_bound,
            "losses": losses,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print("\n== summary ==")
        print(f"loss (mean of first/last {k} steps): {summary['loss_start']:.3f} -> "
              f"{summary['loss_end']:.3f}  (held-out: {summary['val_loss_end']:.3f}; "
              f"uniform bytes would be {torch.log(torch.tensor(256.0)).item():.3f})")
        print("optimizer step (median ms per rank, no collectives): "
              + ", ".join(f"r{r} {t:.1f}" for r, t in enumerate(step_ms_all)))
        print(f"communicated per step per rank: {summary['bytes_per_step'] / 2**20:.2f} MiB payload "
              f"in {sum(step_calls.values())} collectives ({step_calls})")
        print(f"plan balance: NS-cost max/mean {plan.imbalance:.3f} (lower bound "
              f"{plan.imbalance_bound:.3f})")
        print(f"throughput: {summary['tokens_per_s_median']:.0f} tokens/s; results in {out}/summary.json")


# ---- plan ---------------------------------------------------------------------------------
def _plan(args) -> None:
    from matrixfsdp.models import GPT, PRESETS
    from matrixfsdp.plan import format_report, plan_module

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(PRESETS[args.model])
    plan = plan_module(model, list(model.layers), args.world_size)
    elapsed = time.perf_counter() - t0
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {n / 1e9:.2f}B parameters, {len(model.layers)} blocks, planned on the "
          f"meta device for {args.world_size} ranks in {elapsed:.2f} s\n")
    print(format_report(plan, max_rows=args.max_rows))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(prog="matrixfsdp", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train a byte-level GPT on the stdlib sources")
    tr.add_argument("--ranks", type=int, default=4)
    tr.add_argument("--steps", type=int, default=60)
    tr.add_argument("--layers", type=int, default=4)
    tr.add_argument("--d-model", type=int, default=128)
    tr.add_argument("--heads", type=int, default=4)
    tr.add_argument("--mlp", type=int, default=512)
    tr.add_argument("--seq", type=int, default=128)
    tr.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    tr.add_argument("--lr", type=float, default=0.02)
    tr.add_argument("--adamw-lr", type=float, default=3e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", default="runs/train")
    pl = sub.add_parser("plan", help="plan a known model on the meta device")
    from matrixfsdp.models import PRESETS
    pl.add_argument("--model", choices=sorted(PRESETS), default="paper")
    pl.add_argument("--world-size", type=int, default=8)
    pl.add_argument("--max-rows", type=int, default=16)
    sub.add_parser("bench", help="benchmark against FSDP2 peers (see --help)", add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "bench":
        from matrixfsdp.bench.harness import main as bench_main
        return bench_main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "train":
        launch(_train, args, args.ranks)
    else:
        _plan(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
