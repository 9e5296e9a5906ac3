"""HSDP on a 2-D (replicate, shard) mesh: exact against torch's single-process optimizers,
each Muon matrix stepped by one world rank, replicas bit-identical, no collective in the
step, and the bytes across the replicate dimension equal to FSDP2 HSDP's."""

from __future__ import annotations

import contextlib
import copy
import os
import re

import pytest
import torch
import torch.distributed as dist
from helpers.collectives import Collectives
from helpers.parity import ADAMW, MUON, ODD, muon_groups
from helpers.rank_pool import spawn
from helpers.reference import (
    PARITY_TOL,
    assert_params_close,
    batches,
    build_model,
    is_muon_name,
    log_diff,
    rank_slice,
    reference_ns_fp32,
    train_reference,
)
from helpers.replicate_bytes import replicate_bytes_from_layout
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.profiler import ProfilerActivity, profile, record_function

import matrixfsdp as mf
from benchmarks.harness.measure import RANGE_PREFIX, analyse_profile
from matrixfsdp.layout.planner import plan_module
from matrixfsdp.layout.report import format_report
from matrixfsdp.runtime.param import placement_of
from matrixfsdp.train.models import PRESETS, GPTConfig

STEPS, PER_RANK, SEQ = 4, 2, 16
DIMS = ("replicate", "shard")
BIT = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)  # torch's default eps
# Every dim divisible by 2: FSDP2 pads no shard, so its bytes compare exactly with ours.
EVEN = dict(vocab_size=256, d_model=32, n_heads=4, n_layers=2, d_mlp=64, seq_len=16)


def _shard(model, mesh, debug=False, mp=None):
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh, mp_policy=mp)
    mf.fully_shard(model, mesh=mesh, debug=debug, mp_policy=mp)
    return model


def _replicas_equal(root) -> bool:
    """Every unit's local segment is bit-identical across the replicas (same shard rank)."""
    g = root.groups
    if g.replicas == 1:
        return True
    for u in root.units:
        copies = [torch.empty_like(u.local) for _ in range(g.replicas)]
        dist.all_gather(copies, u.local, group=g.replicate)
        if not all(torch.equal(c, copies[0]) for c in copies):
            return False
    return True


def _train(rank, job):
    """One HSDP run; returns what rank 0 saves (other ranks assert their own checks)."""
    R, S = job["shape"]
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=DIMS)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if job.get("bf16") else None
    model = _shard(build_model("gpt", GPTConfig(**ODD)), mesh, job.get("debug", False), mp)
    root = mf.get_root(model)
    world_rank = root.groups.world_rank
    assert world_rank == rank  # init_device_mesh: replicate-major, as the plan counts
    ns_dtype = torch.float32 if job["ns_fp32"] else torch.bfloat16
    opt = mf.Muon(muon_groups(model, MUON, job["adamw"], ns_dtype))
    data = batches(STEPS, R * S, PER_RANK, SEQ)
    identical, unsynced = [], []
    counted = Collectives()
    for step, x in enumerate(data):
        x = rank_slice(x, rank, PER_RANK, job["same_data"])
        if step == job.get("fail_step"):  # raises inside backward; caught, step skipped
            _failed_backward(model, x)
            opt.zero_grad(set_to_none=True)
            continue
        micro = job.get("micro", 1)
        for k, xm in enumerate(x.chunk(micro)):
            model.set_requires_gradient_sync(k == micro - 1)  # no reduce before the last
            with counted.during("forward", not counted["forward"]):
                loss = model.loss(xm[:, :-1], xm[:, 1:]) / micro
            if k == 0:  # the forward broadcast the matrices stepped last step
                identical.append(_replicas_equal(root))
            before = _reduce_calls(model)
            loss.backward()
            if k < micro - 1:
                unsynced.append(_reduce_calls(model) - before)
        if job.get("eval_between"):  # a gather between backward and step (metrics)
            with torch.no_grad():
                model.loss(x[:, :-1], x[:, 1:])
        if job.get("clip"):  # the global norm: each element once over the 2-D mesh
            mf.clip_grad_norm_(model.parameters(), job["clip"])
        for p in model.parameters():  # a 2-D matrix's gradient only on its owner rank:
            pl = placement_of(p)  # elsewhere empty, or zeros on another replica's copy
            if pl.owner is not None:
                assert p.grad is not None, pl.spec.name
                if pl.owner == world_rank:
                    assert p.grad.numel() == pl.spec.numel, pl.spec.name
                else:
                    assert not p.grad.any(), pl.spec.name
        with counted.during("step"):
            opt.step()
        opt.zero_grad(set_to_none=True)
    inside, other = counted["step"], counted["forward"]
    for p in model.parameters():  # momentum only on the owning world rank
        pl = placement_of(p)
        if pl.owner is not None:
            has = "momentum_buffer" in opt.state.get(p, {})
            assert has == (pl.owner == world_rank), f"momentum of {pl.spec.name} on {rank}"
    state = mf.full_state_dict(model)  # broadcasts the last step's matrices first
    flat = torch.cat([v.reshape(-1) for v in state.values()])
    every = [torch.empty_like(flat) for _ in range(R * S)]
    dist.all_gather(every, flat)
    assert all(torch.equal(f, flat) for f in every), "ranks hold different parameters"
    assert all(identical), f"replicas differ after a step's broadcast on rank {rank}: {identical}"
    assert not any(unsynced), f"a backward without gradient sync reduced: {unsynced}"
    assert len(unsynced) == (job.get("micro", 1) - 1) * (STEPS - (job.get("fail_step") is not None))
    stats = mf.comm_stats(model).summary()
    return dict(params=state, step_collectives=inside, other_collectives=other, stats=stats)


