"""mf.clip_grad_norm_ and mf.nonfinite_grad_names: global over the ranks' disjoint gradient
pieces, equal to torch's clip_grad_norm_ of one process on the concatenated global batch."""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers.rank_pool import spawn
from helpers.reference import assert_params_close, batches, build_model, rank_slice, train_reference
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.train.models import GPT, GPTConfig

# Shapes divisible by none of 2 and 3 (as helpers.parity's ODD), one block to keep it fast.
CFG = dict(vocab_size=256, d_model=35, n_heads=5, n_layers=1, d_mlp=55, seq_len=17)
PER_RANK, SEQ, STEPS = 2, 16, 4
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
# eps 1e-5, not helpers.parity's 1e-6: here pos.weight[12, 1] has a first-step gradient of
# ~4e-8, where Adam's slope lr/eps turns the summation-order rounding of 3 ranks vs one
# process into a 4e-6 parameter difference, with or without clipping (measured).
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.01)
CLIP = 0.2  # the true norms here are 0.6-0.8: clipping is active at every step
NORMS = (2.0, math.inf)
HUGE = 1e9  # a max_norm that never clips (the scale is clamped to exactly 1)


def _extra_param() -> nn.Parameter:
    """A plain (replicated) parameter with the same gradient on every rank."""
    g = torch.Generator().manual_seed(7)
    p = nn.Parameter(torch.zeros(7))
    p.grad = torch.randn(7, generator=g)
    return p


def _shard(model, mesh):
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    return mf.fully_shard(model, mesh=mesh)


def _torch_norms_refused(model) -> dict:
    """torch's norm entry points over the sharded grads: the error each raised on this rank,
    whether every grad is bit-unchanged afterwards, and the norm torch would have computed
    (over this rank's pieces, taken as plain tensors)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    before = [g.clone() for g in grads]
    calls = {"clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3),
             "get_total_norm": lambda: torch.nn.utils.get_total_norm(grads),
             "Tensor.norm": lambda: grads[-1].norm()}
    res = {}
    for name, call in calls.items():
        try:
            call()
            res[f"refused {name}"] = None
        except RuntimeError as e:
            res[f"refused {name}"] = str(e)
    res["untouched"] = all(torch.equal(g, b) for g, b in zip(grads, before))
    res["torch_own"] = torch.nn.utils.get_total_norm([g.as_subclass(torch.Tensor) for g in grads])
    return res


def _worker(rank, world_size, out_dir):
    cfg = GPTConfig(**CFG)
    mesh = init_device_mesh("cpu", (world_size,))
    res = {}

    # 1. The norm of one backward, ours and torch's own, on this rank.
    model = _shard(build_model("gpt", cfg), mesh)
    x = rank_slice(batches(1, world_size, PER_RANK, SEQ)[0], rank, PER_RANK, same_data=False)
    model.loss(x[:, :-1], x[:, 1:]).backward()
    res.update(_torch_norms_refused(model))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for p in NORMS:  # a list's norms (foreach: torchtitan's clip_grad_norm_) are FSDP2's
        res[f"foreach_{p}"] = torch.nn.utils.get_total_norm(grads, p, foreach=True).full_tensor()
    for p in NORMS:
        res[f"ours_{p}"] = mf.clip_grad_norm_(model.parameters(), HUGE, norm_type=p)
        res[f"extra_{p}"] = mf.clip_grad_norm_([*model.parameters(), _extra_param()], HUGE, p)

    # 2. Non-finite gradients: NaN in a Muon matrix on its owner (the last rank only), inf
    # in rank 1's row slice of the final norm's weight. Rank 0 sees only finite pieces.
    plan = mf.plan_of(model)
    matrix = next(n for n, pl in plan.placements.items() if pl.owner == world_size - 1)
    params = dict(model.named_parameters())
    if rank == world_size - 1:
        params[matrix].grad[0, 0] = math.nan
    if rank == 1:
        params["norm.weight"].grad[0] = math.inf
    res["injected"] = [n for n in plan.placements if n in (matrix, "norm.weight")]  # plan order
    res["names"] = mf.nonfinite_grad_names(model.parameters())
    try:
        mf.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        res["error"] = None
    except RuntimeError as e:
        res["error"] = str(e)
    res["nan_inf"] = mf.clip_grad_norm_(model.parameters(), 1.0, norm_type=math.inf)
    res["nan_2"] = mf.clip_grad_norm_(model.parameters(), 1.0)

    # 3. Training with clipping active.
    model = _shard(build_model("gpt", cfg), mesh)
    opt = mf.Muon(mf.muon_param_groups(model, **MUON, ns_dtype=torch.float32, adamw_lr=ADAMW["lr"],
                                       **{f"adamw_{k}": v for k, v in ADAMW.items() if k != "lr"}))
    res["train_norms"] = []
    for x in batches(STEPS, world_size, PER_RANK, SEQ):
        x = rank_slice(x, rank, PER_RANK, same_data=False)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        with torch.profiler.profile() as prof:  # the kernels the clipping took
            res["train_norms"].append(mf.clip_grad_norm_(model.parameters(), CLIP).item())
        res["foreach_mul"] = sum(e.name == "aten::_foreach_mul_" for e in prof.events())
        res["lone_mul"] = sum(e.name == "aten::mul_" and (e.cpu_parent is None or e.cpu_parent.name
                              != "aten::_foreach_mul_") for e in prof.events())  # CPU's foreach loops
        opt.step()
        opt.zero_grad()
    state = mf.full_state_dict(model)
    if rank == 0:
        res["params"] = state
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def run(request, tmp_path_factory):
    """Per world size: every rank's results, and the single-process references."""
    world_size = request.param
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp(f"clip{world_size}")
    spawn(_worker, world_size, str(out), timeout=120)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world_size)]
    cfg = GPTConfig(**CFG)
    model = build_model("gpt", cfg)
    x = batches(1, world_size, PER_RANK, SEQ)[0]
    model.loss(x[:, :-1], x[:, 1:]).backward()
    grads = [p.grad for p in model.parameters()]
    ref = {}
    for p in NORMS:
        ref[f"ours_{p}"] = torch.nn.utils.get_total_norm(grads, p)
        ref[f"extra_{p}"] = torch.nn.utils.get_total_norm([*grads, _extra_param().grad], p)
    ref["params"] = train_reference(cfg, batches(STEPS, world_size, PER_RANK, SEQ), muon_kw=MUON,
                                    adamw_kw=ADAMW, ns_fp32=True, clip=CLIP)
    return world_size, ranks, ref


