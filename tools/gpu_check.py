"""``make gpu-check``: what only a GPU shows, as one prepared script for a lent machine (a few
minutes on one GPU); on a machine without one, a dry run that says what it would measure
and runs what a CPU can of it, so the script itself is known to work.

Checks (one GPU, world size 1 over NCCL; ``torchrun --nproc-per-node N`` for more):

* **parity**: a small GPT built on the CPU, sharded over the GPU mesh (so its states move
  there), 3 steps of ``mf.Muon`` against ``torch.optim.Muon`` + ``torch.optim.AdamW`` on one
  device with the same data: the largest difference of any parameter;
* **host syncs**: ``torch.cuda.set_sync_debug_mode("error")`` around a steady step
  (forward, backward, ``mf.clip_grad_norm_``, the step): none may synchronise;
* **memory**: the bytes allocated after ``shard_model`` against this rank's shards, and the
  peak during it against the shards plus the largest unit (its buffers are made once, then
  freed: nothing model-sized held until the first forward);
* **Newton-Schulz**: bf16 TFLOP/s of ``mf``'s NS at Llama shapes, against the GPU's peak;
* **bench**: ``matrixfsdp bench --preset gpu`` (a few steps), its table;
* more than one GPU: the coalesced path (one launch per unit and direction), overlap on and
  off bit-identical; torchtitan's trainer at context parallelism 2 through the one line,
  against torchtitan + FSDP2 + torch Muon (CP cannot run on CPU).

    python -m tools.gpu_check [--dry-run] [--out runs/gpu-check] [--record]

It writes ``OUT/gpu_check.md``; ``--record`` also puts it in docs/benchmarks.md (the section
between the ``gpu-check`` markers).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.optim.muon import zeropower_via_newtonschulz
from matrixfsdp.runtime.exit import exit_rank
from matrixfsdp.train.models import GPT, GPTConfig

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}
NS_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672))
MARK = "<!-- gpu-check -->"
CFG = GPTConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_mlp=256, seq_len=32)


def _setup() -> torch.device:
    """The process group (torchrun's, else one rank) and this rank's device."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
        dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def _train(model, opt, steps: int, device: torch.device, clip: bool = False) -> None:
    g = torch.Generator().manual_seed(0)  # the same data on every rank: means are exact
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=g).to(device)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        if clip:
            mf.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


def _sharded(device: torch.device, overlap: bool = True):
    torch.manual_seed(0)
    model = GPT(CFG)  # built on the CPU: fully_shard moves it to the mesh's device
    reference = copy.deepcopy(model).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh, overlap=overlap)
    return model, reference, mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=3e-3))


def check_parity(device: torch.device) -> dict:
    model, ref, opt = _sharded(device)
    moved = all(p.device == device for p in model.parameters())
    muon = {n for n, pl in mf.plan_of(model).placements.items() if pl.spec.muon}
    named = list(ref.named_parameters())
    ref_opts = [torch.optim.Muon([p for n, p in named if n in muon], lr=0.02),
                torch.optim.AdamW([p for n, p in named if n not in muon], lr=3e-3)]

    class Both:
        def step(self):
            for o in ref_opts:
                o.step()

        def zero_grad(self):
            for o in ref_opts:
                o.zero_grad()
    _train(model, opt, 3, device)
    _train(ref, Both(), 3, device)
    full = mf.full_state_dict(model)
    diff = max((full[n].float() - p.detach().float()).abs().max().item() for n, p in named)
    return {"max abs diff vs torch.optim.Muon + AdamW (3 steps)": f"{diff:.2e}",
            "states on the mesh's device": moved, "ok": diff <= 1e-5 and moved}


def check_syncs(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"would check": "torch.cuda.set_sync_debug_mode('error') around a steady step",
                "ok": None}
    model, _, opt = _sharded(device)
    _train(model, opt, 2, device, clip=True)  # the first step's one-time checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _train(model, opt, 1, device, clip=True)
        found = "none"
    except RuntimeError as e:
        found = str(e).splitlines()[0][:160]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"host syncs in forward, backward, clip, step": found, "ok": found == "none"}


