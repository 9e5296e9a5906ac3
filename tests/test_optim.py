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
    for k in ("lr", "betas", "eps", "weight_decay"):
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
    """MUON_DEFAULTS (read by the benchmark) is Muon's own defaults, and torch's."""
    import inspect

    from matrixfsdp.optim import MUON_DEFAULTS
    sig = inspect.signature(mf.Muon).parameters
    assert {k: sig[k].default for k in MUON_DEFAULTS} == MUON_DEFAULTS
    torch_sig = inspect.signature(torch.optim.Muon).parameters
    assert {k: torch_sig[k].default for k in MUON_DEFAULTS if k != "ns_dtype"} == \
        {k: v for k, v in MUON_DEFAULTS.items() if k != "ns_dtype"}
