"""The training loop of ``matrixfsdp train``, one rank's part: set-up, steps, checkpoints
(``--save-every``, ``--resume``) and the final evaluation."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..diagnosis import arrival
from ..optim.groups import muon_param_groups
from ..optim.muon import Muon
from ..optim.qk_clip import QKClip
from ..runtime.module import comm_stats, plan_of, plan_report
from ..state.files import (
    AsyncCheckpoint,
    checkpoint_dir,
    latest_checkpoint,
    save_checkpoint,
    wait_for_checkpoint,
)
from ..state.state_dict import get_state_dict
from .demo import batch_at, build_model, data_rank, stdlib_corpus
from .launch import device_for, sync
from .nonfinite import (
    NonFiniteError,
    clip_and_check,
    nonfinite_state,
    state_message,
    stop_message,
)
from .report import _rss_mib, write_summary
from .resume import load_start, saved_args, start_point


@dataclass
class Run:
    """What one rank trains with."""

    args: Any
    rank: int
    world: int
    device: torch.device
    model: nn.Module
    loss_fn: Any
    opt: torch.optim.Optimizer
    sched: Any
    plan: Any
    corpus: torch.Tensor
    stats: Any
    qk_clip: Any = None  # --qk-clip: matrixfsdp.QKClip
    dp_rank: int = 0  # which rows of the global batch this rank reads (tp ranks alike)
    dp_size: int = 1


@dataclass
class History:
    """Per-step figures (losses, norms, skips restored from a checkpoint on --resume)."""

    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    tok_s: list[float] = field(default_factory=list)
    step_bytes: list[int] = field(default_factory=list)
    step_calls: dict[str, int] = field(default_factory=dict)
    rss_steps: list[int] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)
    saves: list[Any] = field(default_factory=list)  # committed checkpoints
    step_wall_ms: list[float] = field(default_factory=list)  # each whole step with its save's blocking part
    save_steps: list[int] = field(default_factory=list)
    max_logits: list[float] = field(default_factory=list)  # --qk-clip: the step's largest, before clipping


# ---- checkpoints (--save-every, --resume) -----------------------------------------------------
def checkpoint_root(args) -> Path:
    """Where ``train`` saves: ``<out>/checkpoints``."""
    return Path(args.out) / "checkpoints"


def _train_state(model, opt, sched, meta: dict) -> dict:
    """What a `train` checkpoint holds: model and optimizer by name (DCP, any world size),
    the lr schedule, and the run's history as a JSON string (step, losses, norms, skips)."""

    return {**get_state_dict(model, opt), "sched": sched.state_dict(), "train": json.dumps(meta)}


def _resume(run: Run) -> tuple[int, dict, Path | None]:
    """Load the checkpoint the ranks chose (``args.resume_from``:
    :func:`matrixfsdp.train.resume.start_point`), each rank checking the files it reads
    (:func:`matrixfsdp.train.resume.load_start`): (step to start at, history, checkpoint).
    Saved at any world size; none chosen: step 0."""

    if getattr(run.args, "resume_from", None) is None:
        return 0, {}, None
    arrival.at(getattr(run.args, "resume_step", None), "resume")  # where a hang here is seen
    state = load_start(run.model, run.opt, {"sched": run.sched.state_dict(), "train": ""}, run.args)
    found = run.args.resume_from  # an older one, where --resume-fallback skipped it
    run.sched.load_state_dict(state["sched"])
    meta = json.loads(state["train"])
    if run.rank == 0:
        print(f"resumed from {found} (step {meta['step']}, saved at {meta.get('world_size')} ranks; "
              f"now {run.world})")
    return int(meta["step"]), meta, Path(found)


def _save(run: Run, meta: dict):
    """Save the run's state after step ``meta["step"]`` into ``<out>/checkpoints/step_N``."""
    args, step = run.args, meta["step"]
    return save_checkpoint(_train_state(run.model, run.opt, run.sched, meta),
                              checkpoint_dir(checkpoint_root(args), step),
                              async_save=getattr(args, "async_save", False),
                              keep_last=getattr(args, "keep_last", None))


def _report_save(bar, saved) -> None:
    """One line per committed checkpoint (rank 0)."""
    if dist.get_rank() == 0:
        waited = saved.blocking_seconds
        bar.write(f"checkpoint {saved.path}: {saved.bytes / 2**20:.2f} MiB in {saved.seconds:.2f} s"
                  + (f" (the loop waited {waited:.2f} s)" if waited is not None and waited < saved.seconds
                     else ""))