def _reduce_calls(model) -> int:
    """Gradient collectives so far: reduce-scatter, reduce, and across the replicas."""
    return sum(c["calls"] for k, c in mf.comm_stats(model).counts.items() if "reduce" in k)


def _raise(*_):
    raise RuntimeError("injected")


def _failed_backward(model, x) -> None:
    """A backward that raises in the middle (a hook on block 1's output), caught."""
    handle = model.layers[1].mlp.register_forward_hook(
        lambda m, a, out: (out.register_hook(_raise), None)[1])
    try:
        model.loss(x[:, :-1], x[:, 1:]).backward()
        raise AssertionError("the injected exception did not fire")
    except RuntimeError as e:
        assert "injected" in str(e), e
    finally:
        handle.remove()


def _bytes_across_replicas(rank, world):
    """One profiled step (after one warm-up step) of FSDP2 HSDP and of ours, same model.
    Returns per system the payload of each replicate-dim op kind (profiler rule)."""
    from torch.distributed.fsdp import fully_shard as fsdp2_shard
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=DIMS)
    x = torch.randint(0, 256, (PER_RANK, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    out = {}
    for system in ("fsdp2", "ours"):
        model = build_model("gpt", GPTConfig(**EVEN))
        if system == "fsdp2":
            for block in model.layers:
                fsdp2_shard(block, mesh=mesh)
            fsdp2_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            _shard(model, mesh)
            opt = mf.Muon(mf.muon_param_groups(model))
        for profiled in (False, True):
            if profiled and system == "ours":
                mf.comm_stats(model).reset()
            ctx = profile(activities=[ProfilerActivity.CPU], record_shapes=True) if profiled \
                else contextlib.nullcontext()
            with ctx as prof:
                with record_function(RANGE_PREFIX + "forward"):
                    loss = model.loss(x[:, :-1], x[:, 1:])
                with record_function(RANGE_PREFIX + "backward"):
                    loss.backward()
                with record_function(RANGE_PREFIX + "step"):
                    opt.step()
                    opt.zero_grad()
        ops: dict[str, int] = {}
        for phase in analyse_profile(prof, world, torch.device("cpu"))["collectives"].values():
            for name, rec in phase["ops"].items():
                if name in ("c10d::allreduce_", "c10d::reduce_", "c10d::broadcast_"):
                    ops[name] = ops.get(name, 0) + rec["bytes"]
        out[system] = ops
        if system == "ours":
            out["ours_stats"] = mf.comm_stats(model).summary()
            out["ours_expected"] = replicate_bytes_from_layout(mf.plan_of(model), rank)
            out["ours_params"] = sum(len(u.sharded) for u in mf.get_root(model).units)
    plain = build_model("gpt", GPTConfig(**EVEN))  # FSDP2: every gradient's shard (EVEN: no padding)
    out["fsdp2_expected"] = {"c10d::allreduce_": sum(p.numel() * p.element_size() // (world // 2)
                                                     for p in plain.parameters())}
    return out


def _train_moe(rank):
    """Expert stacks under HSDP 2x2: split by whole experts in the shard group, averaged
    over the replicas, stepped on every replica (helpers.moe_models' model and reference)."""
    from helpers import moe_models as moe
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS)
    model = moe.build("hand")
    for block in moe.blocks(model, "hand"):
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    root = mf.get_root(model)
    adamw = {f"adamw_{k}": v for k, v in moe.ADAMW.items() if k != "lr"}
    opt = mf.Muon(mf.muon_param_groups(model, **moe.MUON, ns_dtype=torch.float32,
                                       adamw_lr=moe.ADAMW["lr"], **adamw))
    identical = []
    for x in moe.global_batches(4):
        loss = moe.loss_fn(model, "hand", x[rank * moe.PER_RANK:(rank + 1) * moe.PER_RANK])
        identical.append(_replicas_equal(root))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for p in model.parameters():
        pl = placement_of(p)
        if pl.spec.is_experts:  # momentum wherever the shard rank holds experts, every replica
            has = "momentum_buffer" in opt.state.get(p, {})
            assert has == (pl.matrices_on(root.shard_rank) > 0), pl.spec.name
    assert all(identical), identical
    return dict(params=mf.full_state_dict(model), stats=mf.comm_stats(model).summary())


def _diverge(rank):
    """Rank 3 skips block 1 at step 2 under HSDP with debug on: every rank must raise."""
    from helpers.diverging_model import CFG, SkippingGPT, train_until_error
    torch.manual_seed(0)
    model = SkippingGPT(CFG)
    model.skip_rank, model.skip_step = 3, 2
    _shard(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS), debug=True)
    return train_until_error(model, mf.Muon(mf.muon_param_groups(model)))


