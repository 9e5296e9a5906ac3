"""Training step time with synchronous, asynchronous and no checkpoint saves.

``python -m studies.async_save [--repeats 2] [--ranks 4] [--steps 60]
[--save-every 5] [--out runs/async_save] [-- more matrixfsdp train arguments]``

Runs ``matrixfsdp train`` (the demo's settings unless told otherwise) once per mode and
repetition, the modes interleaved (none, sync, async, none, ...) so that a slow spell of a
shared machine hits them alike:

* ``none``: no checkpoint;
* ``sync``: ``--save-every N`` (``mf.save_checkpoint``: write, barrier, commit, then train on);
* ``async``: ``--save-every N --async-save`` (stage to CPU, train on while a background
  thread writes and commits; the next save and the end of the run wait for it).

From each run's ``summary.json`` (rank 0's wall time of every whole step, a save's blocking
part included, and each checkpoint's times) it reports: the median step over all steps but
the first, over the save steps (for ``none``: the steps that would save), over the steps
right after a save (where a background write competes with training) and over the rest; the
mean step; the whole loop; and per save the median time the loop was held
(``blocking_seconds``) and from the call to the commit (``seconds``). Writes
``DIR/results.json`` and ``DIR/results.md``.

``python -m studies.async_save --group [--ranks 4] [--saves 2]`` measures instead
what the asynchronous save's gloo group costs each rank (linux: sockets in
``/proc/self/fd``): the peers it connects and the seconds it takes to make, then the peers
connected after each asynchronous save, made as gloo does by default (every pair at once:
``TORCH_GLOO_LAZY_INIT=0`` in the ranks' environment, the group as it was made before) and
as ``save_checkpoint`` makes it now (lazily: a pair at its first use). Writes
``DIR/group.json`` and ``DIR/group.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from matrixfsdp.diagnosis.timeouts import twin_group
from matrixfsdp.state.files import save_checkpoint
from matrixfsdp.train.launch import launch

MODES = {"none": [], "sync": ["--save-every"], "async": ["--save-every", "--async-save"]}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _run(mode: str, rep: int, args, extra: list[str]) -> dict:
    out = Path(args.out) / f"{mode}_{rep}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "matrixfsdp", "train", "--ranks", str(args.ranks), "--steps",
           str(args.steps), "--out", str(out), *extra]
    if mode != "none":
        cmd += ["--save-every", str(args.save_every)] + (["--async-save"] if mode == "async" else [])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"[{mode} {rep}] {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{mode} run {rep} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    walls = summary["step_wall_ms"]
    every = args.save_every
    saving = {s for s in range(1, args.steps + 1) if s % every == 0 or s == args.steps}
    if mode != "none":
        assert set(summary["save_steps"]) == saving, (summary["save_steps"], sorted(saving))
    steps = list(range(1, len(walls) + 1))
    rest = [(s, w) for s, w in zip(steps, walls) if s > 1]  # the first step warms up
    ckpts = summary.get("checkpoints", [])
    row = {
        "mode": mode, "repeat": rep,
        "step_ms_median": _median([w for _, w in rest]),
        "save_step_ms_median": _median([w for s, w in rest if s in saving]),
        "after_save_ms_median": _median([w for s, w in rest if s - 1 in saving]),
        "other_ms_median": _median([w for s, w in rest if s not in saving and s - 1 not in saving]),
        "step_ms_mean": statistics.mean(w for _, w in rest),
        "loop_s": sum(walls) / 1e3,
        "save_blocking_s_median": _median([c["blocking_seconds"] for c in ckpts]),
        "save_total_s_median": _median([c["seconds"] for c in ckpts]),
        "saves": len(ckpts),
        "checkpoint_mib": ckpts[0]["bytes"] / 2**20 if ckpts else None,
        "loss_end": summary["loss_end"],
    }
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return row


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    head = ("| mode | run | step median (ms) | save steps | steps after a save | other steps | "
            "step mean (ms) | loop (s) | save: loop held (s) | save: call to commit (s) |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['repeat']} | {_fmt(r['step_ms_median'], '.0f')} | "
            f"{_fmt(r['save_step_ms_median'], '.0f')} | {_fmt(r['after_save_ms_median'], '.0f')} | "
            f"{_fmt(r['other_ms_median'], '.0f')} | {_fmt(r['step_ms_mean'], '.0f')} | "
            f"{_fmt(r['loop_s'], '.1f')} | {_fmt(r['save_blocking_s_median'], '.3f')} | "
            f"{_fmt(r['save_total_s_median'], '.3f')} |")
    return "\n".join(lines)


def open_sockets() -> int:
    """Sockets this process holds (gloo: one per connected peer and group, one listening)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _group_rank(args) -> None:
    """One rank of ``--group``: make the asynchronous save's group as ``save_checkpoint``
    does, then save; each rank's numbers into ``args.out_rank``."""
    rank = dist.get_rank()
    dist.barrier()
    base = open_sockets()
    t = time.perf_counter()
    twin_group(dist.group.WORLD, backend="gloo")  # what save_checkpoint(async_save=True) makes
    # less its listener
    row = {"rank": rank, "make_s": time.perf_counter() - t, "made": open_sockets() - base - 1}
    for i in range(args.saves):
        save_checkpoint({"x": torch.full((4,), float(rank))}, os.path.join(args.ckpt, f"step_{i}"),
                        async_save=True).result()
        row[f"after_save_{i + 1}"] = open_sockets() - base - 1
    with open(os.path.join(args.out_rank, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.barrier()


def group_cost(ranks: int, saves: int) -> list[dict]:
    """Per mode (``full mesh``: gloo's default; ``lazy``: as made now) and rank, the peers the
    asynchronous save's group connected when made and after each save, and the seconds
    making it took."""
    rows = []
    for mode, env in (("full mesh", "0"), ("lazy", None)):
        with tempfile.TemporaryDirectory() as tmp:
            ns = argparse.Namespace(out_rank=tmp, ckpt=os.path.join(tmp, "ckpt"), saves=saves)
            before = os.environ.get("TORCH_GLOO_LAZY_INIT")
            if env is not None:
                os.environ["TORCH_GLOO_LAZY_INIT"] = env  # the ranks inherit it: the user's choice
            try:
                launch(_group_rank, ns, ranks, timeout_s=120)
            finally:
                os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
                if before is not None:
                    os.environ["TORCH_GLOO_LAZY_INIT"] = before
            for r in range(ranks):
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    rows.append({"mode": mode, **json.load(f)})
    return rows


def group_table(rows: list[dict], saves: int) -> str:
    after = [f"after save {i + 1}" for i in range(saves)]
    lines = ["| group | rank | peers connected when made | making it (ms) | " + " | ".join(
        f"peers {a}" for a in after) + " |", "|---|---:|---:|---:|" + "---:|" * saves]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['rank']} | {r['made']} | {1e3 * r['make_s']:.1f} | "
                     + " | ".join(str(r[f"after_save_{i + 1}"]) for i in range(saves)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m studies.async_save", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--out", default="runs/async_save")
    ap.add_argument("--group", action="store_true",
                    help="measure the asynchronous save's group (peers, time) instead of steps")
    ap.add_argument("--saves", type=int, default=2, help="with --group: saves after making it")
    args = ap.parse_args(argv)
    if args.group:
        rows = group_cost(args.ranks, args.saves)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "group.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        md = group_table(rows, args.saves) + (
            f"\n\n{args.ranks} gloo ranks on CPU; a rank's sockets less the group's listening one "
            "(the coordinator, rank 0, receives every rank's plan).\n")
        (out / "group.md").write_text(md)
        print(md)
        return 0
    rows = [_run(mode, rep, args, extra) for rep in range(args.repeats) for mode in MODES]
    keys = [k for k in rows[0] if k not in ("mode", "repeat")]
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        rows.append({"mode": mode, "repeat": "median",
                     **{k: _median([r[k] for r in mine if r[k] is not None]) for k in keys}})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "extra": extra, "rows": rows},
                                                 indent=2))
    md = table(rows)
    mib = next((r["checkpoint_mib"] for r in rows if r["checkpoint_mib"]), None)
    md += (f"\n\n{args.ranks} ranks, {args.steps} steps, a save every {args.save_every} steps"
           + (f" ({mib:.2f} MiB per checkpoint)" if mib else "") + "; rank 0's wall time per step, "
           "the first step left out.\n")
    (out / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
