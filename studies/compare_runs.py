"""Training runs side by side: loss and largest attention logit per step, from the
``summary.json`` of ``matrixfsdp train`` runs.

``python -m studies.compare_runs LABEL=DIR ... [--out runs/compare.png]``
prints a table (loss over the first and last 20 steps, held-out loss, largest logit) and
draws the two curves per run (the loss smoothed over 10 steps). The per-head / QK-clip
comparison of docs/optimizers.md is three ``matrixfsdp train`` runs compared this way
(``make docs-figures`` runs them). Output goes to ``runs/``, never over tracked files.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _smooth(xs: list[float], k: int = 10) -> list[float]:
    return [statistics.mean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def read_run(spec: str) -> tuple[str, dict]:
    label, _, path = spec.partition("=")
    return label, json.loads((Path(path) / "summary.json").read_text())


def table(runs: list[tuple[str, dict]]) -> str:
    lines = ["| run | loss, steps 1-20 | loss, last 20 | held-out loss | largest logit (step) |",
             "|---|---|---|---|---|"]
    for label, s in runs:
        losses, ml = s["losses"], s.get("max_logits") or []
        peak = f"{max(ml):.2f} ({ml.index(max(ml)) + 1})" if ml else "-"
        lines.append(f"| {label} | {statistics.mean(losses[:20]):.3f} | "
                     f"{statistics.mean(losses[-20:]):.3f} | {s['val_loss_end']:.3f} | {peak} |")
    return "\n".join(lines)


def plot(runs: list[tuple[str, dict]], path: Path) -> None:
    import matplotlib  # optional dependency (the bench extra)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, s in runs:
        ax1.plot(range(1, len(s["losses"]) + 1), _smooth(s["losses"]), label=label)
        if s.get("max_logits"):
            ax2.plot(range(1, len(s["max_logits"]) + 1), s["max_logits"], label=label)
    taus = {s.get("qk_clip_tau") for _, s in runs} - {None, float("inf")}
    for tau in taus:
        ax2.axhline(tau, color="grey", linestyle=":", linewidth=1)
    ax1.set(xlabel="step", ylabel="training loss (10-step mean)", title="loss")
    ax2.set(xlabel="step", ylabel="largest pre-softmax logit", title="attention logits")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m studies.compare_runs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="LABEL=DIR", help="a label and a train run's --out")
    ap.add_argument("--out", default="runs/compare.png", help="the plot (default: runs/compare.png)")
    args = ap.parse_args(argv)
    runs = [read_run(spec) for spec in args.runs]
    print(table(runs))
    plot(runs, Path(args.out))
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