def test_norm_is_global_and_equal_on_every_rank(run):
    """Different data per rank: the norm is the single-process norm of the global batch's
    gradient (p = 2 and inf; with a replicated parameter counted once), bit-equal on every
    rank."""
    world_size, ranks, ref = run
    for key in [f"{k}_{p}" for k in ("ours", "extra") for p in NORMS]:
        for r, res in enumerate(ranks):
            assert torch.equal(res[key], ranks[0][key]), f"{key}: rank {r} {res[key]} vs {ranks[0][key]}"
        torch.testing.assert_close(ranks[0][key], ref[key], rtol=1e-5, atol=0, msg=f"{key}")
    for p in NORMS:  # torch's get_total_norm(foreach=True): partial DTensors, reduced globally
        for res in ranks:
            torch.testing.assert_close(res[f"foreach_{p}"], ref[f"ours_{p}"], rtol=1e-5, atol=0)
    print(f"\n{world_size} ranks: max rel. norm diff "
          f"{max(abs(ranks[0][k] / ref[k] - 1).item() for k in ref if k != 'params'):.2e}")


def test_torch_own_clip_is_refused_on_every_rank(run):
    """Why: torch's norm over this rank's pieces differs on every rank, each below the true
    one (so its clip_grad_norm_ would scale each rank by its own factor). It is refused:
    clip_grad_norm_, get_total_norm (foreach=None: a norm per gradient) and a grad's .norm()
    raise on every rank, naming a parameter, the rank and mf.clip_grad_norm_, and no grad has
    changed (on 8448813: a per-rank norm, each rank's grads scaled by its own factor)."""
    world_size, ranks, ref = run
    own = [res["torch_own"].item() for res in ranks]
    assert len(set(own)) == world_size, own
    assert all(n < ref["ours_2.0"].item() * 0.99 for n in own), (own, ref["ours_2.0"])
    for r, res in enumerate(ranks):
        for key in [k for k in res if k.startswith("refused ")]:
            err = res[key]
            assert err is not None, f"rank {r}: {key} was not refused"
            assert f"on rank {r}" in err and "sharded parameter '" in err, err
            assert "mf.clip_grad_norm_" in err and "mf.total_grad_norm" in err, err
        assert res["untouched"], f"rank {r}: a grad changed"


