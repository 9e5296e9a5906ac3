"""What ``matrixfsdp train`` reports at the end of a run: summary.json, loss.png and the
printed summary (rank 0), from every rank's figures."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..diagnosis import arrival


class SummaryError(RuntimeError):
    """``summary.json`` could not be written: one line naming the file and why."""


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` into ``path`` through a temporary file beside it, flushed to disk and
    then renamed over ``path``: ``path`` holds either what it held before or all of
    ``text``, never a part (before: a full disk left a 0-byte summary.json and a bare
    ENOSPC). Raises :class:`SummaryError` naming ``path``; the temporary file is removed."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        code = errno.errorcode.get(e.errno or -1)
        raise SummaryError(f"cannot write {path}: {e.strerror or e}" + (f" ({code})" if code else "")
                           + f"; {path} was left as it was") from None


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


def _over_ranks(values: list[float], device: torch.device) -> dict[str, list[float]]:
    """Each of ``values`` (the same length on every rank) as its minimum, mean and maximum
    over the ranks: two all-reduces of ``2 len(values)`` numbers, whatever the world size
    (an all-gather of every rank's list would hand each rank P lists)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    total, extremes = t.clone(), torch.cat([t, -t])
    with arrival.Point(dist.group.WORLD, "summary all_reduce"):
        dist.all_reduce(total)
    with arrival.Point(dist.group.WORLD, "summary all_reduce"):
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    n = len(values)
    world = dist.get_world_size()
    return {"min": (-extremes[n:]).tolist(), "mean": (total / world).tolist(),
            "max": extremes[:n].tolist()}


def write_summary(run, hist, val_loss: float, resumed: dict | None) -> None:
    """Gather every rank's figures; on rank 0 write ``<out>/summary.json`` and ``loss.png``
    and print the summary. A collective. ``run`` is :class:`matrixfsdp.train.Run`, ``hist``
    its :class:`matrixfsdp.train.History`; ``resumed``: where the run started from."""
    args, device = run.args, run.device
    step_ms = {k: v[0] for k, v in _over_ranks([statistics.median(hist.step_ms[1:] or hist.step_ms)],
                                               device).items()}
    rss = _over_ranks(hist.rss, device) if args.rss_every else None
    if run.rank != 0:
        return
    summary = _summary(run, hist, val_loss, step_ms)
    if rss is not None:
        summary["rss_mib"] = {"steps": hist.rss_steps, **rss}  # min, mean, max over the ranks
    if resumed is not None:
        summary["resumed_from"] = resumed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "summary.json", json.dumps(_finite_or_none(summary), indent=2, allow_nan=False))
    plotted = plot_losses(hist.losses, out / "loss.png")
    _print_summary(summary, args, run.plan)
    print(f"throughput: {summary['tokens_per_s_median']:.0f} tokens/s; results in {out}/summary.json"
          + (" and loss.png" if plotted else ""))


def _summary(run, hist, val_loss: float, step_ms: dict[str, float]) -> dict[str, Any]:
    args, losses = run.args, hist.losses
    k = max(1, min(5, len(losses) // 4))
    summary: dict[str, Any] = {
        "ranks": run.world, "tp": getattr(args, "tp", 1), "steps": args.steps,
        "device": run.device.type, "model": args.model,
        "grad_accum": args.grad_accum, "mp": args.mp,
        "activation_checkpointing": args.activation_checkpointing, "clip": args.clip,
        "loss_start": statistics.mean(losses[:k]), "loss_end": statistics.mean(losses[-k:]),
        "loss_mean_steps": k, "val_loss_end": val_loss,
        "optimizer_step_ms_median": step_ms,  # each rank's median step: min, mean, max over ranks
        "tokens_per_s_median": statistics.median(hist.tok_s[1:] or hist.tok_s),
        "bytes_per_step": statistics.median(hist.step_bytes),
        "collectives_per_step": hist.step_calls,
        "plan_imbalance": run.plan.imbalance, "plan_imbalance_bound": run.plan.imbalance_bound,
        "losses": losses,
    }
    if hist.norms:
        summary["grad_norms"] = hist.norms  # global, before clipping; null where not finite
    if getattr(args, "qk_clip", None) is not None:
        summary.update(qk_clip_tau=args.qk_clip, max_logits=hist.max_logits)
    summary["per_head"] = bool(getattr(args, "per_head", False))
    if args.skip_nonfinite:
        summary["skipped_steps"] = hist.skipped
    if hist.saves:
        summary["checkpoints"] = [{"path": str(c.path), "seconds": c.seconds, "bytes": c.bytes,
                                   "blocking_seconds": c.blocking_seconds} for c in hist.saves]
        summary["async_save"] = bool(getattr(args, "async_save", False))
    summary["step_wall_ms"] = hist.step_wall_ms  # rank 0, from the start; saves' blocking parts in
    summary["save_steps"] = hist.save_steps
    return summary


def _print_summary(summary: dict[str, Any], args, plan) -> None:
    k, norms = summary["loss_mean_steps"], summary.get("grad_norms", [])
    calls = summary["collectives_per_step"]
    print("\n== summary ==")
    print(f"loss (mean of first/last {k} steps): {summary['loss_start']:.3f} -> "
          f"{summary['loss_end']:.3f}  (held-out: {summary['val_loss_end']:.3f}; "
          f"uniform bytes would be {math.log(256):.3f})")
    ms = summary["optimizer_step_ms_median"]
    print(f"optimizer step (each rank's median ms, no collectives): min {ms['min']:.1f}, mean "
          f"{ms['mean']:.1f}, max {ms['max']:.1f} over {summary['ranks']} ranks")
    print(f"communicated per step per rank: {summary['bytes_per_step'] / 2**20:.2f} MiB payload "
          f"in {sum(calls.values())} collectives ({calls})")
    finite = [n for n in norms if n is not None and math.isfinite(n)]
    if finite:
        print(f"gradient norm (global, before clipping): median {statistics.median(finite):.3f}, "
              f"max {max(finite):.3f}" + (f"; clipped to {args.clip}" if args.clip else ""))
    if args.skip_nonfinite:
        skipped = [s["step"] for s in summary["skipped_steps"]]
        print(f"steps skipped for a non-finite loss or gradients (--skip-nonfinite): {len(skipped)} "
              f"of {len(summary['losses'])}" + (f" (steps {_steps_text(skipped)})" if skipped else ""))
    print(f"plan balance: NS-cost max/mean {plan.imbalance:.3f} (lower bound "
          f"{plan.imbalance_bound:.3f})")


def _steps_text(steps: list[int], shown: int = 8) -> str:
    """``2, 3, 5`` (the first ``shown``, then how many more)."""
    more = f" and {len(steps) - shown} more" if len(steps) > shown else ""
    return ", ".join(map(str, steps[:shown])) + more