# ---- the loop -------------------------------------------------------------------------------
def _setup(args) -> Run:


    rank, world = dist.get_rank(), dist.get_world_size()
    device = device_for(int(os.environ.get("LOCAL_RANK", rank)))
    tp = getattr(args, "tp", 1)
    mesh = torch.distributed.device_mesh.init_device_mesh(
        device.type, (world // tp, tp) if tp > 1 else (world,),
        mesh_dim_names=("dp", "tp") if tp > 1 else None)
    model, loss_fn = build_model(args, device, mesh)
    opt = Muon(muon_param_groups(model, lr=args.lr, adamw_lr=args.adamw_lr,
                                       weight_decay=0.1, adamw_weight_decay=0.01,
                                       adamw_betas=(0.9, 0.95),
                                       per_head=getattr(args, "per_head", False)))
    tau = getattr(args, "qk_clip", None)
    qk_clip = QKClip(model, tau=tau, optimizer=opt) if tau is not None else None
    warm = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.1, 1 - s / args.steps))
    run = Run(args, rank, world, device, model, loss_fn, opt, sched, plan_of(model),
              stdlib_corpus(), comm_stats(model), qk_clip, *data_rank(mesh))
    if rank == 0:
        print(plan_report(model))
        if getattr(args, "per_head", False):
            print("per-head Muon: " + "; ".join(f"{len(g['params'])} matrices in {g['num_heads']} heads"
                                              for g in opt.param_groups if g.get("num_heads")))
        print(f"\ncorpus: {len(run.corpus) / 1e6:.1f} MB of the Python standard library's sources; "
              f"{world} ranks on {device.type}; {args.model} model of "
              f"{sum(pl.spec.numel for pl in run.plan.placements.values()) / 1e6:.2f}M parameters\n")
    return run


def _step(run: Run, step: int, hist: History, bar) -> None:
    """One optimizer step of ``--grad-accum`` micro-batches, its figures into ``hist``."""
    args, device, accum = run.args, run.device, run.args.grad_accum
    run.stats.reset()
    t0 = time.perf_counter()
    loss_sum = torch.zeros((), device=device)
    # each phase said, for a hang's "last seen" (steps 1-based, as the bar and checkpoint names)
    arrival.at(step + 1, "forward and backward")
    for k in range(accum):  # K micro-batches, each (loss / K).backward()
        x = batch_at(run.corpus, step * accum + k, run.dp_rank, run.dp_size, args.batch, args.seq,
                     args.seed)
        loss = run.loss_fn(x.to(device))
        (loss / accum).backward()
        loss_sum += loss.detach().float()
    # the loss summed over the ranks (for the log), a non-finite check: before anything is scaled
    arrival.at(step + 1, "step check")
    checked = clip_and_check(run.model, args.clip, args.skip_nonfinite, loss_sum)
    norm, nonfinite = checked.norm, checked.nonfinite
    if nonfinite is not None and not args.skip_nonfinite:
        wait_for_checkpoint()  # an asynchronous save in flight (an earlier, finite step) commits first
        every = getattr(args, "save_every", 0)
        newest = latest_checkpoint(checkpoint_root(args), warn=False) if every else None
        raise NonFiniteError(stop_message(step + 1, nonfinite, newest, bool(every)))
    sync(device)
    t1 = time.perf_counter()
    arrival.at(step + 1, "optimizer step")
    if nonfinite is None:
        run.opt.step()
        run.sched.step()  # a skipped step does not advance the lr schedule
    run.opt.zero_grad(set_to_none=True)
    sync(device)
    t2 = time.perf_counter()
    if nonfinite is not None:
        hist.skipped.append(nonfinite.record(step + 1))
        if run.rank == 0:
            bar.write(f"step {step + 1}: gradient norm is not finite, step skipped on every rank; "
                      f"{nonfinite.describe()}")
    if norm is not None:
        hist.norms.append(norm.item())
    if run.qk_clip is not None and run.qk_clip.last_max:
        hist.max_logits.append(torch.cat(list(run.qk_clip.last_max.values())).max().item())
    hist.step_bytes.append(sum(run.stats.payload_bytes.values()))
    hist.step_calls = dict(run.stats.calls)
    hist.step_ms.append((t2 - t1) * 1e3)
    hist.losses.append(checked.loss_sum / (run.world * accum))
    hist.tok_s.append(run.dp_size * accum * args.batch * args.seq / (t2 - t0))
    bar.set_postfix(loss=f"{hist.losses[-1]:.3f}", tok_s=f"{hist.tok_s[-1]:.0f}")
    if args.rss_every and (step + 1) % args.rss_every == 0:
        hist.rss_steps.append(step + 1)
        hist.rss.append(_rss_mib())


