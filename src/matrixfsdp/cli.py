"""``matrixfsdp train | plan | bench``: thin wrappers over the library."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import signal
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._exit import exit_rank
from .ranks import device_for as _device_for  # shared with the bench, which must not import the CLI
from .ranks import positive_float as _positive_float
from .ranks import sync as _sync

log = logging.getLogger("matrixfsdp")

DEFAULT_TIMEOUT_S = 300.0  # process-group timeout of `train`, spawned and under torchrun alike
STOP_GRACE_S = 5.0  # after SIGTERM, how long a rank may take to end before SIGKILL


# ---- launching ---------------------------------------------------------------------------
def _spawned(rank: int, fn, world_size: int, init_file: str, args, timeout_s: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    _device_for(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        fn(args)
    finally:
        dist.destroy_process_group()
    exit_rank(0)  # finished: leave without interpreter finalization (see _exit.py)


class _Stopped(BaseException):
    """The launcher received SIGTERM: stop the ranks, then exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop_ranks(processes) -> None:
    """SIGTERM every live rank, SIGKILL those still alive after :data:`STOP_GRACE_S`, reap all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def _join_ranks(ctx, prog: str) -> None:
    """Wait for every rank. The first rank to fail ends the others (torch's ``join`` does
    that) and this launcher with a one-line error naming it; SIGTERM or Ctrl-C to the
    launcher ends every rank before the launcher exits, so no rank outlives it."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    def on_sigterm(signum, frame):
        raise _Stopped(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        while not ctx.join(timeout=1.0):
            pass
    except ProcessRaisedException as e:
        print(e.msg.strip(), file=sys.stderr)  # the rank's own traceback
        last = e.msg.strip().splitlines()[-1] if e.msg.strip() else "an exception"
        raise SystemExit(f"{prog}: rank {e.error_index} (pid {e.error_pid}) failed: {last}; "
                         "the other ranks were stopped") from None
    except ProcessExitedException as e:
        how = (f"was killed by signal {e.signal_name}" if e.signal_name
               else f"exited with code {e.exit_code}")
        raise SystemExit(f"{prog}: rank {e.error_index} (pid {e.error_pid}) {how}; "
                         "the other ranks were stopped") from None
    except (KeyboardInterrupt, _Stopped) as e:
        _stop_ranks(ctx.processes)
        signum = e.signum if isinstance(e, _Stopped) else signal.SIGINT
        print(f"{prog}: stopped by {signal.Signals(signum).name}; all ranks ended", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def launch(fn, args, world_size: int, timeout_s: float | None = None) -> None:
    """Run ``fn(args)`` on ``world_size`` ranks: in place under torchrun (RANK is set),
    else as local processes (gloo on CPU, NCCL on CUDA). ``timeout_s`` (default
    ``args.timeout``, else :data:`DEFAULT_TIMEOUT_S`) is the process group's timeout in both
    cases: a collective waiting longer for a peer fails instead of hanging."""
    if timeout_s is None:
        timeout_s = getattr(args, "timeout", None) or DEFAULT_TIMEOUT_S
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        _device_for(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
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
        ctx = torch.multiprocessing.start_processes(
            _spawned, args=(fn, world_size, os.path.join(tmp, "init"), args, timeout_s),
            nprocs=world_size, join=False, start_method="spawn")
        _join_ranks(ctx, f"matrixfsdp {getattr(args, 'cmd', None) or 'launch'}")


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


# ---- model --------------------------------------------------------------------------------
def checkpoint_forward(block: nn.Module) -> None:
    """Activation checkpointing the way transformers does it: the block's ``forward`` runs
    inside torch's non-reentrant ``checkpoint``, its MatrixFSDP hooks stay outside, so
    backward recomputes the block with the parameters its pre-backward gathered. Parameter
    names do not change."""
    from torch.utils.checkpoint import checkpoint
    forward = block.forward

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    block.forward = checkpointed


def build_model(args, device: torch.device, mesh) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """The sharded model of ``args.model`` and its loss: ``loss_fn(x)`` with ``x`` of shape
    ``(batch, seq + 1)`` bytes, the mean cross-entropy of predicting ``x[:, 1:]`` from the
    prefixes (``seq`` targets per row, for both models)."""
    import matrixfsdp as mf

    shard_kw: dict[str, Any] = {}
    if args.mp == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy
        shard_kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.float32)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    if args.model == "hf-llama":
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError as e:
            raise SystemExit(f"--model hf-llama needs transformers: {e}") from None
        cfg = LlamaConfig(vocab_size=256, hidden_size=args.d_model, num_attention_heads=args.heads,
                          num_key_value_heads=args.heads, num_hidden_layers=args.layers,
                          intermediate_size=args.mlp, max_position_embeddings=args.seq + 1,
                          tie_word_embeddings=False, use_cache=False)
        model = LlamaForCausalLM(cfg).to(device)
        if args.activation_checkpointing:  # HF's own switch: each decoder layer's whole call
            kw = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        mf.shard_model(model, mesh=mesh, debug=args.debug, **shard_kw)

        # HF shifts the labels itself (logits[:, t] predicts labels[:, t + 1]), so the seq + 1
        # bytes go in as both input and labels: the targets are x[:, 1:], as for the GPT.
        def loss_fn(x: torch.Tensor) -> torch.Tensor:
            return model(input_ids=x, labels=x, use_cache=False).loss
        return model, loss_fn

    from matrixfsdp.models import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, d_model=args.d_model, n_heads=args.heads,
                    n_layers=args.layers, d_mlp=args.mlp)
    model = GPT(cfg).to(device)
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh, **shard_kw)
        if args.activation_checkpointing:
            checkpoint_forward(block)
    mf.fully_shard(model, mesh=mesh, debug=args.debug, **shard_kw)

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        return model.loss(x[:, :-1], x[:, 1:])
    return model, loss_fn


