"""Per-head Muon: each attention head's row block of q / k / v orthogonalised as its own
matrix, against torch.optim.Muon run on every head block as a parameter of its own (fp32
NS, one process, the same data on every rank so the gradients agree to rounding): at 1, 2
and 4 ranks with GQA (k and v with fewer heads than q), and under tensor parallelism."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.parity import ADAMW, MUON, muon_groups
from helpers.per_head import lm_loss, per_head_reference
from helpers.rank_pool import spawn
from helpers.tp_models import VOCAB, apply_tp, build_llama
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.optim.groups import head_blocks
from matrixfsdp.train.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_mlp=48,
                seq_len=16)
STEPS, ROWS = 3, 4
TOL = 1e-6  # the same data on every rank: ranks agree with one process to fp32 rounding


def _gpt_blocks() -> dict[str, int]:
    """Written out, not found: q in 4 heads, GQA's k and v in 2."""
    return {f"layers.{i}.attn.{w}.weight": h for i in range(CFG.n_layers)
            for w, h in (("q", CFG.n_heads), ("k", CFG.n_kv_heads), ("v", CFG.n_kv_heads))}


def _llama_blocks() -> dict[str, int]:
    return {f"layers.{i}.attention.{w}.weight": 4 for i in range(2) for w in ("wq", "wk", "wv")}


def _data():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (ROWS, CFG.seq_len + 1), generator=g) for _ in range(STEPS)]


def _train(model, data, per_head):
    opt = mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32, per_head=per_head))
    for x in data:
        lm_loss(model, x).backward()
        opt.step()
        opt.zero_grad()
    return mf.full_state_dict(model), opt


def _max_diff(a, b) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in b)


def _sharded_gpt(mesh_shape):
    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = init_device_mesh("cpu", mesh_shape)
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    return mf.fully_shard(model, mesh=mesh)


def _gpt(rank, world, mesh_shape):
    data = _data()
    torch.manual_seed(0)
    plain = GPT(CFG)
    assert head_blocks(plain) == _gpt_blocks()  # found by name and head_dim, GQA included
    ref = per_head_reference(plain, data, _gpt_blocks())
    ours, opt = _train(_sharded_gpt(mesh_shape), data, True)
    assert [g["num_heads"] for g in opt.param_groups if g["use_muon"]] == [None, 4, 2]
    assert _max_diff(ours, ref) < TOL, _max_diff(ours, ref)
    # the blocks matter: whole-matrix Muon lands elsewhere
    torch.manual_seed(0)
    whole = per_head_reference(GPT(CFG), data, {})
    assert _max_diff(whole, ref) > 1e-3


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (4,), (2, 2)], ids=["1", "2", "4", "hsdp-2x2"])
def test_per_head_equals_torch_muon_on_each_head_block(mesh_shape):
    """GPT with GQA (q: 4 heads, k and v: 2), per_head=True: q/k/v found by name, one Muon
    group per head count, every parameter within 1e-6 of one process running
    torch.optim.Muon on each head block as its own parameter, after 3 steps; at 1, 2, 4
    ranks and under HSDP (each matrix stepped by one replica, then broadcast)."""
    spawn(_gpt, math.prod(mesh_shape), mesh_shape)


def _tp(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    data = _data()
    ref = per_head_reference(build_llama(), data, _llama_blocks())
    model = apply_tp(build_llama(), mesh["tp"])
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh["dp"])
    mf.fully_shard(model, mesh=mesh["dp"])
    ours, _ = _train(model, data, True)
    assert _max_diff(ours, ref) < TOL, _max_diff(ours, ref)


def test_per_head_under_tensor_parallelism():
    """dp 2 x tp 2, torchtitan's Llama plan (ColwiseParallel q/k/v: each tp rank computes
    whole heads): per-head Muon on the whole matrices equals torch.optim.Muon per head block."""
    spawn(_tp, 4)


def _bad_heads(rank, world):
    model = _sharded_gpt((world,))
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q\.weight.*num_heads=3"):
        mf.Muon(mf.muon_param_groups(model, per_head={"layers.0.attn.q.weight": 3}))
    with pytest.raises(ValueError, match=r"per_head names \['embed\.weight'\].*no Muon"):
        mf.muon_param_groups(model, per_head={"embed.weight": 2})


def test_heads_that_do_not_divide_the_rows_are_refused():
    """A head count that does not divide a matrix's rows, or a name that is no Muon matrix,
    is refused when the groups are made, naming the parameter."""
    spawn(_bad_heads, 1)


def _resharded(rank, world, ckpt):
    data = _data()
    torch.manual_seed(0)
    ref = per_head_reference(GPT(CFG), data, _gpt_blocks())

    def build(mesh_shape):
        model = _sharded_gpt(mesh_shape)
        return model, mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32, per_head=True))

    def train(model, opt, batches):
        for x in batches:
            lm_loss(model, x).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build((4,))
    train(model, opt, data[:2])
    dcp.save(mf.get_state_dict(model, opt), checkpoint_id=ckpt)
    model, opt = build((2, 2))  # another layout: HSDP, other owners
    state = mf.get_state_dict(model, opt)
    dcp.load(state, checkpoint_id=ckpt)
    mf.set_state_dict(model, opt, state)
    train(model, opt, data[2:])
    ours = mf.full_state_dict(model)
    assert _max_diff(ours, ref) < TOL, _max_diff(ours, ref)


def test_per_head_state_reshards_through_a_checkpoint(tmp_path):
    """Per-head Muon's state (momentum of the whole matrix, by name) saved at 4 ranks after
    2 steps, loaded under HSDP 2x2 (other owners): step 3 equals one process's."""
    spawn(_resharded, 4, str(tmp_path / "ckpt"))