def _maybe_save(run: Run, step: int, hist: History, pending, bar):
    """The ``--save-every`` checkpoint after ``step`` (0-based) if one is due; returns the
    asynchronous save now in flight (None if none)."""
    every = getattr(run.args, "save_every", 0)
    if not every or ((step + 1) % every and step + 1 != run.args.steps):
        return pending
    arrival.at(step + 1, "checkpoint save")
    if pending is not None:  # the previous asynchronous save: wait for it (the next save would)
        hist.saves.append(pending.result())
        _report_save(bar, hist.saves[-1])
    bad = nonfinite_state(run.model, run.opt)  # a collective; never commit a non-finite state
    if bad:
        raise NonFiniteError(state_message(step + 1, bad, latest_checkpoint(checkpoint_root(run.args),
                                                                            warn=False)))
    saved = _save(run, {"step": step + 1, "world_size": run.world, "losses": hist.losses,
                        "norms": hist.norms, "skipped": hist.skipped, "args": saved_args(run.args)})
    hist.save_steps.append(step + 1)
    if isinstance(saved, AsyncCheckpoint):
        return saved  # staged: training goes on while it writes and commits
    hist.saves.append(saved)
    _report_save(bar, saved)
    return None


def train(args) -> None:
    """``matrixfsdp train`` on this rank (every rank calls it, the process group set up)."""
    from tqdm import tqdm

    arrival.at(None, "resume")
    start_point(args)  # --resume: which checkpoint, read by rank 0 (before the model is built)
    run = _setup(args)
    hist = History()
    start, history, resumed = _resume(run)
    hist.losses += history.get("losses", [])
    hist.norms += history.get("norms", [])
    hist.skipped += history.get("skipped", [])
    if start >= args.steps:
        if run.rank == 0:
            print(f"the checkpoint is at step {start}, --steps is {args.steps}: nothing to train")
        return
    # a thread lock, not tqdm's default multiprocessing one: a rank ended by a signal would
    # leave its semaphore to the launcher's resource tracker ("leaked semaphore" at exit)
    tqdm.set_lock(threading.RLock())
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=run.rank != 0,
               unit="step", file=sys.stdout)
    pending = None  # an asynchronous save in flight
    for step in bar:
        t0 = time.perf_counter()
        _step(run, step, hist, bar)
        pending = _maybe_save(run, step, hist, pending, bar)
        hist.step_wall_ms.append((time.perf_counter() - t0) * 1e3)
    if pending is not None:  # the last asynchronous save: committed before the run ends
        hist.saves.append(pending.result())
        _report_save(bar, hist.saves[-1])
    arrival.at(args.steps, "evaluation and summary")
    with torch.no_grad():
        x = batch_at(run.corpus, 0, run.dp_rank, run.dp_size, args.batch, args.seq, args.seed, "val")
        val = run.loss_fn(x.to(run.device)).detach().float()
        with arrival.Point(dist.group.WORLD, "held-out loss all_reduce"):
            dist.all_reduce(val)
    where = None if resumed is None else {"path": str(resumed), "step": start,
                                           "world_size": history.get("world_size")}
    write_summary(run, hist, val.item() / run.world, where)
    if not math.isfinite(hist.losses[-1]):  # only with --skip-nonfinite: without, the step stopped
        sys.stdout.flush()
        with arrival.Point(dist.group.WORLD, "summary barrier"):
            dist.barrier()  # rank 0's summary is out before a rank stops the run
        skipped = len(hist.skipped)
        raise NonFiniteError(
            f"the last step's loss (step {args.steps}) is not finite; {skipped} of "
            f"{len(hist.losses)} steps were skipped by --skip-nonfinite (none of them reached the "
            "weights); summary.json is written. Lower --lr/--adamw-lr, or --clip")