# ---- train --------------------------------------------------------------------------------
def clip_and_check(model: nn.Module, clip: float | None, skip_nonfinite: bool
                   ) -> tuple[torch.Tensor | None, list[str] | None]:
    """After backward: clip to the global grad norm ``clip`` (if given) and, with
    ``skip_nonfinite``, say whether the step must be skipped. A collective.

    Returns ``(norm, nonfinite)``: the global norm before clipping (None if neither option
    is on), and None when the step may go ahead, else the names of the parameters with
    non-finite gradients (the same list on every rank; empty if only the norm overflowed).
    The names are read before any scaling: a non-finite norm would turn every gradient
    into NaN when applied (torch's semantics), hiding which ones were bad."""
    import matrixfsdp as mf

    if clip is None and not skip_nonfinite:
        return None, None
    if not skip_nonfinite:  # a bad norm is applied, as in torch
        return mf.clip_grad_norm_(model.parameters(), clip).detach(), None
    norm = mf.total_grad_norm(model.parameters())  # global: every rank takes the same branch
    if not torch.isfinite(norm):
        return norm, mf.nonfinite_grad_names(model.parameters())
    if clip is not None:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip, norm)
    return norm, None


def _rss_mib() -> float:
    """This process's resident set size in MiB (Linux; NaN elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def plot_losses(losses: list[float], path: Path) -> bool:
    """Write the loss curve to ``path``; without matplotlib, say so in one line and skip.
    Never raises: a plot is not worth losing a run for."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{path.name} skipped: matplotlib is not installed (pip install matplotlib)")
        return False
    try:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(losses) + 1), losses)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (nats/byte)")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return True
    except Exception as e:  # a broken backend or font cache: report, keep the summary
        print(f"{path.name} skipped: {type(e).__name__}: {e}")
        return False


def _finite_or_none(obj: Any) -> Any:
    """``obj`` with NaN/inf floats replaced by None, so summary.json is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def _all_gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (same length on every rank), as a tensor collective."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


# ---- checkpoints (--save-every, --resume) -----------------------------------------------------
STALL_SAVE_ENV = "MATRIXFSDP_TEST_STALL_SAVE"  # test only: the last rank stalls in the save of step N


def _checkpoint_root(args) -> Path:
    return Path(args.out) / "checkpoints"


def _train_state(model, opt, sched, meta: dict) -> dict:
    """What a `train` checkpoint holds: model and optimizer by name (DCP, any world size),
    the lr schedule, and the run's history as a JSON string (step, losses, norms, skips)."""
    import matrixfsdp as mf
    return {**mf.get_state_dict(model, opt), "sched": sched.state_dict(), "train": json.dumps(meta)}


