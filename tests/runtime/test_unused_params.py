"""Parameters without a gradient are skipped by every optimizer, exactly as torch.

A parameter unused on every rank keeps ``.grad = None`` after backward (the end of backward
drops the zeros its unit's reduce attached), so no optimizer steps it: weight decay leaves it
bit-unchanged and it gets no state. A parameter used on some ranks only gets the average with zeros for the
others (FSDP2's meaning). The same with no-sync micro-batches, under HSDP and in debug mode.
Each case is compared against torch's optimizers on one process over the same data.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from helpers.rank_pool import spawn
from helpers.reference import assert_params_close, is_muon_name, reference_ns_fp32
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf

WORLD, PER_RANK, STEPS, D, IN, OUT = 2, 3, 3, 12, 6, 5
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)
SGD = dict(lr=0.5, weight_decay=0.1)
# never called on any rank: keep .grad None, and their values, bit for bit
UNUSED = [f"layers.{i}.{m}.{t}" for i in range(2) for m in ("unused", "unused_norm")
          for t in ("weight", "bias")] + ["spare.weight", "spare.bias"]
# called where the batch says so: on rank 0 only, in its first micro-batch of a step
BRANCH = [f"layers.{i}.branch.{t}" for i in range(2) for t in ("weight", "bias")]
CASES = {
    "muon": dict(opt="muon"),  # mf.Muon: the Muon group and the AdamW group
    "adamw": dict(opt="adamw"),  # torch.optim.AdamW over model.parameters()
    "sgd": dict(opt="sgd"),  # linear in the gradient: the branch's average shows exactly
    "shard_params": dict(opt="shard_params"),  # AdamW on the row shards, SGD on the matrices
    "no_sync": dict(opt="muon", micro=2, debug=True),
    # two synced backward passes: the branch's .grad from the first stays (zeros added)
    "accumulate": dict(opt="muon", micro=2, sync_each=True),
    # step 0's backward raises (after block 1 reduced) and is skipped: what that backward
    # noted (the branch, used then only) is forgotten, so the branch is never stepped
    "recover": dict(opt="muon", fails=0, branch_steps=(0,)),
    "hsdp": dict(opt="muon", hsdp=True),  # (2, 1) mesh: matrices stepped on one replica
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.branch = nn.Linear(D, D)
        self.unused = nn.Linear(D, D)
        self.unused_norm = nn.LayerNorm(D)

    def forward(self, x, branch: bool):
        h = x + torch.tanh(self.fc(self.norm(x)))
        return h + 0.5 * torch.tanh(self.branch(h)) if branch else h


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, D)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.spare = nn.Linear(D, OUT)
        self.head = nn.Linear(D, OUT)

    def forward(self, x):
        branch = bool(x[0, 0] > 0)  # data-dependent: the batch decides
        h = self.inp(x)
        for block in self.layers:
            h = block(h, branch)
        return self.head(h)


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def data(case) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """[step][micro-batch][rank] -> (x, y); the branch runs on rank 0 only (first micro-batch)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(STEPS):
        step = []
        for k in range(case.get("micro", 1)):
            per_rank = []
            for r in range(WORLD):
                x = torch.randn(PER_RANK, IN, generator=g)
                use = r == 0 and k == 0 and s in case.get("branch_steps", range(STEPS))
                x[:, 0] = 1.0 if use else -1.0
                per_rank.append((x, torch.randn(PER_RANK, OUT, generator=g)))
            step.append(per_rank)
        out.append(step)
    return out


def optimizers(model, case, sharded: bool) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    if case["opt"] == "adamw":
        return [torch.optim.AdamW(model.parameters(), **ADAMW)]
    if case["opt"] == "sgd":
        return [torch.optim.SGD(model.parameters(), **SGD)]
    if case["opt"] == "shard_params":
        if sharded:
            return [torch.optim.AdamW(mf.shard_params(model), **ADAMW),
                    mf.matrix_optimizer(torch.optim.SGD, model, **SGD)]
        return [torch.optim.AdamW([p for n, p in named if not is_muon_name(n, p)], **ADAMW),
                torch.optim.SGD([p for n, p in named if is_muon_name(n, p)], **SGD)]
    if sharded:
        return [mf.Muon(mf.muon_param_groups(
            model, **MUON, ns_dtype=torch.float32, adamw_lr=ADAMW["lr"],
            adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
            adamw_weight_decay=ADAMW["weight_decay"]))]
    return [torch.optim.Muon([p for n, p in named if is_muon_name(n, p)], **MUON),
            torch.optim.AdamW([p for n, p in named if not is_muon_name(n, p)], **ADAMW)]


