"""Newton-Schulz cost of per-head Muon against whole-matrix Muon, on one process.

``python -m studies.heads [--dtype bf16|fp32] [--repeats 5] [--out runs/bench_heads]``
times :func:`matrixfsdp.zeropower_via_newtonschulz` (torch.optim.Muon's NS, 5 steps) on
attention projections of a few shapes, once on the whole matrix and once batched over its
head blocks (what ``num_heads`` makes ``mf.Muon`` run), and prints the median time, the
ratio, and the ratio the FLOP count predicts. Per iteration, NS on an ``m x n`` matrix
(``m <= n``) costs ``4 m^2 n + 2 m^3`` FLOPs; split into ``H`` row blocks it costs
``4 m^2 n / H + 2 m^3 / H^2``: close to ``H`` times less. The result goes to
``<out>/heads.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from matrixfsdp.layout.assign import ns_flops
from matrixfsdp.optim.groups import MUON_DEFAULTS
from matrixfsdp.optim.muon import zeropower_via_newtonschulz

# (what, rows, cols, heads): the demo model's q, a Llama-3-8B-shaped q (32 heads of 128 at
# d_model 4096, halved in both dims to keep a CPU run short) and its GQA k (8 heads of 128).
SHAPES = [("demo q (d 128, 4 heads)", 128, 128, 4),
          ("8B-like q (d 2048, 16 heads of 128)", 2048, 2048, 16),
          ("8B-like GQA k (4 heads of 128)", 512, 2048, 4)]


def _flops(m: int, n: int, heads: int = 1) -> int:
    """FLOPs of Muon's NS iterations on ``heads`` row blocks of an ``m x n`` matrix (the
    planner's count, :func:`~matrixfsdp.layout.assign.ns_flops`, per block)."""
    return heads * ns_flops((m // heads, n), MUON_DEFAULTS["ns_steps"])


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(dtype: torch.dtype, repeats: int) -> list[dict]:
    ns = dict(coefficients=MUON_DEFAULTS["ns_coefficients"], steps=MUON_DEFAULTS["ns_steps"],
              eps=MUON_DEFAULTS["eps"], dtype=dtype)
    rows = []
    for what, m, n, heads in SHAPES:
        g = torch.randn(m, n)
        whole, per_head = (_time(lambda x=x: zeropower_via_newtonschulz(x, **ns), repeats)
                           for x in (g, g.view(heads, m // heads, n)))
        rows.append(dict(what=what, shape=[m, n], heads=heads, whole_ms=whole * 1e3,
                         per_head_ms=per_head * 1e3, speedup=whole / per_head,
                         flop_ratio=_flops(m, n) / _flops(m, n, heads)))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m studies.heads",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="runs/bench_heads")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = measure(torch.bfloat16 if args.dtype == "bf16" else torch.float32, args.repeats)
    print(f"Newton-Schulz, {args.dtype}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'matrix':40s} {'whole ms':>10s} {'per-head ms':>12s} {'speedup':>8s} {'FLOP ratio':>10s}")
    for r in rows:
        print(f"{r['what']:40s} {r['whole_ms']:10.2f} {r['per_head_ms']:12.2f} "
              f"{r['speedup']:7.2f}x {r['flop_ratio']:9.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "heads.json").write_text(json.dumps(
        dict(dtype=args.dtype, threads=torch.get_num_threads(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