def _resume(args, model, opt, sched) -> tuple[int, dict, Path | None]:
    """Load the latest complete checkpoint under ``--resume`` (default: <out>/checkpoints):
    (step to start at, history, checkpoint). Saved at any world size; none found: step 0."""
    import torch.distributed.checkpoint as dcp

    import matrixfsdp as mf
    where = Path(args.resume) if args.resume else _checkpoint_root(args)
    found = mf.latest_checkpoint(where)
    if found is None:
        if dist.get_rank() == 0:
            print(f"--resume: no complete checkpoint in {where}; starting from step 0")
        return 0, {}, None
    state = _train_state(model, opt, sched, {})
    dcp.load(state, checkpoint_id=str(found))
    mf.set_state_dict(model, opt, state)
    sched.load_state_dict(state["sched"])
    meta = json.loads(state["train"])
    if dist.get_rank() == 0:
        print(f"resumed from {found} (step {meta['step']}, saved at {meta.get('world_size')} ranks; "
              f"now {dist.get_world_size()})")
    return int(meta["step"]), meta, found


def _save(args, model, opt, sched, meta: dict):
    import matrixfsdp as mf
    step = meta["step"]
    stall = None
    if os.environ.get(STALL_SAVE_ENV) == str(step) and dist.get_rank() == dist.get_world_size() - 1:
        def stall() -> None:  # data written, not committed: the test kills this rank here
            (Path(args.out) / "stalled_rank.pid").write_text(str(os.getpid()))
            time.sleep(600)
    return mf.save_checkpoint(_train_state(model, opt, sched, meta),
                              mf.checkpoint.checkpoint_dir(_checkpoint_root(args), step),
                              before_commit=stall, async_save=getattr(args, "async_save", False))


def _report_save(bar, saved) -> None:
    """One line per committed checkpoint (rank 0)."""
    if dist.get_rank() == 0:
        waited = saved.blocking_seconds
        bar.write(f"checkpoint {saved.path}: {saved.bytes / 2**20:.2f} MiB in {saved.seconds:.2f} s"
                  + (f" (the loop waited {waited:.2f} s)" if waited is not None and waited < saved.seconds
                     else ""))