def _checkpoint(rank, out_dir):
    """2x2: 4 steps straight vs 2 steps, dcp.save, a fresh model (other weights) loads, 2
    more steps: bit-identical, momentum only on owner world ranks. The same checkpoint
    loaded on a 1-D mesh of 4 ranks: every element was saved once (within PARITY_TOL after
    2 more steps; the gradient average differs in summation order only)."""
    import torch.distributed.checkpoint as dcp
    data = batches(4, 4, PER_RANK, SEQ)

    def build(shape, seed=0):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=DIMS if len(shape) == 2 else None)
        model = _shard(build_model("gpt", GPTConfig(**ODD), seed=seed), mesh)
        return model, mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32))

    def train(model, opt, steps):
        for i in steps:
            x = rank_slice(data[i], rank, PER_RANK, False)
            model.loss(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()

    def resume(shape):
        model, opt = build(shape, seed=123)
        state = mf.get_state_dict(model, opt)
        dcp.load(state, checkpoint_id=path)
        mf.set_state_dict(model, opt, state)
        world_rank = mf.get_root(model).groups.world_rank
        for p in model.parameters():
            pl = placement_of(p)
            if pl.owner is not None:
                assert ("momentum_buffer" in opt.state.get(p, {})) == (pl.owner == world_rank)
        train(model, opt, range(2, 4))
        return mf.full_state_dict(model)

    straight = build((2, 2))
    train(*straight, range(4))
    first = build((2, 2))
    train(*first, range(2))
    path = os.path.join(out_dir, "ckpt")
    dcp.save(mf.get_state_dict(*first), checkpoint_id=path)
    want = mf.full_state_dict(straight[0])
    same = all(torch.equal(a, b) for a, b in zip(want.values(), resume((2, 2)).values()))
    flat = max((a - b).abs().max().item() for a, b in zip(want.values(), resume((4,)).values()))
    return dict(same=same, flat=flat)


def _worker(rank, world, jobs, out_dir):
    run = {"bytes": lambda: _bytes_across_replicas(rank, world), "moe": lambda: _train_moe(rank),
           "diverge": lambda: _diverge(rank), "checkpoint": lambda: _checkpoint(rank, out_dir)}
    results = {}
    for name, job in jobs.items():
        results[name] = run[job]() if isinstance(job, str) else _train(rank, job)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _reference(job):
    R, S = job["shape"]
    data = batches(STEPS, R * S, PER_RANK, SEQ)
    if job["same_data"]:
        data = [x[:PER_RANK] for x in data]
    data = [x for step, x in enumerate(data) if step != job.get("fail_step")]
    return train_reference(GPTConfig(**ODD), data, muon_kw=MUON, adamw_kw=job["adamw"],
                           ns_fp32=job["ns_fp32"], rule=is_muon_name, clip=job.get("clip"))


def _check_run(name, job, ours):
    assert ours["step_collectives"] == 0, f"{name}: optimizer.step() issued collectives"
    assert ours["other_collectives"] > 0
    ref = _reference(job)
    assert list(ours["params"]) == list(ref)
    if job["same_data"]:  # equal data on every rank: the same sums, bit for bit
        for n, p in ref.items():
            assert torch.equal(ours["params"][n], p), f"{name}: {n} differs"
    else:
        assert_params_close(ours["params"], ref, what=f"{name}: ")


DIFF = dict(same_data=False, ns_fp32=True, adamw=ADAMW)
SAME = dict(same_data=True, ns_fp32=False, adamw=BIT)
# One 4-rank spawn runs every 4-rank scenario (spawns dominate the time); each is its own test.
FOUR = {"2x2 different data": {**DIFF, "shape": (2, 2), "clip": 0.25, "eval_between": True},
        "2x2 equal data": {**SAME, "shape": (2, 2), "debug": True},
        "4x1 different data": {**DIFF, "shape": (4, 1)},
        # FSDP2 habits under HSDP at 4 ranks: 2 micro-batches, the first without gradient
        # sync; a backward that raises at step 1, caught (the reference skips that step)
        "2x2 no-sync, caught exception": {**DIFF, "shape": (2, 2), "micro": 2, "fail_step": 1},
        "bytes": "bytes", "moe": "moe", "checkpoint": "checkpoint", "diverge": "diverge"}
TWO = {"2x1 different data": {**DIFF, "shape": (2, 1)},
       "1x2 different data": {**DIFF, "shape": (1, 2)},
       "2x1 equal data": {**SAME, "shape": (2, 1)},
       "2x1 bf16 policy": {**DIFF, "shape": (2, 1), "bf16": True},
       # no-sync under a bf16 policy: gradients accumulate unsharded in the reduce dtype
       "1x2 bf16 no-sync": {**DIFF, "shape": (1, 2), "bf16": True, "micro": 2}}


def _spawned(tmp_path_factory, world: int, jobs: dict) -> list[dict]:
    out = tmp_path_factory.mktemp(f"hsdp{world}")
    spawn(_worker, world, jobs, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    return _spawned(tmp_path_factory, 4, FOUR)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return _spawned(tmp_path_factory, 2, TWO)


@pytest.mark.parametrize("name", [n for n, j in FOUR.items() if not isinstance(j, str)])
def test_four_ranks_match_torch(name, four_ranks):
    """2x2 and 4x1, different data: within PARITY_TOL of torch (fp32 NS; 2x2 with global-norm
    clipping and a no-grad forward between backward and step, which must not use up the
    broadcast the step makes necessary; 2x2 with gradient accumulation without sync and a
    backward that raised and was caught, against torch skipping that step); 2x2 equal data
    bit-identical (bf16 NS, default eps, debug mode on). No collective in the step; replicas
    identical after each broadcast."""
    _check_run(name, FOUR[name], four_ranks[0][name])


def test_expert_stacks_match_torch_under_hsdp(four_ranks):
    """Experts split over the shard group, all-reduced over the replicas: within PARITY_TOL
    of torch.optim.Muon on each expert."""
    from helpers import moe_models as moe
    ref, _ = moe.train_reference("hand", moe.global_batches(4))
    assert_params_close(four_ranks[0]["moe"]["params"], ref, what="moe 2x2: ")


def test_checkpoint_resumes_bit_identically_and_loads_on_a_1d_mesh(four_ranks):
    ck = four_ranks[0]["checkpoint"]
    assert ck["same"], "2x2 resume differs from training straight through"
    assert ck["flat"] <= PARITY_TOL, ck  # 1-D, 4 ranks: another summation order only
    log_diff(ck["flat"], "checkpoint 1-D")


def test_debug_mode_names_a_diverging_rank_on_every_rank(four_ranks):
    for r, res in enumerate(four_ranks):  # the same error on every rank, naming rank 3's
        message = res["diverge"]  # position (the first collective that differs)
        assert "ranks diverged" in message and "rank 3: step 3, " in message, (r, message)


def test_replicate_dim_bytes_follow_the_layout_and_equal_fsdp2_hsdp(four_ranks):
    """2x2, one profiled step: each replicate-dim op kind moves, on every rank, exactly the
    bytes the plan's layout says (ours: all-reduce of the even rows, reduce + broadcast of the
    matrices stored on the rank's shard; FSDP2: all-reduce of every gradient shard), our
    counters agree with the profiler, and the bytes each rank sends (the bench's ring rule,
    bench.report.replicate_dim_bytes) equal FSDP2 HSDP's."""
    from benchmarks.harness.report import _REPLICATE_OPS
    R = 2  # _bytes_across_replicas's mesh: (2, world // 2)
    sent = {"ours": 0.0, "fsdp2": 0.0}
    for r, res in enumerate(four_ranks):
        b = res["bytes"]
        assert b["fsdp2"] == b["fsdp2_expected"], (r, b["fsdp2"], b["fsdp2_expected"])
        stats = b["ours_stats"]

        def counted(key, stats=stats):
            return stats.get(key, {}).get("payload_bytes", 0)
        # the profiler names an op, not its group: shard-dim broadcasts and reduces (the
        # gathers and gradient reduces of whole matrices) share the replicate dim's names
        replicate = {op: counted(key) for op, key in (
            ("c10d::allreduce_", "replicate_allreduce"), ("c10d::reduce_", "replicate_reduce"),
            ("c10d::broadcast_", "replicate_broadcast"))}
        expected = dict(b["ours_expected"])
        extra = expected.pop("extra")
        assert replicate == expected, (r, replicate, expected)
        # no other all-reduce: the gradient flags travel inside the reduces
        assert b["ours"].get("c10d::allreduce_", 0) == replicate["c10d::allreduce_"], r
        for op, key in (("c10d::reduce_", "reduce"), ("c10d::broadcast_", "broadcast")):
            assert b["ours"].get(op, 0) == replicate[op] + counted(key), (r, op)
        sent["ours"] += sum(replicate[op] * f * (R - 1) / R for op, f in _REPLICATE_OPS.items())
        sent["fsdp2"] += sum(b["fsdp2"].get(op, 0) * f * (R - 1) / R
                             for op, f in _REPLICATE_OPS.items())
        # beyond FSDP2 HSDP's: the flags (all-reduced) and the matrices' alignment (reduced
        # and broadcast)
        sent["extra"] = sent.get("extra", 0) + extra
    assert sent["ours"] == sent["fsdp2"] + sent["extra"] > 0, sent


@pytest.mark.parametrize("name", [n for n, j in TWO.items() if not j.get("bf16")])
def test_two_ranks_match_torch(name, two_ranks):
    """2x1 (pure replication: each matrix reduced to one replica, broadcast back) and 1x2
    (a 2-D mesh with one replica: plain sharding) within PARITY_TOL of torch; 2x1 with equal
    data bit-identical."""
    _check_run(name, TWO[name], two_ranks[0][name])


def test_2x1_bf16_policy_keeps_replicas_identical(two_ranks):
    """Under a bf16 MixedPrecisionPolicy the fp32 masters are what is broadcast: the replicas
    stay bit-identical (asserted on each rank in _train) and the step issues no collective."""
    assert two_ranks[0]["2x1 bf16 policy"]["step_collectives"] == 0


def _bf16_no_sync_reference(job, keep: int | None = None) -> dict[str, torch.Tensor]:
    """What ``job`` (a bf16 policy, ``micro`` micro-batches of which only the last syncs)
    means, on one process: fp32 masters; each step a bf16 copy of them computes, for each
    rank's slice and each of its micro-batches, the gradient of ``loss / micro``; each is
    cast to fp32 and summed per rank (the unsharded accumulation in reduce_dtype), the ranks'
    sums averaged in fp32 and stepped by torch.optim.Muon (fp32 NS) / AdamW. ``keep=k``:
    only micro-batch k of each rank is kept (the others dropped, as a runtime that lost the
    unsynced gradients would), for the test to show it tells the two apart."""
    R, S = job["shape"]
    world, micro = R * S, job["micro"]
    master = build_model("gpt", GPTConfig(**ODD))
    low = copy.deepcopy(master).to(torch.bfloat16)
    named = list(master.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_muon_name(n, p)], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named if not is_muon_name(n, p)], **job["adamw"])
    with reference_ns_fp32():
        for x in batches(STEPS, world, PER_RANK, SEQ):
            with torch.no_grad():
                for p32, p16 in zip(master.parameters(), low.parameters()):
                    p16.copy_(p32)
            total = [torch.zeros_like(p) for p in master.parameters()]
            for rank in range(world):
                acc = [torch.zeros_like(p) for p in master.parameters()]
                for k, xm in enumerate(rank_slice(x, rank, PER_RANK, False).chunk(micro)):
                    (low.loss(xm[:, :-1], xm[:, 1:]) / micro).backward()
                    for a, p16 in zip(acc, low.parameters()):
                        if keep is None or k == keep:
                            a += p16.grad.float()
                        p16.grad = None
                for t, a in zip(total, acc):
                    t += a
            for p32, t in zip(master.parameters(), total):
                p32.grad = t / world
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
    return {n: p.detach() for n, p in master.named_parameters()}