def check_memory(device: torch.device) -> dict:
    width = 1024 if device.type == "cuda" else 128  # a dry run checks the logic, quickly
    cfg = GPTConfig(vocab_size=8192, d_model=width, n_heads=16, n_layers=8, d_mlp=4 * width, seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg)  # on the CPU
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    root = mf.get_root(model)
    shards = sum(u.storage.local.numel() * u.storage.local.element_size() for u in root.units)
    unit = max(u.layout.gathered_numel + u.layout.copied_numel for u in root.units) * 4
    held = sum(b.untyped_storage().nbytes() for u in root.units
               for b in (u.storage.gathered, u.storage.copied))
    out = {"model (fp32)": f"{full / 2**20:.0f} MiB", "this rank's shards": f"{shards / 2**20:.0f} MiB",
           "largest unit": f"{unit / 2**20:.0f} MiB", "unsharded buffers held": f"{held} B"}
    if device.type == "cuda":
        after = torch.cuda.memory_allocated() - base
        peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        full = mf.full_state_dict(model, cpu_offload=True)  # an export: a unit at a time on the GPU
        export = torch.cuda.max_memory_allocated() - base
        out.update({"allocated after shard_model": f"{after / 2**20:.0f} MiB",
                    "peak during it": f"{peak / 2**20:.0f} MiB",
                    "peak of full_state_dict(cpu_offload=True)": f"{export / 2**20:.0f} MiB",
                    "ok": held == 0 and after <= 1.05 * shards + (1 << 20) and peak <= shards + 2 * unit
                    and export <= shards + 2 * unit and all(t.device.type == "cpu" for t in full.values())})
    else:
        full = mf.full_state_dict(model, cpu_offload=True)
        out.update({"would check": "allocated after shard_model ~ the shards; peak <= shards + a "
                    "unit; full_state_dict(cpu_offload=True) at most a unit on the device",
                    "ok": held == 0 and all(t.device.type == "cpu" for t in full.values())})
    return out