def _run(rank, world_size, name, case):
    model = build()
    dims = dict(mesh_dim_names=("replicate", "shard")) if case.get("hsdp") else {}
    mesh = init_device_mesh("cpu", (world_size, 1) if case.get("hsdp") else (world_size,), **dims)
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh, debug=case.get("debug", False))
    params, root = dict(model.named_parameters()), mf.get_root(model)
    opts = optimizers(model, case, True)
    for s, step in enumerate(data(case)):
        if case.get("fails") == s:  # raises in block 0's backward; the user skips the step
            hook = model.layers[0].register_forward_hook(
                lambda m, a, out: (out.register_hook(_raise), None)[1])
            x, y = step[0][rank]
            with pytest.raises(RuntimeError, match="injected"):
                F.mse_loss(model(x), y).backward()
            hook.remove()
            for o in opts:
                o.zero_grad()
            continue
        for k, micro in enumerate(step):
            last = k == len(step) - 1
            model.set_requires_gradient_sync(last or case.get("sync_each", False))
            x, y = micro[rank]
            F.mse_loss(model(x), y).backward()
            if not last:
                continue
            for n in UNUSED:  # unused on every rank: no gradient, as torch
                assert params[n].grad is None, (name, n, rank)
            for n in BRANCH:  # used on rank 0 only: the average with zeros, on every rank
                p, here = params[n], root.groups.steps_here(mf.plan_of(model).placements[n])
                if s in case.get("branch_steps", range(STEPS)) and p.numel() and here:
                    assert p.grad is not None, (name, n, rank)
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
    for o in opts:  # an unused parameter gets no optimizer state either
        assert not any(o.state.get(params[n]) for n in UNUSED), (name, rank)
    # which ranks had a gradient travels inside each unit's reduce (one flag per parameter):
    # no all-reduce of its own
    calls = mf.comm_stats(model).calls
    assert "all_reduce" not in calls and "grad_flags" not in calls, (name, calls)
    return {n: t.clone() for n, t in mf.full_state_dict(model).items()}


def _raise(*_):
    raise RuntimeError("injected")


def _worker(rank, world_size, out_path):
    results, times = {}, {}
    for name, case in CASES.items():
        t0 = time.perf_counter()
        results[name] = _run(rank, world_size, name, case)
        times[name] = time.perf_counter() - t0
    if rank == 0:
        torch.save((results, times), out_path)


def reference(case) -> dict[str, torch.Tensor]:
    """torch on one process: each micro-batch's loss is the mean over ranks of the ranks'
    losses, so a parameter used on rank 0 only gets rank 0's gradient / world size."""
    model = build()
    opts = optimizers(model, case, False)
    with reference_ns_fp32():
        for s, step in enumerate(data(case)):
            if case.get("fails") == s:
                continue
            for micro in step:
                sum(F.mse_loss(model(x), y) for x, y in micro).div(WORLD).backward()
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_unused_parameters_are_skipped_as_in_torch(tmp_path):
    out = tmp_path / "out.pt"
    spawn(_worker, WORLD, str(out))
    results, times = torch.load(out)
    initial = {n: p.detach() for n, p in build().named_parameters()}
    for name, case in CASES.items():
        ours, ref = results[name], reference(case)
        diff = max((ours[n] - ref[n]).abs().max().item() for n in ref)
        print(f"{name}: max |ours - torch| = {diff:.3g} ({times[name]:.2f} s on the ranks)")
        for n in UNUSED:
            assert torch.equal(ours[n], initial[n]), f"{name}: unused {n} moved"
        for n in BRANCH:  # stepped where used (else the case would prove nothing about it)
            used = set(case.get("branch_steps", range(STEPS))) - {case.get("fails")}
            assert torch.equal(ref[n], initial[n]) != bool(used), (name, n)
        assert_params_close(ours, ref, what=f"{name}: ")