def test_bf16_policy_without_gradient_sync_keeps_every_micro_batch(two_ranks):
    """bf16 policy, 2 micro-batches, the first without sync (no reduce in it: asserted in
    _train): equal within PARITY_TOL to one process doing what the policy means, micro-batch
    by micro-batch (each rank's bf16 gradients cast to fp32 and summed, the sums averaged):
    the same bf16 products, so only fp32 summation orders differ. A runtime that dropped the
    unsynced micro-batch is a Muon step (lr-sized) away; the test checks it can tell: the
    reference keeping only the last micro-batch is asserted > 100 * PARITY_TOL away. The step
    issues no collective."""
    job = TWO["1x2 bf16 no-sync"]
    ours = two_ranks[0]["1x2 bf16 no-sync"]
    assert ours["step_collectives"] == 0
    worst = assert_params_close(ours["params"], _bf16_no_sync_reference(job),
                                what="1x2 bf16 no-sync: ")
    dropped = _bf16_no_sync_reference(job, keep=job["micro"] - 1)
    gap = max(((ours["params"][n] - p).abs() / (1 + p.abs())).max().item() for n, p in dropped.items())
    print(f"\n1x2 bf16 no-sync: {worst:.3g} from the reference, {gap:.3g} from it without micro-batch 0")
    assert gap > 100 * PARITY_TOL, gap


