"""matrixfsdp.Muon on plain (unsharded) tensors vs torch.optim.Muon + torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch

import matrixfsdp as mf


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    mats = [torch.randn(s, generator=g) for s in ((8, 12), (12, 8), (5, 5))]
    vecs = [torch.randn(s, generator=g) for s in ((12,), (3, 4))]
    return [torch.nn.Parameter(t) for t in mats], [torch.nn.Parameter(t) for t in vecs]


@pytest.mark.parametrize("muon_kw", [
    dict(lr=0.02),
    dict(lr=0.01, weight_decay=0.0, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"),
    dict(lr=0.05, ns_steps=3, eps=1e-5, ns_coefficients=(3.0, -3.2, 1.2), adjust_lr_fn="original"),
])
def test_bit_identical_to_torch(muon_kw):
    adamw_kw = dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05)
    ours_m, ours_v = _params(0)
    ref_m, ref_v = _params(0)
    opt = mf.Muon([dict(params=ours_m, use_muon=True, **muon_kw),
                   dict(params=ours_v, use_muon=False, **adamw_kw)])
    ref = [torch.optim.Muon(ref_m, **muon_kw), torch.optim.AdamW(ref_v, **adamw_kw)]
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        for a, b in zip(ours_m + ours_v, ref_m + ref_v):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        for o in ref:
            o.step()
    for a, b in zip(ours_m + ours_v, ref_m + ref_v):
        assert torch.equal(a, b)


def test_defaults_match_torch():
    ours = mf.Muon([dict(params=[torch.nn.Parameter(torch.zeros(2, 2))], use_muon=True),
                    dict(params=[torch.nn.Parameter(torch.zeros(2))], use_muon=False)])
    muon = torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))]).defaults
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]).defaults
    for k, v in muon.items():
        assert ours.param_groups[0][k] == v, k
    for k in ("lr", "betas", "eps", "weight_decay", "foreach", "fused"):
        assert ours.param_groups[1][k] == adamw[k], k
    assert ours.param_groups[0]["ns_dtype"] == torch.bfloat16


def test_state_dict_round_trip_and_scheduler():
    m, v = _params(0)
    opt = mf.Muon([dict(params=m, use_muon=True, lr=0.02), dict(params=v, use_muon=False)])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for p in m + v:
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[1]["lr"] == 5e-4
    m2, v2 = _params(0)
    opt2 = mf.Muon([dict(params=m2, use_muon=True), dict(params=v2, use_muon=False)])
    opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["lr"] == 0.01
    assert torch.equal(opt2.state[m2[0]]["momentum_buffer"], opt.state[m[0]]["momentum_buffer"])
    opt.zero_grad()
    assert all(p.grad is None for p in m + v)


def test_bf16_params_keep_momentum_intact():
    # torch.optim.Muon's NS normalises its input in place; with bf16 params and
    # nesterov=False that input is the momentum buffer itself. Ours copies first.
    p = torch.nn.Parameter(torch.randn(4, 6, dtype=torch.bfloat16))
    opt = mf.Muon([dict(params=[p], use_muon=True, nesterov=False, momentum=0.5)])
    p.grad = torch.ones_like(p)
    opt.step()
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], torch.full_like(p, 0.5))


def test_muon_defaults_constant_matches_the_signature():
    """MUON_DEFAULTS / ADAMW_DEFAULTS (optim/groups.py, read by the benchmark) are the one
    home of the defaults: matrixfsdp.Muon's signature (plain and adamw_ keywords, nothing
    else) and muon_param_groups' lrs are theirs, and they are torch.optim.Muon's and
    torch.optim.AdamW's own."""
    import inspect

    from matrixfsdp.optim.groups import ADAMW_DEFAULTS, MUON_EXTENSIONS
    from matrixfsdp.optim.muon import MUON_DEFAULTS
    sig = inspect.signature(mf.Muon).parameters
    assert list(sig) == ["params", *MUON_DEFAULTS, *(f"adamw_{k}" for k in ADAMW_DEFAULTS)]
    assert {k: sig[k].default for k in MUON_DEFAULTS} == MUON_DEFAULTS
    assert {k: sig[f"adamw_{k}"].default for k in ADAMW_DEFAULTS} == ADAMW_DEFAULTS
    torch_muon = inspect.signature(torch.optim.Muon).parameters
    assert {k: v.default for k, v in torch_muon.items() if k != "params"} == \
        {k: v for k, v in MUON_DEFAULTS.items() if k not in MUON_EXTENSIONS}
    torch_adamw = inspect.signature(torch.optim.AdamW).parameters
    assert {k: v.default for k, v in torch_adamw.items() if k != "params"} == ADAMW_DEFAULTS
    groups = inspect.signature(mf.muon_param_groups).parameters
    assert groups["lr"].default == MUON_DEFAULTS["lr"]
    assert groups["adamw_lr"].default == ADAMW_DEFAULTS["lr"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, dict(foreach=True), dict(foreach=False), dict(fused=True)])