def check_ns(device: torch.device) -> dict:
    coeff, steps = (3.4445, -4.775, 2.0315), 5
    shapes = NS_SHAPES if device.type == "cuda" else ((256, 256), (256, 1024))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {}
    for m, n in shapes:
        g = torch.randn(m, n, device=device)
        zeropower_via_newtonschulz(g, coeff, steps, 1e-7, dtype)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t, reps = time.perf_counter(), 5
        for _ in range(reps):
            zeropower_via_newtonschulz(g, coeff, steps, 1e-7, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        s = (time.perf_counter() - t) / reps
        a, b = min(m, n), max(m, n)
        flops = steps * (2 * a * a * b + 2 * a ** 3 + 2 * a * a * b)
        out[f"NS {m}x{n} ({str(dtype)[6:]})"] = f"{flops / s / 1e12:.3g} TFLOP/s"
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    if peak is not None:
        best = max(float(v.split()[0]) for v in out.values())
        out["best vs bf16 dense peak"] = f"{best / peak:.2f}x of {peak:.0f}"
    out["device"] = name
    out["ok"] = True if device.type == "cuda" else None  # a measurement: no verdict on CPU
    return out


def check_many(device: torch.device) -> dict:
    if dist.get_world_size() == 1:
        return {"would check (2+ GPUs)": "one launch per unit and direction; overlap on/off "
                "bit-identical", "ok": None}
    states, launches = [], None
    for overlap in (True, False):
        model, _, opt = _sharded(device, overlap)
        mf.comm_stats(model).reset()
        _train(model, opt, 2, device)
        states.append(mf.full_state_dict(model))
        if overlap:
            root = mf.get_root(model)
            launches = (root.comm.coalesce, dict(mf.comm_stats(model).launches))
    same = all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    units = len(mf.get_root(model).units)
    coalesced, count = launches
    return {"coalescing": coalesced, "launches (2 steps)": count,
            "overlap on/off bit-identical": same,
            "ok": same and (device.type != "cuda" or coalesced and count.get("reduce") == 2 * units)}


CP_TOL = 1e-4  # per-step loss, fp32 parameters and Newton-Schulz (the CPU tests' bound)


def check_context_parallel(device: torch.device, out: Path, degree: int = 2) -> dict:
    """torchtitan's own Trainer at ``context_parallel_degree`` 2 (its ``apply_cp_to_forward``
    called unchanged by the one line's ``parallelize``; ``mf.fully_shard`` over torchtitan's
    ``fsdp`` mesh, which holds the cp ranks) against torchtitan + FSDP2 + torch Muon from one
    seed checkpoint: 10 steps of the llama3 debug model at a test's size (the tests' tiny
    tokenizer and data, ``tests/helpers``), fp32 parameters and Newton-Schulz. It cannot run
    on CPU: SDPA's CPU flash kernel has no DTensor sharding strategy (both sides fail there,
    ``tests/integrations/test_torchtitan_nd.py``). ``degree`` 1 runs the same comparison
    without CP, on CPU too (torchtitan's CPU shim, ``tests/helpers/titan_cpu.py``): how
    the script itself is tested without a GPU."""
    world = dist.get_world_size()
    if degree > 1 and (device.type != "cuda" or world < 2 or world % degree):
        return {"would check (2+ GPUs, an even number)": "torchtitan's trainer at cp 2 "
                "through the one line against FSDP2 + torch Muon, per-step loss within "
                f"{CP_TOL:g}", "ok": None}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import titan_cpu, titan_reference, titan_runs
    from helpers.reference import reference_ns_fp32

    titan_cpu.import_torchtitan()
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    import matrixfsdp.integrations.torchtitan as mft

    def configured(ours: bool):
        config = llama3_debugmodel()
        config.optimizer = mft.muon_optimizer(config.optimizer, ns_dtype="float32")
        return mft.convert(config) if ours else titan_reference.on_fsdp2(config)

    folder = out / "context-parallel"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.update(MF_RANK=str(dist.get_rank()), MF_WORLD=str(world))
    seed = titan_runs.seed(str(folder), lambda: configured(False))
    steps = {}
    for name, ours in (("fsdp2", False), ("ours", True)):
        path = folder / f"{name}.json"
        config = titan_cpu.on_cpu(configured(ours), dump_folder=str(folder / name),
                                  metrics_path=str(path), positions=True)
        config.parallelism.context_parallel_degree = degree
        config.training.mixed_precision_param = "float32"
        config.training.disable_cuda_graphs = True
        config.checkpoint.enable, config.checkpoint.initial_load_path = True, seed
        on_cpu = titan_cpu.titan_on_cpu() if device.type == "cpu" else contextlib.nullcontext()
        ns = reference_ns_fp32() if not ours else contextlib.nullcontext()
        with on_cpu, ns:
            trainer = config.build()
            try:
                trainer.train()
            finally:
                trainer.close()
        dist.barrier()
        if dist.get_rank() == 0:
            with open(path) as f:
                steps[name] = {int(k): v for k, v in json.load(f).items()}
    if dist.get_rank() != 0:
        return {"ok": True}
    diffs = [abs(steps["ours"][s]["loss"] - steps["fsdp2"][s]["loss"]) for s in steps["fsdp2"]]
    return {"steps": len(diffs), "largest per-step loss difference": f"{max(diffs):.2e}",
            "ok": len(diffs) == 10 and max(diffs) <= CP_TOL}


def check_bench(device: torch.device, out: Path) -> dict:
    if device.type != "cuda" or dist.get_world_size() > 1:
        return {"would run": "matrixfsdp bench --preset gpu --steps 4 --warmup 1", "ok": None}
    cmd = [sys.executable, "-m", "matrixfsdp", "bench", "--preset", "gpu", "--steps", "4",
           "--warmup", "1", "--out", str(out / "bench")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    table = out / "bench" / "results.md"
    return {"bench": str(table) if table.exists() else run.stderr[-300:], "ok": run.returncode == 0}


def _report(results: dict[str, dict], device: torch.device, dry: bool) -> str:
    lines = [f"{MARK}", f"### GPU check ({'dry run, no GPU' if dry else device}; "
             f"{dist.get_world_size()} rank(s), torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d')}; `make gpu-check`)", "",
             "| check | measured | verdict |", "|---|---|---|"]
    for name, res in results.items():
        ok = res.pop("ok", None)
        verdict = "pass" if ok else "not run here" if ok is None else "FAIL"
        shown = "; ".join(f"{k}: {v}" for k, v in res.items())
        lines.append(f"| {name} | {shown} | {verdict} |")
    return "\n".join(lines + [MARK, ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tools.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="say what a GPU run would measure; run "
                   "the CPU-capable checks (default without CUDA)")
    p.add_argument("--out", default="runs/gpu-check", help="output folder (default: runs/gpu-check)")
    p.add_argument("--record", action="store_true",
                   help="also write the table into docs/benchmarks.md (default: off)")
    a = p.parse_args(argv)
    device = _setup()
    dry = a.dry_run or device.type != "cuda"
    out = Path(a.out)
    checks = {"parity": check_parity, "host syncs": check_syncs, "memory": check_memory,
              "Newton-Schulz speed": check_ns, "several GPUs": check_many}
    results = {name: fn(device) for name, fn in checks.items()}
    results["context parallelism"] = check_context_parallel(device, out)
    results["bench gpu preset"] = check_bench(device, out)
    text = _report(results, device, dry)
    failed = "| FAIL |" in text
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(text)
        print(text)
        if a.record:
            page = Path("docs/benchmarks.md")
            body = page.read_text()
            pattern = re.compile(re.escape(MARK) + r".*?" + re.escape(MARK) + r"\n", re.S)
            page.write_text(pattern.sub(lambda _: text, body) if MARK in body else body + "\n" + text)
    exit_rank(1 if failed else 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
