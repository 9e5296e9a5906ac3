"""FSDP2 arguments and habits that MatrixFSDP does not support raise a clear error, on one
gloo rank (each error is raised before any collective, identically on every rank)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

import matrixfsdp as mf
from matrixfsdp.train.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_mlp=32, seq_len=8)


def _mesh():
    return init_device_mesh("cpu", (1,))


def test_offload_policy_is_refused_naming_what_to_use(world1):
    """Before: a TypeError (unknown keyword). FSDP2's default OffloadPolicy() is accepted."""
    model = GPT(CFG)
    with pytest.raises(NotImplementedError, match=r"CPUOffloadPolicy.*not supported.*Mixed"):
        mf.fully_shard(model.layers[0], mesh=_mesh(), offload_policy=CPUOffloadPolicy())
    mf.fully_shard(model.layers[0], mesh=_mesh(), offload_policy=OffloadPolicy())


@pytest.mark.parametrize("value", [2, 0])
def test_reshard_after_forward_as_int_is_refused(world1, value):
    """Before: 2 was silently taken as True (FSDP2: reshard to a group of 2)."""
    model = GPT(CFG)
    with pytest.raises(ValueError, match=rf"reshard_after_forward={value}.*True, False or None"):
        mf.fully_shard(model.layers[0], mesh=_mesh(), reshard_after_forward=value)
    mf.fully_shard(model.layers[0], mesh=_mesh())
    with pytest.raises(ValueError, match=rf"reshard_after_forward={value}"):
        model.layers[0].set_reshard_after_forward(value)


def test_shard_slice_beside_a_size_1_replicate_dim_is_accepted(world1):
    """A size-1 replicate dim is one replica: nothing to average (before: refused, while
    FSDP2 trains torchtitan's (pp=1, dp_replicate=1, fsdp=N, tp=1) mesh['fsdp']). A slice
    that leaves out a replicate dim of size > 1 is refused (tests/runtime/test_meshes.py, 4 ranks;
    test_debug_mode.py); a pipeline stage's (pp, dp) slice is accepted."""
    mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    mf.fully_shard(GPT(CFG), mesh=mesh2d["shard"])
    mf.fully_shard(GPT(CFG), mesh=mesh2d["shard"], independent_replicas=True)
    pp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp"))
    mf.fully_shard(GPT(CFG), mesh=pp["dp"])


def test_submodule_called_outside_forward_names_module_and_fix(world1):
    """Before: the embedding computed with this rank's rows (wrong rows on rank > 0)."""
    model = GPT(CFG)
    for block in model.layers:
        mf.fully_shard(block, mesh=_mesh())
    mf.fully_shard(model, mesh=_mesh())
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(RuntimeError, match=r"Embedding 'embed' was called outside the forward of "
                                           r"its unit '<root>'.*register_fsdp_forward_method"):
        model.embed(ids)
    with pytest.raises(RuntimeError, match=r"Linear 'layers.1.mlp.fc'.*unit 'layers.1'"):
        model.layers[1].mlp.fc(torch.randn(2, 16))
    model.loss(ids[:, :-1], ids[:, 1:]).backward()  # inside forward: fine
    model.unshard()
    assert model.embed(ids).shape == (2, 8, 16)
    model.reshard()


def test_fsdp_module_class(world1):
    """isinstance and FSDP2's method names on every fully_shard module (before: none)."""
    model = GPT(CFG)
    for block in model.layers:
        mf.fully_shard(block, mesh=_mesh())
    mf.fully_shard(model, mesh=_mesh())
    assert isinstance(model, mf.FSDPModule) and isinstance(model, GPT)
    assert type(model).__name__ == "FSDPGPT" and not isinstance(model.embed, mf.FSDPModule)
    for name in ("unshard", "reshard", "set_requires_gradient_sync", "set_reshard_after_forward",
                 "set_reshard_after_backward", "set_is_last_backward",
                 "set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch"):
        assert callable(getattr(model.layers[0], name)), name
    model.set_modules_to_forward_prefetch([model.layers[0]])
    model.layers[0].set_modules_to_backward_prefetch([])
    model.set_is_last_backward(True)
    ids = torch.randint(0, 64, (2, 9))
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_an_optimizer_before_fully_shard_torch_s_works_mf_muon_s_is_refused(world1):
    """fsdp2.md: torch's optimizers over ``model.parameters()`` may be built before or after
    ``fully_shard`` (each parameter object becomes its shard); ``mf.Muon``'s groups need the
    plan, so built before the root's ``fully_shard`` they raise, naming the order to follow."""
    torch.manual_seed(0)
    model = GPT(CFG)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)  # before: holds the shards after
    for block in model.layers:
        mf.fully_shard(block, mesh=_mesh())
    mf.fully_shard(model)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
    model.loss(x[:, :-1], x[:, 1:]).backward()
    adamw.step()
    early = GPT(CFG)
    for block in early.layers:
        mf.fully_shard(block, mesh=_mesh())
    with pytest.raises(ValueError, match=r"GPT is not a fully_shard unit; call "
                                         r"matrixfsdp.fully_shard on its blocks and then on it"):
        mf.Muon(mf.muon_param_groups(early))


def test_a_model_with_no_muon_matrix_says_it_trains_as_adamw_only(world1):
    """Sharded by the root's call alone, a model has no Muon matrix (they are the 2-D weights
    inside the units below the root): ``mf.Muon`` over it warns, naming the model and the fix,
    instead of training as AdamW without a word; the same model with its blocks sharded does
    not warn."""
    root_only = GPT(CFG)
    mf.fully_shard(root_only, mesh=_mesh())
    with pytest.warns(UserWarning, match=r"matrixfsdp.Muon: none of its \d+ parameters is stepped "
                                         r"by Muon, so it trains as AdamW only: the plan of FSDPGPT "
                                         r"holds no Muon matrix.*fully_shard on each block"):
        mf.Muon(mf.muon_param_groups(root_only))
    model = GPT(CFG)
    for block in model.layers:
        mf.fully_shard(block, mesh=_mesh())
    mf.fully_shard(model, mesh=_mesh())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        groups = mf.muon_param_groups(model)
        mf.Muon(groups)
    everything = [p for g in groups for p in g["params"]]
    with pytest.warns(UserWarning, match=r"FSDPGPT's \d+ Muon matrices \(layers.0.attn.q.weight"):
        mf.Muon([dict(params=[], use_muon=True), dict(params=everything, use_muon=False)])