def test_replicate_collectives_only_where_there_are_replicas(two_ranks):
    stats = {n: two_ranks[0][n]["stats"] for n in ("1x2 different data", "2x1 different data")}
    assert "replicate_reduce" not in stats["1x2 different data"]
    assert stats["2x1 different data"]["replicate_broadcast"]["calls"] > 0


def test_plan_balances_ns_over_the_whole_world():
    """Owners are world ranks: NS per rank is total / (replicas x shard), and each matrix
    is stored on its owner's shard rank in every replica."""
    cfg = GPTConfig(d_model=32, n_heads=2, n_layers=2, d_mlp=64, seq_len=8)
    with torch.device("meta"):
        model = build_model("gpt", cfg)
    flat = plan_module(model, list(model.layers), 2)
    hsdp = plan_module(model, list(model.layers), 4, shard_size=2)
    assert hsdp.replicas == 2 and hsdp.shard_size == 2
    assert sum(hsdp.rank_cost) == sum(flat.rank_cost)  # the same NS, done once in the world
    assert max(hsdp.rank_cost) * 4 == sum(hsdp.rank_cost)  # 12 matrices, 3 per world rank
    for pl in hsdp.placements.values():
        assert len(pl.row_ranges) == 2
        if pl.owner is not None:
            assert pl.row_ranges[pl.owner % 2] == (0, pl.spec.rows)
    text = format_report(hsdp)
    assert "4 ranks = 2 replicas x 2 shard ranks" in text and "| 3 | (1, 1) | 3 |" in text


def test_cli_plan_with_shard_size(capsys):
    from matrixfsdp.__main__ import main
    main(["plan", "--model", "llama3-405b", "--world-size", "4096", "--shard-size", "8",
          "--max-rows", "4"])
    text = capsys.readouterr().out
    # --shard-size restricts the search to layouts of that shard group (docs/plan.md)
    assert re.search(r"Advice: \*\*replicate \d+ x shard 8 x tp \d+ x pp \d+( \([a-z0-9 ]+\))?\*\*",
                     text), text[:400]
    assert "Newton-Schulz" in text
    assert PRESETS["llama3-405b"].n_layers == 126
