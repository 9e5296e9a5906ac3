"""Bad input gets a clear error naming the culprit, never a hang or a silent divergence."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.runtime.param import sharded_param
from matrixfsdp.train.models import GPT, GPTConfig

CFG = GPTConfig(d_model=16, n_heads=2, n_layers=2, d_mlp=24, seq_len=8)


def _mesh():
    return init_device_mesh("cpu", (1,))


def _shard(model, mesh=None, **root_kw):
    mesh = mesh or _mesh()
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    return mf.fully_shard(model, mesh=mesh, **root_kw)


def test_mixed_dtypes_in_a_unit(world1):
    model = GPT(CFG)
    model.layers[0].mlp.fc.double()
    with pytest.raises(ValueError, match=r"unit 'layers.0' mixes .*'layers.0.mlp.fc.weight'"):
        _shard(model)  # the root's call shards the model: the error comes there


def test_mixed_devices_in_a_unit(world1):
    model = GPT(CFG)
    model.layers[1].attn.q.to("meta")
    with pytest.raises(ValueError, match=r"'layers.1.attn.q.weight' \(torch.float32, meta\)"):
        _shard(model)


def test_parameters_tied_across_units(world1):
    """Tying inside one unit is supported (test_features); across two units it is refused,
    naming both parameters and both units."""
    model = GPT(CFG)
    model.layers[1].attn.q.weight = model.layers[0].attn.q.weight
    with pytest.raises(NotImplementedError, match=r"'layers.1.attn.q.weight' \(unit 'layers.1'\) is the "
                       r"same tensor as 'layers.0.attn.q.weight' \(unit 'layers.0'\)"):
        _shard(model)


def test_state_dict_of_a_sharded_model_never_holds_local_tensors(world1):
    """model.state_dict() (of any submodule too) holds each parameter as a RowShard (this
    rank's rows with their place in the full tensor), never local shards under full names
    (DCP would keep one rank's rows): torch.save and tensor math refuse it, naming the way out."""
    model = _shard(GPT(CFG))
    mf.muon_param_groups(model)  # plans
    for sd in (model.state_dict(), model.layers[0].state_dict(), model.layers[0].mlp.state_dict()):
        assert sd and all(isinstance(v, mf.RowShard) for v in sd.values())
        with pytest.raises(TypeError, match=r"torch\.save.*dcp\.save.*full_state_dict"):
            torch.save(sd, io.BytesIO())
    with pytest.raises(NotImplementedError, match=r"'embed\.weight' is one rank's rows.*full_state_dict"):
        model.state_dict()["embed.weight"] * 2


def test_optimizer_built_before_root_fully_shard(world1):
    model = GPT(CFG)
    mesh = _mesh()
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    with pytest.raises(ValueError, match="optimizer built before the root fully_shard"):
        mf.Muon([dict(params=list(model.parameters()), use_muon=False)])


def test_parameter_list_read_before_fully_shard_holds_the_shards(world1):
    """Sharding keeps the parameter objects (each becomes its shard), so a list read before
    fully_shard, such as an optimizer's, is never stale (before: it held dead tensors)."""
    model = GPT(CFG)
    params = list(model.parameters())
    _shard(model)
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert all(sharded_param(p) is not None for p in params)


def test_three_dimensional_mesh(world1):
    """1-D meshes and 2-D (replicate, shard) ones (HSDP) are taken; 3-D ones are refused."""
    mesh = init_device_mesh("cpu", (1, 1, 1))
    with pytest.raises(NotImplementedError, match=r"2-D \(replicate, shard\) mesh for HSDP, "
                                                  r"got a 3-D mesh of shape \(1, 1, 1\)"):
        mf.fully_shard(nn.Linear(4, 4), mesh=mesh)


def test_non_floating_parameter(world1):
    model = GPT(CFG)
    model.layers[0].register_parameter("steps", nn.Parameter(torch.zeros(3, dtype=torch.long),
                                                              requires_grad=False))
    with pytest.raises(ValueError, match=r"'layers.0.steps' has dtype torch.int64"):
        _shard(model)


def test_muon_group_with_a_row_sharded_parameter(world1):
    model = _shard(GPT(CFG))
    groups = mf.muon_param_groups(model)
    groups[0]["params"] = groups[0]["params"] + [model.head.weight]
    with pytest.raises(ValueError, match=r"'head.weight' .* is in a use_muon=True group"):
        mf.Muon(groups)


def test_fully_shard_twice_and_after_planning(world1):
    model = _shard(GPT(CFG))
    with pytest.raises(ValueError, match="already called"):
        mf.fully_shard(model.layers[0], mesh=_mesh())
    # an outer call after the model was sharded re-plans every unit under it together,
    # keeping the parameter objects (their values too)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    wrapper = mf.fully_shard(nn.Sequential(model), mesh=_mesh())
    assert [u.name for u in mf.get_root(wrapper).units][:2] == ["<root>", "0"]
    for n, p in wrapper[0].named_parameters():
        assert p is before[n][0] and torch.equal(p.detach(), before[n][1]), n


def test_muon_filter_must_pick_matrices(world1):
    with pytest.raises(ValueError, match=r"muon_filter selected parameter 'norm.weight' of shape \(16,\)"):
        _shard(GPT(CFG), muon_filter=lambda name, p: name.endswith("norm.weight"))


def test_groups_need_use_muon(world1):
    with pytest.raises(ValueError, match="use_muon"):
        mf.Muon([dict(params=[nn.Parameter(torch.zeros(2, 2))])])


def test_parameters_replaced_after_fully_shard(world1):
    """A parameter's data replaced after fully_shard would leave the shard behind and train
    stale weights silently: the next forward raises, naming the parameter. ``.double()``
    is refused at the call, before anything moves; ``to_empty`` onto the shards' device
    rebinds them (FSDP2's meta-device recipe: tests/integrations/test_torchtitan_pieces.py)."""
    model = _shard(GPT(CFG))
    mf.muon_param_groups(model)  # plans
    shards = list(model.parameters())
    with pytest.raises(ValueError, match=r"torch.float64 on cpu after fully_shard is not supported"):
        model.double()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.to_empty(device="cpu")
    assert all(p is q for p, q in zip(model.parameters(), shards))
    with torch.no_grad():  # an eval forward: the next one checks again
        model(torch.zeros(1, 4, dtype=torch.long))  # still views the storage: runs
    model.layers[0].mlp.fc.weight.data = torch.zeros(24, 16)
    with pytest.raises(RuntimeError, match=r"parameter '.*' no longer views MatrixFSDP's storage"):
        model(torch.zeros(1, 4, dtype=torch.long))


def _torch_matrix_optimizers(rank, world_size, out_dir):
    import os
    torch.manual_seed(0)  # the same initial values on every rank (checked at sharding)
    model = _shard(GPT(CFG), mesh=init_device_mesh("cpu", (world_size,)))
    x = torch.randint(0, 256, (2, 9))
    model.loss(x[:, :-1], x[:, 1:]).backward()
    errors = []
    for make in (lambda ps: torch.optim.Muon([p for p in ps if p.dim() == 2]),
                 lambda ps: torch.optim.Adafactor(ps), lambda ps: torch.optim.LBFGS(ps)):
        opt = make(list(model.parameters()))
        try:
            opt.step() if not isinstance(opt, torch.optim.LBFGS) else opt.step(lambda: 0.0)
            errors.append("")
        except RuntimeError as e:
            errors.append(str(e))
    torch.optim.AdamW(model.parameters()).step()  # element-wise: right on shards, allowed
    torch.save(errors, os.path.join(out_dir, f"rank{rank}.pt"))


def test_torch_matrix_optimizers_on_shards_are_refused(tmp_path):
    """torch.optim.Muon / Adafactor on a row shard (or L-BFGS on any shard) would step one
    rank's piece, not the matrix: a silent difference from one process, refused on every
    rank; element-wise optimizers such as AdamW stay allowed."""
    from helpers.rank_pool import spawn
    spawn(_torch_matrix_optimizers, 2, str(tmp_path))
    for rank in range(2):
        errors = torch.load(tmp_path / f"rank{rank}.pt")
        assert all("from this rank's piece" in e and "matrixfsdp.Muon" in e for e in errors), errors


def test_an_old_model_collected_inside_a_later_step_leaves_the_step_alone(world1):
    """A model built and dropped earlier (reachable only through a reference cycle, so a
    garbage collection frees it) is collected in the middle of another model's optimizer
    step: the step goes on. Before: each root removed its own step pre-hook from torch's
    registry when it was collected, while torch was iterating that registry ("OrderedDict
    mutated during iteration", at whichever step a collection happened to run)."""
    import gc

    from torch.optim.optimizer import register_optimizer_step_pre_hook
    gc.disable()  # nothing collected before the step does it
    try:
        old = _shard(GPT(CFG))
        old.loss(*_tokens()).backward()  # a root that planned, with its step hook
        del old
        model = _shard(GPT(CFG))
        opt = mf.Muon(mf.muon_param_groups(model))
        model.loss(*_tokens()).backward()

        def collect_garbage(*_) -> None:
            gc.collect()

        def after(*_) -> None:  # torch's iteration goes on past the collection
            pass
        hooks = [register_optimizer_step_pre_hook(collect_garbage),
                 register_optimizer_step_pre_hook(after)]
        try:
            opt.step()
        finally:
            for hook in hooks:
                hook.remove()
    finally:
        gc.enable()


def _tokens():
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=torch.Generator().manual_seed(0))
    return x[:, :-1], x[:, 1:]