def test_nonfinite_grads_raise_on_every_rank(run):
    """NaN in one rank's piece, inf in another's: every rank raises (no hang) naming both,
    nonfinite_grad_names agrees on every rank, and the returned norms are NaN."""
    world_size, ranks, _ = run
    injected = ranks[0]["injected"]
    assert len(injected) == 2
    for r, res in enumerate(ranks):
        assert res["names"] == injected, f"rank {r}: {res['names']} vs {injected}"
        assert res["error"] is not None, f"rank {r} did not raise"
        assert "is non-finite, so it cannot be clipped" in res["error"]
        assert all(n in res["error"] for n in injected), res["error"]
        assert math.isnan(res["nan_inf"]) and math.isnan(res["nan_2"]), (r, res["nan_inf"], res["nan_2"])


def test_training_with_clipping_matches_torch(run):
    """Clipping active at every step; after the steps the parameters match torch.optim.Muon +
    AdamW with torch's clip_grad_norm_ on one process (fp32 NS, the parity bound PARITY_TOL)."""
    world_size, ranks, ref = run
    norms = ranks[0]["train_norms"]
    assert min(norms) > 2 * CLIP, norms
    assert all(res["train_norms"] == norms for res in ranks)
    ours = ranks[0]["params"]
    assert list(ours) == list(ref["params"])
    assert_params_close(ours, ref["params"])


SMALL = GPTConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=24, seq_len=8)


def _one_rank_model(dtype=torch.float32):
    torch.manual_seed(0)
    plain = GPT(SMALL).to(dtype)
    model = GPT(SMALL).to(dtype)
    model.load_state_dict(plain.state_dict())
    return plain, _shard(model, init_device_mesh("cpu", (1,)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_matches_torch(world1, dtype):
    """fp32 and bf16 grads: same norm and same clipped grads as torch (bf16: torch's norm is
    itself bf16, ours accumulates in fp32, so to bf16 rounding)."""
    plain, model = _one_rank_model(dtype)
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    for m in (plain, model):
        m.loss(x[:, :-1], x[:, 1:]).backward()
    for p in NORMS:
        ref = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1, norm_type=p)
        ours = mf.clip_grad_norm_(model.parameters(), 0.1, norm_type=p)
        assert ours.dtype == torch.float32
        tol = dict(rtol=1e-5, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=0)
        torch.testing.assert_close(ours, ref.float(), **tol)
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **tol, msg=lambda m, name=name: f"{name}: {m}")
    assert mf.nonfinite_grad_names(model.parameters()) == []


def test_torch_own_clip_works_on_one_rank(world1):
    """On a one-rank mesh every gradient is whole here, so torch's clip_grad_norm_ is not
    refused and gives torch's own norm and clipped gradients."""
    plain, model = _one_rank_model()
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    for m in (plain, model):
        m.loss(x[:, :-1], x[:, 1:]).backward()
    ref = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1), ref,
                               rtol=1e-6, atol=0)
    for a, b in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-9)


def test_two_roots_and_bad_norm_type(world1):
    a, b = (_one_rank_model()[1] for _ in range(2))
    mf.plan_of(a), mf.plan_of(b)
    with pytest.raises(ValueError, match=r"'embed.weight' and 'embed.weight' belong to different"):
        mf.clip_grad_norm_([*a.parameters(), *b.parameters()], 1.0)
    with pytest.raises(ValueError, match="norm_type must be > 0"):
        mf.clip_grad_norm_(a.parameters(), 1.0, norm_type=0)