def _train(args) -> None:
    import matrixfsdp as mf

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device_for(int(os.environ.get("LOCAL_RANK", rank)))
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world,))
    model, loss_fn = build_model(args, device, mesh)
    opt = mf.Muon(mf.muon_param_groups(model, lr=args.lr, adamw_lr=args.adamw_lr,
                                       weight_decay=0.1, adamw_weight_decay=0.01,
                                       adamw_betas=(0.9, 0.95)))
    warm = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.1, 1 - s / args.steps))
    plan = mf.plan_of(model)
    corpus = stdlib_corpus()
    stats = mf.comm_stats(model)
    accum = args.grad_accum
    if rank == 0:
        print(mf.plan_report(model))
        print(f"\ncorpus: {len(corpus) / 1e6:.1f} MB of the Python standard library's sources; "
              f"{world} ranks on {device.type}; {args.model} model of "
              f"{sum(pl.spec.numel for pl in plan.placements.values()) / 1e6:.2f}M parameters\n")

    from tqdm import tqdm
    losses, step_ms, tok_s, step_bytes, norms, skipped = [], [], [], [], [], []
    rss_steps, rss = [], []
    resume = getattr(args, "resume", None)
    start, history, resumed = _resume(args, model, opt, sched) if resume is not None else (0, {}, None)
    losses += history.get("losses", [])
    norms += history.get("norms", [])
    skipped += history.get("skipped", [])
    saves, pending = [], None  # committed checkpoints; an asynchronous save in flight
    step_wall_ms, save_steps = [], []  # each whole step with its save's blocking part (rank 0's)
    if start >= args.steps:
        if rank == 0:
            print(f"the checkpoint is at step {start}, --steps is {args.steps}: nothing to train")
        return
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=rank != 0, unit="step",
               file=sys.stdout)
    for step in bar:
        stats.reset()
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for k in range(accum):  # K micro-batches, each (loss / K).backward()
            x = batch_at(corpus, step * accum + k, rank, world, args.batch, args.seq, args.seed)
            loss = loss_fn(x.to(device))
            (loss / accum).backward()
            loss_sum += loss.detach().float()
        norm, nonfinite = clip_and_check(model, args.clip, args.skip_nonfinite)
        _sync(device)
        t1 = time.perf_counter()
        if nonfinite is None:
            opt.step()
            sched.step()  # a skipped step does not advance the lr schedule
        opt.zero_grad(set_to_none=True)
        _sync(device)
        t2 = time.perf_counter()
        if nonfinite is not None:
            skipped.append({"step": step, "nonfinite": nonfinite})
            if rank == 0:
                names = ", ".join(nonfinite[:8]) + (f" and {len(nonfinite) - 8} more" if len(nonfinite) > 8
                                                     else "")
                bar.write(f"step {step}: gradient norm is not finite, step skipped on every rank; "
                          f"non-finite gradients: {names or 'none (the norm overflowed)'}")
        if norm is not None:
            norms.append(norm.item())
        step_bytes.append(sum(stats.payload_bytes.values()))
        step_calls = dict(stats.calls)
        step_ms.append((t2 - t1) * 1e3)
        dist.all_reduce(loss_sum)  # for the log only; not part of the step
        losses.append(loss_sum.item() / (world * accum))
        tok_s.append(world * accum * args.batch * args.seq / (t2 - t0))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tok_s[-1]:.0f}")
        if args.rss_every and (step + 1) % args.rss_every == 0:
            rss_steps.append(step + 1)
            rss.append(_rss_mib())
        every = getattr(args, "save_every", 0)
        if every and ((step + 1) % every == 0 or step + 1 == args.steps):
            if pending is not None:  # the previous asynchronous save: wait for it (the next save would)
                saves.append(pending.result())
                _report_save(bar, saves[-1])
            saved = _save(args, model, opt, sched, {
                "step": step + 1, "world_size": world, "losses": losses, "norms": norms, "skipped": skipped})
            save_steps.append(step + 1)
            if isinstance(saved, mf.checkpoint.AsyncCheckpoint):
                pending = saved  # staged: training goes on while it writes and commits
            else:
                saves.append(saved)
                _report_save(bar, saved)
        step_wall_ms.append((time.perf_counter() - t0) * 1e3)

    if pending is not None:  # the last asynchronous save: committed before the run ends
        saves.append(pending.result())
        _report_save(bar, saves[-1])

    with torch.no_grad():
        x = batch_at(corpus, 0, rank, world, args.batch, args.seq, args.seed, "val").to(device)
        val = loss_fn(x).detach().float()
        dist.all_reduce(val)
    step_ms_all = [r[0] for r in _all_gather_floats([statistics.median(step_ms[1:] or step_ms)], device)]
    rss_all = _all_gather_floats(rss, device) if args.rss_every else None
    if rank == 0:
        k = max(1, min(5, len(losses) // 4))
        summary = {
            "ranks": world, "steps": args.steps, "device": device.type, "model": args.model,
            "grad_accum": accum, "mp": args.mp, "activation_checkpointing": args.activation_checkpointing,
            "clip": args.clip,
            "loss_start": statistics.mean(losses[:k]), "loss_end": statistics.mean(losses[-k:]),
            "val_loss_end": val.item() / world,
            "optimizer_step_ms_median_per_rank": step_ms_all,
            "tokens_per_s_median": statistics.median(tok_s[1:] or tok_s),
            "bytes_per_step": statistics.median(step_bytes),
            "collectives_per_step": step_calls,
            "plan_imbalance": plan.imbalance, "plan_imbalance_bound": plan.imbalance_bound,
            "losses": losses,
        }
        if norms:
            summary["grad_norms"] = norms  # global, before clipping; null where not finite
        if args.skip_nonfinite:
            summary["skipped_steps"] = skipped
        if rss_all is not None:
            summary["rss_mib"] = {"steps": rss_steps, "per_rank": rss_all}
        if resumed is not None:
            summary["resumed_from"] = {"path": str(resumed), "step": start,
                                       "world_size": history.get("world_size")}
        if saves:
            summary["checkpoints"] = [{"path": str(c.path), "seconds": c.seconds, "bytes": c.bytes,
                                       "blocking_seconds": c.blocking_seconds} for c in saves]
            summary["async_save"] = bool(getattr(args, "async_save", False))
        summary["step_wall_ms"] = step_wall_ms  # rank 0, from `start`; a save's blocking part included
        summary["save_steps"] = save_steps
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(_finite_or_none(summary), indent=2, allow_nan=False))
        plotted = plot_losses(losses, out / "loss.png")
        print("\n== summary ==")
        print(f"loss (mean of first/last {k} steps): {summary['loss_start']:.3f} -> "
              f"{summary['loss_end']:.3f}  (held-out: {summary['val_loss_end']:.3f}; "
              f"uniform bytes would be {math.log(256):.3f})")
        print("optimizer step (median ms per rank, no collectives): "
              + ", ".join(f"r{r} {t:.1f}" for r, t in enumerate(step_ms_all)))
        print(f"communicated per step per rank: {summary['bytes_per_step'] / 2**20:.2f} MiB payload "
              f"in {sum(step_calls.values())} collectives ({step_calls})")
        if norms:
            finite = [n for n in norms if math.isfinite(n)]
            if finite:
                print(f"gradient norm (global, before clipping): median {statistics.median(finite):.3f}, "
                      f"max {max(finite):.3f}" + (f"; clipped to {args.clip}" if args.clip else ""))
        if args.skip_nonfinite:
            print(f"steps skipped for non-finite gradients: {len(skipped)}")
        print(f"plan balance: NS-cost max/mean {plan.imbalance:.3f} (lower bound "
              f"{plan.imbalance_bound:.3f})")
        print(f"throughput: {summary['tokens_per_s_median']:.0f} tokens/s; results in {out}/summary.json"
              + (" and loss.png" if plotted else ""))


# ---- plan ---------------------------------------------------------------------------------
def _plan(args) -> None:
    from matrixfsdp.cluster import DTYPE_BYTES, plan_preset, preset_report, preset_table

    for n in args.world_size:
        if args.shard_size is not None and n % args.shard_size:
            raise SystemExit(f"--shard-size {args.shard_size} must divide --world-size {n}")
    gather = DTYPE_BYTES[args.param_dtype] if args.param_dtype else None
    if len(args.model) * len(args.world_size) > 1:
        print(preset_table(args.model, args.world_size, args.shard_size, args.device_memory,
                           gather))
        return
    cp = plan_preset(args.model[0], args.world_size[0], args.shard_size, args.device_memory,
                     gather)
    print(preset_report(cp, args.device_memory, args.max_rows, gather))


# ---- command line -------------------------------------------------------------------------
def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def writable_dir_error(out: str) -> str | None:
    """Why results cannot be written into directory ``out`` (created if missing), or None.
    Checked before any rank starts, so a bad path does not cost a finished run."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".matrixfsdp-write-check-"):
            pass
    except OSError as e:
        return f"--out {out}: cannot write there ({e.strerror or e})"
    return None


def _validate_train(tr: argparse.ArgumentParser, args) -> None:
    if args.d_model % args.heads:
        tr.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.model == "hf-llama":
        if (args.d_model // args.heads) % 2:
            tr.error(f"--model hf-llama needs an even head size for its rotary embedding; "
                     f"--d-model {args.d_model} / --heads {args.heads} = {args.d_model // args.heads}")
        if importlib.util.find_spec("transformers") is None:
            tr.error("--model hf-llama needs transformers (pip install transformers)")
    if os.environ.get("RANK", "0") == "0":  # only rank 0 writes (under torchrun too)
        problem = writable_dir_error(args.out)
        if problem:
            tr.error(problem)
    if getattr(args, "async_save", False) and not args.save_every:
        tr.error("--async-save needs --save-every N (it changes how those checkpoints are written)")
    if getattr(args, "resume", None) and not Path(args.resume).is_dir():
        tr.error(f"--resume {args.resume}: no such directory")


def _bench_out_error(rest: list[str]) -> str | None:
    """``--out`` of ``bench`` (its default too) checked before its ranks start."""
    if "-h" in rest or "--help" in rest:
        return None
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--out", default="runs/bench")  # harness.parse_args's default
    known, _ = pre.parse_known_args(rest)
    return writable_dir_error(known.out)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(prog="matrixfsdp", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train a byte-level model on the stdlib sources")
    pos = _int_at_least(1)
    tr.add_argument("--ranks", type=pos, default=4)
    tr.add_argument("--steps", type=pos, default=60)
    tr.add_argument("--model", choices=("gpt", "hf-llama"), default="gpt",
                    help="gpt: matrixfsdp.models.GPT; hf-llama: a randomly initialised "
                         "transformers LlamaForCausalLM of the same sizes (needs transformers)")
    tr.add_argument("--layers", type=pos, default=4)
    tr.add_argument("--d-model", type=pos, default=128)
    tr.add_argument("--heads", type=pos, default=4)
    tr.add_argument("--mlp", type=pos, default=512)
    tr.add_argument("--seq", type=pos, default=128)
    tr.add_argument("--batch", type=pos, default=8, help="sequences per rank per micro-batch")
    tr.add_argument("--grad-accum", type=pos, default=1, metavar="K",
                    help="micro-batches per step, each backward of loss / K")
    tr.add_argument("--lr", type=float, default=0.02)
    tr.add_argument("--adamw-lr", type=float, default=3e-3)
    tr.add_argument("--clip", type=_positive_float, default=None, metavar="X",
                    help="clip gradients to global norm X (matrixfsdp.clip_grad_norm_)")
    tr.add_argument("--debug", action="store_true",
                    help="before each collective, check every rank is at the same step, unit and "
                         "phase; raise naming the diverging rank (one extra tiny collective each)")
    tr.add_argument("--skip-nonfinite", action="store_true",
                    help="skip the optimizer step on every rank when the global gradient norm "
                         "is NaN/inf, and log which gradients were not finite")
    tr.add_argument("--mp", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    tr.add_argument("--activation-checkpointing", action="store_true",
                    help="recompute each block's activations in backward")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--timeout", type=_positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                    help="process-group timeout: a collective waiting longer fails "
                         f"(default {DEFAULT_TIMEOUT_S:.0f})")
    tr.add_argument("--out", default="runs/train")
    tr.add_argument("--save-every", type=_int_at_least(0), default=0, metavar="N",
                    help="save a checkpoint (torch.distributed.checkpoint, by parameter name) every N "
                         "steps and at the last step, into <out>/checkpoints/step_<N>; a directory is "
                         "complete or ignored")
    tr.add_argument("--async-save", action="store_true",
                    help="with --save-every: stage each checkpoint to CPU memory and write it in the "
                         "background (torch.distributed.checkpoint.async_save) while training goes on")
    tr.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                    help="continue from the latest complete checkpoint in DIR (default "
                         "<out>/checkpoints), saved at any --ranks; none there: start at step 0")
    tr.add_argument("--rss-every", type=_int_at_least(0), default=0, help=argparse.SUPPRESS)
    pl = sub.add_parser("plan", help="plan a known model on the meta device: per-rank memory, "
                        "bytes per step against FSDP2, NS; a recommended HSDP shard size")
    from matrixfsdp.cluster import parse_bytes
    from matrixfsdp.models import PRESETS

    def size(text: str) -> int:
        try:
            return parse_bytes(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    pl.add_argument("--model", nargs="+", choices=sorted(PRESETS), default=["paper"],
                    help="several models and/or world sizes: one summary row each")
    pl.add_argument("--world-size", nargs="+", type=pos, default=[8])
    pl.add_argument("--shard-size", type=pos, default=None,
                    help="HSDP: ranks per shard group (default: the world size, no replicas)")
    pl.add_argument("--device-memory", type=size, default="80GiB",
                    help="memory per device, to say whether the largest rank fits (default 80GiB)")
    pl.add_argument("--param-dtype", choices=("fp32", "bf16"), default=None,
                    help="dtype of the gathers (MixedPrecisionPolicy param_dtype; default the "
                         "model's, fp32); storage, reduce and optimizer state stay fp32")
    pl.add_argument("--max-rows", type=_int_at_least(1), default=16)
    bp = sub.add_parser("bench", help="benchmark against FSDP2 peers (see --help)", add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "bench":
        problem = _bench_out_error(rest)
        if problem:
            bp.error(problem)
        from matrixfsdp.bench.harness import main as bench_main
        return bench_main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "train":
        _validate_train(tr, args)
        launch(_train, args, args.ranks, args.timeout)
    else:
        _plan(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