def test_adamw_bit_identical_to_torch_adamw(dtype, options):
    """AdamW groups run the kernel torch.optim.AdamW runs for the same options: by default
    (foreach and fused None) torch's own choice for the tensors' device and dtype. On CPU
    that is the per-tensor loop, whose bf16 rounding differs from the foreach kernel's."""
    kw = dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05)
    g = torch.Generator().manual_seed(0)
    shapes = ((8, 12), (12,), (3, 4), (5,))
    ours = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = mf.Muon([dict(params=ours, use_muon=False, **kw, **options)])
    torch_opt = torch.optim.AdamW(ref, **kw, **options)
    for _ in range(5):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=g).to(dtype)
            b.grad = a.grad.clone()
        opt.step()
        torch_opt.step()
    for a, b in zip(ours, ref):
        assert a.dtype == dtype and torch.equal(a, b)
    for a, b in zip(ours, ref):  # the state too, `step` included (on the device when fused)
        for k, v in torch_opt.state[b].items():
            assert torch.equal(opt.state[a][k], v) and opt.state[a][k].device == v.device, k


def test_adamw_foreach_and_fused_options():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = mf.Muon([dict(params=[p], use_muon=False)], adamw_foreach=True)
    assert opt.param_groups[0]["foreach"] is True and opt.param_groups[0]["fused"] is None
    with pytest.raises(ValueError, match="`fused` and `foreach` cannot be `True` together"):
        mf.Muon([dict(params=[p], use_muon=False, foreach=True, fused=True)])


def test_parameters_without_grad_are_never_touched():
    """A parameter without a gradient (frozen, or a non-owner's placeholder) gets no state
    and no weight decay, in either kind of group."""
    m, v = _params(0)
    opt = mf.Muon([dict(params=m, use_muon=True, weight_decay=0.5),
                   dict(params=v, use_muon=False, weight_decay=0.5)])
    before = [p.detach().clone() for p in m + v]
    m[1].grad = torch.ones_like(m[1])
    v[1].grad = torch.ones_like(v[1])
    for _ in range(2):
        opt.step()
    for i in (0, 2, 3):
        p = (m + v)[i]
        assert torch.equal(p, before[i]) and not opt.state.get(p), i
    assert opt.state[m[1]] and opt.state[v[1]]


def test_frozen_parameters_stay_out_of_the_groups(world1):
    from matrixfsdp.train.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_mlp=32, seq_len=8))
    frozen = {"layers.0.attn.q.weight", "layers.0.norm1.weight", "head.weight"}
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    for block in model.layers:
        mf.fully_shard(block)
    mf.fully_shard(model)
    groups = mf.muon_param_groups(model, lr=0.02, weight_decay=0.5, adamw_weight_decay=0.5)
    in_groups = {id(p) for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert all((id(named[n]) in in_groups) == (n not in frozen) for n in named)
    opt = mf.Muon(groups)
    before = {n: named[n].detach().clone() for n in frozen}
    x = torch.randint(0, 64, (2, 9))
    model.loss(x[:, :-1], x[:, 1:]).backward()
    opt.step()
    for n in frozen:
        assert torch.equal(named[n], before[n]) and named[n] not in opt.state, n
