"""``make gpu-check``: what only a GPU shows, as one command with one report and a nonzero
exit on any failure (docs/gpu.md, "Checking a GPU machine"); without a GPU, a dry run that
lists every check with its bound and runs each one's CPU path.

One command starts everything: the rank checks (:mod:`tools.gpu_check_ranks`, one process
per GPU, NCCL; two gloo ranks on CPU), then ``matrixfsdp bench`` (its gpu preset at the GPUs
present; a tiny model on CPU), then judges. The checks, their bounds and the reasons are
:data:`CHECKS`; the judges are pure functions of what was measured (``judge_*``), and each
is also handed a deliberately broken input (:func:`self_tests`) which it must fail.

    python -m tools.gpu_check [--dry-run] [--ngpu N] [--out runs/gpu-check] [--record]
    python -m tools.gpu_check --list        # the checks and their bounds, nothing run

It writes ``OUT/gpu_check.md`` and ``OUT/gpu_check.json``; ``--record`` also puts the table
into docs/benchmarks.md (between the ``gpu-check`` markers), where docs/gpu.md points.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .gpu_check_judges import (
    BENCH_CPU,
    BENCH_GPU,
    BENCH_SYSTEMS,
    CHECKS,
    CPU_RANKS,
    MARK,
    NAMES,
    judge_cp,
    judge_instrument,
    judge_memory,
    judge_ns,
    judge_overlap,
    judge_parity,
    judge_speed,
    judge_syncs,
    peak_tflops,
    self_tests,
    verdict,
)

# ---- report -------------------------------------------------------------------------------------

def _cell(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def plan_text() -> str:
    """Every check: what it measures, when it passes, what fails it, its CPU path."""
    lines = []
    for c in CHECKS:
        lines += [f"* {c.name}: {c.measures}.", f"    passes when: {c.passes}.",
                  f"    fails on: {c.fails}.", f"    broken input it must fail: {c.broken}.",
                  f"    dry run on CPU: {c.cpu}."]
    return "\n".join(lines)


def render(results: dict[str, dict[str, Any]], head: dict[str, Any]) -> str:
    lines = [MARK, f"### GPU check ({head['title']})", "",
             "| check | passes when | measured | broken input fails it | verdict |",
             "|---|---|---|---|---|"]
    for c in CHECKS:
        r = results.get(c.name) or verdict(False, {}, "not run")
        measured = "; ".join(f"{k}: {v}" for k, v in r["measured"].items())
        if r.get("note"):
            measured += ("; " if measured else "") + r["note"]
        broken = r.get("broken")
        lines.append(f"| {c.name} | {_cell(c.passes)} | {_cell(measured)} | "
                     f"{'—' if broken is None else 'yes' if broken else '**no**'} | "
                     f"{'**FAIL**' if r['status'] == 'FAIL' else r['status']} |")
    failed = [c.name for c in CHECKS if (results.get(c.name) or {}).get("status", "FAIL") == "FAIL"]
    lines += ["", f"{'FAILED: ' + ', '.join(failed) if failed else 'Every judged check passed.'} "
              f"Details: `{head['out']}/gpu_check.json`.", MARK, ""]
    return "\n".join(lines)


def record_into(page: Path, text: str) -> None:
    body = page.read_text()
    pattern = re.compile(re.escape(MARK) + r".*?" + re.escape(MARK) + r"\n", re.S)
    page.write_text(pattern.sub(lambda _: text, body, count=1) if MARK in body else body + "\n" + text)


# ---- the run ------------------------------------------------------------------------------------

def _ranks(world: int, cuda: bool, out: Path, timeout_s: float) -> dict[str, Any]:
    """The rank checks (:mod:`tools.gpu_check_ranks`) on ``world`` local ranks; every rank's
    results by check (what a rank finished before one failed, and its error)."""
    from matrixfsdp.train.rank_process import ranks_started

    from . import gpu_check_ranks

    ranks_dir = out / "ranks"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    for f in ranks_dir.glob("rank*.json"):
        f.unlink()
    failure = None
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        settings = {"world": world, "cuda": cuda, "out": str(out), "init": os.path.join(tmp, "init"),
                    "timeout_s": timeout_s}
        deadline = time.monotonic() + timeout_s
        try:
            with ranks_started(gpu_check_ranks.rank_entry, (settings,), world) as ranks:
                while not ranks.join(timeout=2):
                    if time.monotonic() > deadline:
                        for p in ranks.processes:
                            p.terminate()
                        raise TimeoutError(f"the rank checks ran past {timeout_s:.0f} s")
        except Exception as e:  # a rank failed: what it wrote says where
            failure = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
    per_rank = []
    for r in range(world):
        path = ranks_dir / f"rank{r}.json"
        per_rank.append(json.loads(path.read_text()) if path.exists() else {})
    return {"per_rank": per_rank, "failure": failure}


def _judge_ranks(ranks: dict[str, Any], world: int, cuda: bool, peak: float | None) -> dict[str, dict]:
    from .gpu_check_ranks import INJECTED

    per_rank, out = ranks["per_rank"], {}
    first = per_rank[0] if per_rank else {}

    def failed(name):
        errors = [f"rank {i}: {p[name]['error']}" for i, p in enumerate(per_rank)
                  if "error" in p.get(name, {})]
        if errors:
            return verdict(False, {}, errors[0].strip().splitlines()[-1][:300])
        if any(name not in p for p in per_rank):
            return verdict(False, {}, f"not run ({ranks['failure'] or 'a rank stopped before it'})")
        return None

    if not (r := failed("parity")):
        worst = max((p["parity"] for p in per_rank), key=lambda x: x["diff"])
        r = judge_parity(worst)
        r["broken"] = judge_parity({**worst, "diff": worst["behind"]})["status"] == "FAIL"
    out["parity"] = r
    if not (r := failed("host syncs")):
        steady = [x for p in per_rank for x in p["host syncs"]["steady"]]
        # exactly one per rank that lacked a gradient: every rank here (nobody uses it)
        unused = [p["host syncs"]["unused"] for p in per_rank]
        worst = max(unused, key=lambda u: (len(u) != 1, len(u)))
        r = judge_syncs(steady, worst)
        r["broken"] = all(judge_instrument(p["host syncs"]["injected"], INJECTED) for p in per_rank)
    out["host syncs"] = r
    if not (r := failed("overlap")):
        keys = [k for k in per_rank[0]["overlap"] if k != "world"]
        merged_r = {"world": world, "device": "cuda" if cuda else "cpu",
                    **{k: [p["overlap"][k] for p in per_rank] for k in keys}}
        r = judge_overlap(merged_r)
        r["broken"] = self_tests()["overlap"]
        if not cuda and world > 1:  # on CPU the overlap-off run must fail it too
            off = {**merged_r, "matrixfsdp": merged_r["matrixfsdp overlap off"]}
            r["broken"] = r["broken"] and judge_overlap(off)["status"] == "FAIL"
    out["overlap"] = r
    if not (r := failed("set-up memory")):
        x = min((p["set-up memory"] for p in per_rank), key=lambda x: bool(x["ok"]))
        r = verdict(x["ok"], x["measured"], x.get("note", ""))
        r["broken"] = self_tests()["set-up memory"]
    out["set-up memory"] = r
    if not (r := failed("several GPUs")):
        x = first["several GPUs"]
        r = verdict(x["ok"], x["measured"], x.get("note", ""))
    out["several GPUs"] = r
    if not (r := failed("Newton-Schulz")):
        x = first["Newton-Schulz"]
        r = judge_ns(x, peak_tflops(x["device"], peak), judged=cuda)
        r["broken"] = self_tests()["Newton-Schulz"]
    out["Newton-Schulz"] = r
    if not (r := failed("context parallelism")):
        r = judge_cp(first["context parallelism"])
        r["broken"] = self_tests()["context parallelism"]
    out["context parallelism"] = r
    return out


def _bench(world: int, cuda: bool, out: Path) -> tuple[dict[str, Any] | None, str]:
    """``matrixfsdp bench`` (gpu preset on CUDA, a tiny model on CPU) at ``world`` ranks,
    MatrixFSDP, FSDP2 + AdamW and FSDP2 + torch Muon; its results.json."""
    from benchmarks.harness.main import main as bench_main

    argv = [*(BENCH_GPU if cuda else BENCH_CPU), "--ranks", str(world), "--systems", BENCH_SYSTEMS,
            "--out", str(out / "bench")]
    print(f"[gpu-check] matrixfsdp bench {' '.join(argv)}", flush=True)
    path = out / "bench" / "results.json"
    path.unlink(missing_ok=True)  # never judge an earlier run's
    try:
        rc = bench_main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    if rc or not path.exists():
        return None, f"matrixfsdp bench exited {rc}"
    return json.loads(path.read_text()), ""


def run(a: argparse.Namespace) -> int:
    if a.dry_run:  # before CUDA is first asked: the ranks and the bench's then see no GPU either
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    cuda = torch.cuda.is_available() and not a.dry_run
    if cuda:
        world = a.ngpu or torch.cuda.device_count()
        if world > torch.cuda.device_count():
            raise SystemExit(f"--ngpu {world}: this machine has {torch.cuda.device_count()} GPU(s)")
    else:
        world = CPU_RANKS
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    mode = f"{world} GPU(s), NCCL" if cuda else f"dry run, no GPU: {world} CPU ranks over gloo"
    print(f"[gpu-check] {mode}; the checks:\n{plan_text()}\n", flush=True)
    t0 = time.perf_counter()
    ranks = _ranks(world, cuda, out, a.timeout)
    results = _judge_ranks(ranks, world, cuda, a.peak_tflops)
    bench, error = _bench(world, cuda, out)
    tests = self_tests()
    if bench is None:
        results["memory"] = verdict(False, {}, f"the bench did not run: {error}")
        results["speed"] = verdict(False, {}, f"the bench did not run: {error}")
    else:
        results["memory"] = judge_memory(bench, judged=cuda)
        results["speed"] = judge_speed(bench, judged=cuda)
    for name in ("memory", "speed"):
        results[name]["broken"] = tests[name]
    for r in results.values():  # a judge that passes a broken input is itself a failure
        if r.get("broken") is False and r["status"] != "FAIL":
            r.update(status="FAIL", note=(r["note"] + "; " if r["note"] else "") + "a broken input passed")
    device = ((ranks["per_rank"] or [{}])[0].get("Newton-Schulz") or {}).get("device", "?")
    title = (f"{'dry run, no GPU' if not cuda else device}; {world} rank(s), torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d')}, {time.perf_counter() - t0:.0f} s; `make gpu-check`")
    text = render(results, {"title": title, "out": a.out})
    report = {"title": title, "cuda": cuda, "world": world, "checks": [asdict(c) for c in CHECKS],
              "results": results, "rank_failure": ranks["failure"], "per_rank": ranks["per_rank"],
              "self_tests": tests, "bench": str(out / "bench" / "results.json") if bench else error}
    (out / "gpu_check.md").write_text(text)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(text)
    if a.record:
        record_into(Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md", text)
    failed = [n for n in NAMES if results.get(n, {}).get("status", "FAIL") == "FAIL"]
    if failed:
        print(f"[gpu-check] FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tools.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU ranks over gloo even where a GPU "
                   "is (the default without CUDA): each check's CPU path")
    p.add_argument("--list", action="store_true", help="print the checks and their bounds; run nothing")
    p.add_argument("--ngpu", type=int, default=None, help="GPUs to use (default: every one visible)")
    p.add_argument("--out", default="runs/gpu-check", help="output folder (default: runs/gpu-check)")
    p.add_argument("--record", action="store_true",
                   help="also write the table into docs/benchmarks.md (default: off)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's dense bf16 TFLOP/s, where its name is not in the table")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds the rank checks may take in all (default 900)")
    a = p.parse_args(argv)
    if a.list:
        print(plan_text())
        return 0
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        raise SystemExit("tools.gpu_check starts its own ranks (one per GPU): run it without "
                         "torchrun, `python -m tools.gpu_check --ngpu N` (make gpu-check NGPU=N)")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
