"""Where MatrixFSDP's optimizer step spends its time, operation by operation.

``python -m studies.step_ops [--ranks 4] [--steps 6] [bench model options]`` (CPU,
gloo) trains the benchmark's default model (``matrixfsdp bench``'s CPU preset, or what the
``matrixfsdp bench`` options ``--layers``, ``--d-model``, ... given after it say) on local
ranks and, in every step, times
each operation of the Muon update on every owned matrix in thread CPU time: momentum
``lerp_``, Nesterov ``lerp`` into the NS dtype, Newton-Schulz, decay ``mul_`` and update
``add_`` (tall and wide matrices apart). It prints, per rank, the median over the steps
after two warm-up steps, the element-wise total and the step / NS ratio.

The timed loop is :meth:`matrixfsdp.Muon._muon_step` split into its operations; before
timing, each rank checks on one step that it leaves parameters and momentum bit-identical
to the real step.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
import torch.distributed as dist

import matrixfsdp as mf
from benchmarks.harness.main import parse_args as bench_config
from matrixfsdp.optim.muon import adjusted_lr, stepped
from matrixfsdp.optim.newton_schulz import newton_schulz_
from matrixfsdp.train.launch import launch
from matrixfsdp.train.models import GPT

ELEMENTWISE = ("lerp_", "lerp_ns_dtype", "mul_", "add_tall", "add_wide")


def _timed_muon_step(opt: mf.Muon, group: dict, acc: dict[str, float]) -> None:
    """``Muon._muon_step`` (``nesterov=True``), adding each operation's thread CPU ms."""
    lr, clock = group["lr"], time.thread_time
    for p in stepped(group):
        grad, state = p.grad, opt.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        t0 = clock()
        buf.lerp_(grad, 1 - group["momentum"])
        t1 = clock()
        x = opt._ns_input(grad, group["ns_dtype"])
        torch.lerp(grad, buf, group["momentum"], out=x)
        t2 = clock()
        update = newton_schulz_(x, group["ns_coefficients"], group["ns_steps"], group["eps"])
        t3 = clock()
        p.mul_(1 - lr * group["weight_decay"])
        t4 = clock()
        p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        t5 = clock()
        add = "add_tall" if p.shape[0] > p.shape[1] else "add_wide"
        for key, dt in (("lerp_", t1 - t0), ("lerp_ns_dtype", t2 - t1), ("ns", t3 - t2),
                        ("mul_", t4 - t3), (add, t5 - t4)):
            acc[key] += dt * 1e3


def _check_same_as_real_step(opt: mf.Muon, group: dict) -> None:
    params = list(stepped(group))
    saved = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params]
    _timed_muon_step(opt, group, collections.defaultdict(float))
    timed = [(p.detach().clone(), opt.state[p]["momentum_buffer"].clone()) for p in params]
    for p, (data, state) in zip(params, saved):
        p.copy_(data)
        opt.state[p].clear()
        opt.state[p].update(state)
    opt._muon_step(group)
    for p, (data, buf) in zip(params, timed):
        if not (torch.equal(p, data) and torch.equal(opt.state[p]["momentum_buffer"], buf)):
            raise RuntimeError("the timed step no longer matches Muon._muon_step")


def _profile(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = bench_config(["--world-size", str(world), *args.model])
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config())
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    opt = mf.Muon(mf.muon_param_groups(model, lr=cfg.lr, adamw_lr=cfg.adamw_lr,
                                       weight_decay=cfg.weight_decay, momentum=cfg.momentum))
    muon_group = next(g for g in opt.param_groups if g["use_muon"])
    gen = torch.Generator().manual_seed(rank)
    per_step: dict[str, list[float]] = collections.defaultdict(list)
    for step in range(args.steps):
        x = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        dist.barrier()
        with torch.no_grad():
            if step == 0:
                _check_same_as_real_step(opt, muon_group)
            else:
                acc: dict[str, float] = collections.defaultdict(float)
                _timed_muon_step(opt, muon_group, acc)
                if step >= 2:
                    for key in (*ELEMENTWISE, "ns"):
                        per_step[key].append(acc[key])
            for g in opt.param_groups:
                if not g["use_muon"]:
                    opt._adamw_step(g)
        opt.zero_grad(set_to_none=True)
    med = {k: statistics.median(v) for k, v in per_step.items()}
    rows: list = [None] * world
    dist.all_gather_object(rows, med)
    if rank == 0:
        print("thread CPU ms per step, median over steps; all ranks at once")
        print("| rank | " + " | ".join(ELEMENTWISE) + " | element-wise | NS | step / NS |")
        print("|---" * (len(ELEMENTWISE) + 4) + "|")
        for r, m in enumerate(rows):
            elem = sum(m[k] for k in ELEMENTWISE)
            print(f"| {r} | " + " | ".join(f"{m[k]:.2f}" for k in ELEMENTWISE)
                  + f" | {elem:.1f} | {m['ns']:.1f} | {(m['ns'] + elem) / m['ns']:.2f}x |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="steps, the first two untimed")
    args, args.model = ap.parse_known_args(argv)
    bench_config(["--world-size", str(args.ranks), *args.model])  # bad model options exit here
    if args.steps < 3:
        ap.error("--steps must be >= 3")
    if torch.cuda.is_available():
        ap.error("this profile times CPU operations; run it on a CPU-only machine")
    launch(_profile, args, args.ranks)


if __name__ == "__main__":
    main()
