"""Peak memory per rank of the two ways to get a sharded, initialised model.

``python -m studies.init_memory [--ranks 4] [--d-model 1024 --layers 16 --d-mlp 4096
--vocab 32000 --seq-len 1024 --heads 16] [--out DIR]``

* ``meta``: build under ``torch.device("meta")``, ``fully_shard`` the blocks and the root,
  ``torch.manual_seed``, :func:`matrixfsdp.init_weights`.
* ``naive``: ``torch.manual_seed``, build the whole model on the device, ``fully_shard``.

Each path runs in fresh rank processes (peak RSS is a per-process high-water mark), after a
warm-up of both paths on a tiny model (so lazily loaded code is not counted). Per rank it
records: the RSS before the model is built, the peak RSS of the path (``VmHWM``, reset just
before it through ``/proc/self/clear_refs``), the RSS once done, the bytes this rank's shards
occupy (``unit.local`` of every unit), the seconds from the start of the build to initialised
shards and, on CUDA, the peak allocated device memory. Both paths must leave the same shards
(same seed): the run compares per-rank float64 checksums of the shards and fails if they
differ. The table shows the maximum over ranks; ``DIR/<path>.json`` keeps every rank's
figures. Rank processes are launched by :func:`matrixfsdp.train.launch.launch` (local processes; under
``torchrun`` run one ``--path``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.train.launch import launch
from matrixfsdp.train.models import GPT, GPTConfig

MiB = 1 << 20
PATHS = ("meta", "naive")


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
                     n_heads=args.heads, n_layers=args.layers, d_mlp=args.d_mlp)


def model_stats(cfg: GPTConfig) -> dict[str, int]:
    """Parameter count, fp32 bytes, and the largest single module's own parameters (the
    transient ``init_weights`` adds), from a meta build."""
    with torch.device("meta"):
        model = GPT(cfg)
    own = [sum(p.numel() for p in m._parameters.values() if p is not None) for m in model.modules()]
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "bytes": 4 * n, "largest_module_bytes": 4 * max(own)}


def _rank(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    cfg = model_config(args)
    # Warm-up: both paths once on a tiny model, so that lazily loaded code (the meta
    # device's kernels and decompositions, ~50 MiB) is not counted as model memory.
    tiny = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=1, d_mlp=32)
    for meta in (True, False):
        with torch.device("meta" if meta else device):
            warm = GPT(tiny)
        for block in warm.layers:
            mf.fully_shard(block, mesh=mesh)
        mf.fully_shard(warm, mesh=mesh)
        mf.get_root(warm)
        if meta:
            mf.init_weights(warm)
    del warm
    dist.barrier()
    rss_before = _status_kib("VmRSS")
    peak_reset = _reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    if args.path == "meta":
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = GPT(cfg)
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    root = mf.get_root(model)  # plans and shards (meta: allocates the shards uninitialised)
    if args.path == "meta":
        torch.manual_seed(args.seed)
        mf.init_weights(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    rss_after = _status_kib("VmRSS")
    shard_bytes = sum(u.local.numel() * u.local.element_size() for u in root.units)
    checksum = sum(float(u.local.double().sum()) for u in root.units)
    out = {"rank": rank, "rss_before_kib": rss_before, "peak_rss_kib": peak, "rss_after_kib": rss_after,
           "peak_rss_reset": peak_reset, "shard_bytes": shard_bytes, "checksum": checksum,
           "seconds": seconds,
           "cuda_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    rows = [None] * world
    dist.all_gather_object(rows, out)
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        result = {"path": args.path, "world_size": world, "device": device.type,
                  "threads_per_rank": torch.get_num_threads(), "config": vars(cfg),
                  "model": model_stats(cfg), "ranks": rows}
        (Path(args.out) / f"{args.path}.json").write_text(json.dumps(result, indent=1))
        if args.torchrun:  # launch() ends the process after this function: report here
            print(render({args.path: result}))


def render(results: dict[str, dict]) -> str:
    """A markdown table: per path, per-rank figures as max over ranks (MiB)."""
    any_res = next(iter(results.values()))
    m = any_res["model"]
    lines = [f"Model: GPT {any_res['config']['d_model']}d x {any_res['config']['n_layers']} layers, "
             f"MLP {any_res['config']['d_mlp']}, vocab {any_res['config']['vocab_size']}: "
             f"{m['params'] / 1e6:.1f} M parameters, {m['bytes'] / MiB:.0f} MiB fp32; largest single "
             f"module {m['largest_module_bytes'] / MiB:.0f} MiB. {any_res['world_size']} ranks, "
             f"{any_res['device']}, {any_res['threads_per_rank']} thread(s) per rank. Max over ranks.",
             "",
             "| path | shards MiB | peak RSS added MiB | peak added / full model | RSS after, added MiB "
             "| seconds |" + (" CUDA peak MiB |" if any_res["device"] == "cuda" else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if any_res["device"] == "cuda" else "")]
    for path in PATHS:
        if path not in results:
            continue
        rs = results[path]["ranks"]
        added = max(r["peak_rss_kib"] - r["rss_before_kib"] for r in rs) * 1024
        after = max(r["rss_after_kib"] - r["rss_before_kib"] for r in rs) * 1024
        line = (f"| {path} | {max(r['shard_bytes'] for r in rs) / MiB:.0f} | {added / MiB:.0f} | "
                f"{added / m['bytes']:.2f} | {after / MiB:.0f} | {max(r['seconds'] for r in rs):.1f} |")
        if any_res["device"] == "cuda":
            line += f" {max(r['cuda_peak_bytes'] for r in rs) / MiB:.0f} |"
        lines.append(line)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m studies.init_memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--path", choices=(*PATHS, "both"), default="both")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-mlp", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/init_memory")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun and args.path == "both":
        raise SystemExit("under torchrun, run one --path at a time (peak RSS needs fresh processes)")
    paths = PATHS if args.path == "both" else (args.path,)
    results = {}
    for path in paths:
        launch(_rank, argparse.Namespace(**{**vars(args), "path": path, "torchrun": under_torchrun}),
               args.ranks)
        results[path] = json.loads((Path(args.out) / f"{path}.json").read_text())
    if len(results) == 2:
        a, b = ([r["checksum"] for r in results[p]["ranks"]] for p in PATHS)
        if a != b:
            raise SystemExit(f"the paths left different shards: checksums {a} vs {b}")
    print(render(results))
    if len(results) == 2:
        print("\nShards identical on both paths (per-rank float64 checksums equal).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