def test_clip_scales_with_torchs_foreach_kernels(run):
    """The scaling is torch's own foreach kernel, one per device and dtype: torch picks it only
    for gradients of exactly torch.Tensor, and the shards' gradients are this library's
    subclass, so through torch's clip_grads_with_norm_ it took one mul_ per gradient (a
    launch each on a GPU). The training with clipping matches torch (the test above)."""
    _, ranks, _ = run
    for res in ranks:
        assert res["foreach_mul"] == 1 and res["lone_mul"] == 0, (res["foreach_mul"], res["lone_mul"])


# ---- lists of p.grad: one length on every rank, whatever each rank owns ------------------------
CLIPS = ("torch", "torchtitan", "mf")  # whose clip_grad_norm_ each run calls


def _clip(which: str, params, max_norm: float) -> torch.Tensor:
    """One clip by the caller's usual function: torch's with foreach (norms of a list, as
    FSDP2's DTensor gradients give them), torchtitan's (its list ``[p.grad for p in params if
    p.grad is not None]``), or this library's."""
    if which == "torch":
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True).full_tensor()
    if which == "torchtitan":
        from helpers import titan_cpu
        titan_cpu.import_torchtitan()
        from torchtitan.distributed.utils import clip_grad_norm_
        return clip_grad_norm_(params, max_norm, foreach=True)
    return mf.clip_grad_norm_(params, max_norm)


def _unequal_owners(rank, world_size, out_dir, shape):
    """One block's 6 matrices over 4 ranks (2, 2, 1, 1 each; under HSDP 2 x 2 each copy of a
    matrix stepped by one replica): trained with each clip, clipping active at every step."""
    mesh = init_device_mesh("cpu", shape, **({"mesh_dim_names": ("replicate", "shard")}
                                              if len(shape) == 2 else {}))
    cfg = GPTConfig(**CFG)
    res = {}
    for which in CLIPS:
        model = _shard(build_model("gpt", cfg), mesh)
        opt = mf.Muon(mf.muon_param_groups(model, **MUON, ns_dtype=torch.float32, adamw_lr=ADAMW["lr"],
                                           **{f"adamw_{k}": v for k, v in ADAMW.items() if k != "lr"}))
        stepped = sum(pl.owner == rank for pl in mf.plan_of(model).placements.values())
        res[which] = dict(stepped=stepped, lengths=[], norms=[])
        for x in batches(STEPS, world_size, PER_RANK, SEQ):
            x = rank_slice(x, rank, PER_RANK, same_data=False)
            model.loss(x[:, :-1], x[:, 1:]).backward()
            res[which]["lengths"].append(sum(p.grad is not None for p in model.parameters()))
            res[which]["norms"].append(_clip(which, model.parameters(), CLIP).item())
            opt.step()
            opt.zero_grad()
        state = mf.full_state_dict(model)
        if rank == 0:
            res[which]["params"] = state
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("shape", [(4,), (2, 2)], ids=["1d", "hsdp2x2"])
def test_clip_over_unequal_owners(tmp_path, shape):
    """Ranks that own different numbers of matrices (and, under HSDP, copies of matrices
    another replica steps) hand torch's clip, torchtitan's and this library's lists of
    ``p.grad`` of one length on every rank (each rank holds a gradient of every parameter:
    empty where it holds nothing of it, zeros on a copy another replica steps), and each
    clip trains as torch's clip_grad_norm_ on one process: the same norm on every rank, the
    parameters within the parity bound. (Before: gloo's "8 vs 4" collective mismatch in
    torchtitan's clip, a hang or a wrong norm on NCCL.)"""
    world_size = 4
    spawn(_unequal_owners, world_size, str(tmp_path), shape)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    ref = train_reference(GPTConfig(**CFG), batches(STEPS, world_size, PER_RANK, SEQ),
                          muon_kw=MUON, adamw_kw=ADAMW, ns_fp32=True, clip=CLIP)
    assert len({res["torch"]["stepped"] for res in ranks}) > 1  # unequal numbers of matrices
    for which in CLIPS:
        lengths = {tuple(res[which]["lengths"]) for res in ranks}
        assert len(lengths) == 1, (which, lengths)
        norms = [res[which]["norms"] for res in ranks]
        assert all(n == norms[0] for n in norms), (which, norms)
        assert min(norms[0]) > 2 * CLIP, norms[0]  # clipping active
        assert_params_close(ranks[0][which]["params"], ref, what=f"{which}: ")
