"""Parameters with a zero-size dimension ((0, d), (d, 0), an empty vector) train as torch
trains them, at 1 and 2 ranks, and are never a Muon matrix, whatever the filter says."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from helpers.rank_pool import spawn
from helpers.reference import assert_params_close, reference_ns_fp32
from helpers.reference import is_muon_name as _default_rule
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.layout.planner import make_plan
from matrixfsdp.layout.types import ParamSpec
from matrixfsdp.runtime.param import placement_of


class EmptyBlock(nn.Module):
    """A block with a (0, d) and a (d, 0) parameter, both in the forward: concatenated as
    zero more tokens, and as a projection onto zero more features."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.no_rows = nn.Parameter(torch.empty(0, d))
        self.no_cols = nn.Parameter(torch.empty(d, 0))

    def forward(self, x):
        h = torch.cat([self.fc(self.norm(x)), self.no_rows.expand(x.shape[0], 0, -1)], dim=1)
        h = torch.cat([h, x @ self.no_cols], dim=-1)
        return x + torch.tanh(h)


class EmptyModel(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 12):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(EmptyBlock(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)
        self.nothing = nn.Parameter(torch.empty(0))  # a root-level empty vector

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        return self.head(x) + self.nothing.sum()

    def loss(self, idx, targets):
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


EMPTY = ("layers.0.no_rows", "layers.0.no_cols", "layers.1.no_rows", "layers.1.no_cols", "nothing")
MUON_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW_KW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)
ALL_BLOCK_MATRICES = _default_rule  # a muon_filter that selects the empty matrices too


def _empty_data(steps: int, world_size: int):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 32, (2 * world_size, 7), generator=g) for _ in range(steps)]


def _empty_train(rank: int, world_size: int, muon_filter) -> dict:
    torch.manual_seed(0)
    model = EmptyModel()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh, muon_filter=muon_filter)
    groups = mf.muon_param_groups(model, ns_dtype=torch.float32, adamw_lr=ADAMW_KW["lr"],
                                  **MUON_KW, **{f"adamw_{k}": v for k, v in ADAMW_KW.items()
                                                if k != "lr"})
    named = dict(model.named_parameters())
    opt = mf.Muon(groups)
    for x in _empty_data(3, world_size):
        x = x[2 * rank:2 * rank + 2]
        model.loss(x[:, :-1], x[:, 1:]).backward()
        for n in EMPTY:  # as in torch: an empty gradient of the parameter's (local) shape
            grad = named[n].grad
            assert grad is not None and grad.shape == named[n].shape and grad.numel() == 0, n
        opt.step()
        opt.zero_grad()
    assert not any(opt.state.get(named[n]) for n in EMPTY), "optimizer state for an empty parameter"
    muon_names = {n for n, p in named.items() if any(p is q for q in groups[0]["params"])}
    assert muon_names == {"layers.0.fc.weight", "layers.1.fc.weight"}, muon_names
    for n in EMPTY:  # never a Muon matrix, whatever the filter says: planned as an even parameter
        assert not placement_of(named[n]).spec.muon and named[n].numel() == 0, n
    return mf.full_state_dict(model)


def _empty_reference(world_size: int) -> dict:
    torch.manual_seed(0)
    model = EmptyModel()
    named = list(model.named_parameters())
    is_muon = [n.endswith("fc.weight") for n, _ in named]
    muon = torch.optim.Muon([p for (_, p), m in zip(named, is_muon) if m], **MUON_KW)
    adamw = torch.optim.AdamW([p for (_, p), m in zip(named, is_muon) if not m], **ADAMW_KW)
    with reference_ns_fp32():
        for x in _empty_data(3, world_size):
            model.loss(x[:, :-1], x[:, 1:]).backward()
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
    return {n: p.detach().clone() for n, p in named}


def _check_empty_run(ours: dict, world_size: int) -> None:
    ref = _empty_reference(world_size)
    assert list(ours) == list(ref)
    assert_params_close(ours, ref)


def _empty_worker(rank, world_size, out_dir):
    state = _empty_train(rank, world_size, None)
    if rank == 0:
        torch.save(state, os.path.join(out_dir, "state.pt"))


@pytest.mark.parametrize("muon_filter", [None, ALL_BLOCK_MATRICES], ids=["default", "filter"])
def test_empty_parameters_train_at_one_rank(muon_filter, world1):
    _check_empty_run(_empty_train(0, 1, muon_filter), 1)


def test_empty_parameters_train_at_two_ranks(tmp_path):
    spawn(_empty_worker, 2, str(tmp_path))
    _check_empty_run(torch.load(os.path.join(tmp_path, "state.pt")), 2)


def test_planner_never_makes_an_empty_parameter_a_muon_matrix():
    specs = [ParamSpec("w", (8, 8), 4, 0, True), ParamSpec("rows0", (0, 8), 4, 0, True),
             ParamSpec("cols0", (8, 0), 4, 0, True), ParamSpec("experts0", (0, 4, 4), 4, 0, True)]
    plan = make_plan(specs, 3, ["<root>"])
    assert [n for n, pl in plan.placements.items() if pl.spec.muon] == ["w"]
    for n in ("rows0", "cols0", "experts0"):
        pl = plan.placements[n]
        assert pl.owner is None and sum(math.prod(pl.local_shape(r)) for r in range(3)) == 0, n


def test_empty_parameter_in_a_muon_group_is_a_no_op():
    """torch.optim.Muon takes any 2-D parameter, an empty one included (a no-op for it)."""
    w, empty = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.empty(6, 0))
    opt = mf.Muon([dict(params=[w, empty], use_muon=True)])
    w.grad, empty.grad = torch.ones_like(w), torch.ones_like(empty)
    opt.step()
    assert not opt.state.get(empty) and opt.state[w]
