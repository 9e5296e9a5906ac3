"""Newton-Schulz one matrix at a time against one batched NS of the same matrices.

``python -m studies.batched_ns`` times ``matrixfsdp.Muon``'s step on many small
same-shape matrices (a rank's q/k/v/o of many layers, small experts), with ``batch_ns``
off (torch.optim.Muon's way: one NS per matrix) and on (one ``bmm``/``baddbmm`` NS per
shape), and reports the median step, the ratio, and the largest difference between the
two updates (batched matmuls may round differently from 2-D ones). Small matrices are
launch-bound on an accelerator (a peer measured 74 NS of [24, 10240] at 74 ms one by one
and 2.4 ms batched); on a CPU the win is the per-op overhead. ``--out`` writes the table
(``batched_ns.md``) and the numbers (``batched_ns.json``)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import matrixfsdp as mf
from matrixfsdp.train.machine import machine_info, machine_line

CASES = {"64 x [24, 1024]": (64, (24, 1024)), "96 x [64, 64]": (96, (64, 64)),
         "32 x [128, 512]": (32, (128, 512))}


def _params(n: int, shape: tuple[int, int], device: torch.device) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(device)) for _ in range(n)]


def _time_steps(batch: bool, n: int, shape: tuple[int, int], dtype: torch.dtype,
                device: torch.device, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    params = _params(n, shape, device)
    opt = mf.Muon([dict(params=params, use_muon=True, lr=0.02, batch_ns=batch, ns_dtype=dtype)])
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(shape, generator=g).to(device) for _ in params] for _ in range(steps + 1)]
    times = []
    for step, gs in enumerate(grads):
        for p, grad in zip(params, gs):
            p.grad = grad
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:  # the first step allocates the NS buffers
            times.append((time.perf_counter() - t0) * 1e3)
    return times, [p.detach().clone() for p in params]


def run(steps: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    for name, (n, shape) in CASES.items():
        one, ref = _time_steps(False, n, shape, dtype, device, steps)
        bat, got = _time_steps(True, n, shape, dtype, device, steps)
        diff = max((a - b).abs().max().item() for a, b in zip(got, ref))
        rows.append({"case": name, "matrices": n, "shape": list(shape),
                     "one_by_one_ms": statistics.median(one), "batched_ms": statistics.median(bat),
                     "speedup": statistics.median(one) / statistics.median(bat),
                     "max_abs_diff": diff, "steps": steps})
    return rows


def render(rows: list[dict], dtype: torch.dtype, device: torch.device) -> str:
    out = [f"Newton-Schulz one by one vs batched ({str(dtype).removeprefix('torch.')} NS, "
           f"{device.type}; {machine_line(machine_info())}): median matrixfsdp.Muon step over "
           f"{rows[0]['steps']} steps, lr 0.02.", "",
           "| matrices | one by one ms | batched ms | speedup | max abs diff of the parameters |",
           "|---|---:|---:|---:|---:|"]
    out += [f"| {r['case']} | {r['one_by_one_ms']:.2f} | {r['batched_ms']:.2f} | "
            f"{r['speedup']:.2f}x | {r['max_abs_diff']:.2g} |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m studies.batched_ns",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the NS dtype")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="a folder for batched_ns.md and .json")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    device = torch.device(args.device)
    rows = run(args.steps, device, dtype)
    text = render(rows, dtype, device)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "batched_ns.md").write_text(text + "\n")
        (out / "batched_ns.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
