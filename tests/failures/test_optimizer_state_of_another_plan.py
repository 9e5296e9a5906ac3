"""Reliability: optimizer state saved at another world size or plan is refused on every rank
(with a pointer to the resharding path), parameters with a zero-size dimension train, and
non-finite hyperparameters are refused wherever torch refuses them."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from _dist import spawn
from reference import assert_params_close, reference_ns_fp32
from reference import is_muon_name as _default_rule
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.layout.planner import make_plan
from matrixfsdp.layout.types import ParamSpec
from matrixfsdp.runtime.param import placement_of
from matrixfsdp.tensors.row_shard import RowShard
from matrixfsdp.train.models import GPT, GPTConfig

CFG = dict(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_mlp=24, seq_len=8)
RESHARD_HINT = r"matrixfsdp\.get_state_dict .* matrixfsdp\.set_state_dict \(which reshards\)"


def _fc_only(name: str, p: torch.Tensor) -> bool:
    """Two Muon matrices: at 2 and 3 ranks both go to ranks 0 and 1, rank 2 owns none."""
    return name in ("layers.0.mlp.fc.weight", "layers.1.mlp.fc.weight")


def _other_plan(name: str, p: torch.Tensor) -> bool:
    """Another plan with the same group sizes: the head replaces one block matrix."""
    return (_default_rule(name, p) and name != "layers.0.attn.q.weight") or name == "head.weight"


def _gpt(world_size: int, muon_filter=None):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh, muon_filter=muon_filter)
    return model, mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=3e-3))


def _train(model, opt, rank: int, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randint(0, CFG["vocab_size"], (2, CFG["seq_len"] + 1), generator=g)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()


def _per_rank(sd: dict) -> dict:
    """``opt.state_dict()`` as a per-rank file holds it (and as it was before it held
    RowShards, which refuse pickling): this rank's own tensors, no entry for a parameter it
    holds none of (the empty RowShards every rank lists)."""
    state = {}
    for i, st in sd["state"].items():
        if any(isinstance(v, RowShard) and not v.local.numel() for v in st.values()):
            continue
        state[i] = {k: v.local.clone() if isinstance(v, RowShard) else v for k, v in st.items()}
    return {**sd, "state": state}


def _fits_locally(sd: dict) -> dict:
    """Only the Muon momentum: on the rank that saved it every matrix it holds is whole, so
    where this rank owns the same matrices at another world size it fits shape for shape."""
    return {**sd, "state": {k: v for k, v in sd["state"].items() if "momentum_buffer" in v}}


def _without_plan_keys(sd: dict) -> dict:
    return {**sd, "param_groups": [{k: v for k, v in g.items() if not k.startswith("mf_")}
                                   for g in sd["param_groups"]]}


def _load_error(opt, sd: dict) -> str | None:
    try:
        opt.load_state_dict(sd)
    except ValueError as e:
        return str(e)
    return None


def _state_differences(saved: dict, loaded: dict) -> list[str]:
    """What differs between two optimizer state dicts: missing or extra entries, tensors
    not bit-equal (a load copies them), and the number of entries compared."""
    diffs = [f"entries {sorted(saved['state'])} vs {sorted(loaded['state'])}"] \
        if set(saved["state"]) != set(loaded["state"]) else []
    for i, st in saved["state"].items():
        for k, v in st.items():
            w = loaded["state"].get(i, {}).get(k)
            if not (isinstance(w, torch.Tensor) and torch.equal(v, w)):
                diffs.append(f"state[{i}][{k}]")
    return diffs + [f"compared {sum(len(st) for st in saved['state'].values())}"]


def _save_worker(rank, world_size, out_dir):
    model, opt = _gpt(world_size)
    _train(model, opt, rank)
    sd = _per_rank(opt.state_dict())
    torch.save(sd, os.path.join(out_dir, f"default{rank}.pt"))
    # Same world size, same plan: loads, every tensor back as saved (test_same_plan_loads;
    # test_parity checks that training continues bit-identically).
    _, again = _gpt(world_size)
    again.load_state_dict(torch.load(os.path.join(out_dir, f"default{rank}.pt")))
    torch.save(_state_differences(sd, _per_rank(again.state_dict())),
               os.path.join(out_dir, f"same_plan{rank}.pt"))
    # Same world size, another plan with the same group sizes (test_other_plan_is_refused).
    _, other = _gpt(world_size, muon_filter=_other_plan)
    torch.save(_load_error(other, sd), os.path.join(out_dir, f"other_plan{rank}.pt"))
    model, opt = _gpt(world_size, muon_filter=_fc_only)
    _train(model, opt, rank)
    torch.save(_per_rank(opt.state_dict()), os.path.join(out_dir, f"fc{rank}.pt"))


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory) -> dict[str, list]:
    """Per rank of a 2-rank run after two steps: the optimizer state dict of the default
    plan and of the ``_fc_only`` one, and the error (or None) of loading the default one
    into an optimizer of another plan at the same world size."""
    out = str(tmp_path_factory.mktemp("optim_state_2"))
    spawn(_save_worker, 2, out)
    return {kind: [torch.load(os.path.join(out, f"{kind}{r}.pt")) for r in range(2)]
            for kind in ("default", "fc", "other_plan", "same_plan")}


def test_same_plan_loads_every_tensor_back(saved_at_2):
    """Same world size, same plan: the state dict loads, and every state tensor it holds
    (momentum on the owner, AdamW's step, exp_avg, exp_avg_sq shards) comes back bit-equal."""
    for rank, diffs in enumerate(saved_at_2["same_plan"]):
        *wrong, compared = diffs
        assert not wrong, f"rank {rank}: {wrong}"
        assert int(compared.split()[1]) > 0, f"rank {rank}: no state to compare"


def test_other_plan_is_refused(saved_at_2):
    """Same world size, but the head is a Muon matrix and layers.0.attn.q.weight is not:
    the groups have the same sizes, so torch's own check passes and the old code loaded the
    momentum of one matrix onto another. Refused on both ranks."""
    for rank, msg in enumerate(saved_at_2["other_plan"]):
        assert msg is not None, f"rank {rank}: state of another plan was accepted"
        assert f"rank {rank}" in msg and "plan" in msg and re.search(RESHARD_HINT, msg), msg


def test_load_at_world_size_1_is_refused(saved_at_2, world1):
    """Rank 0 of a 1-rank run loading either 2-rank file: a ValueError naming a parameter,
    the rank, the saved and expected shapes and the resharding path. Momentum alone fits
    shape for shape (rank 0 owns every matrix now), which the old code took silently,
    training with the other rank's matrices' momentum missing: refused all the same."""
    saved = saved_at_2["default"]
    _, opt = _gpt(1)
    for sd in saved:
        msg = _load_error(opt, sd)
        assert msg is not None
        assert "rank 0" in msg and "world size 2" in msg and "world size 1" in msg, msg
        assert msg.count("(") >= 2 and "'" in msg, msg  # a parameter's name and two shapes
        assert re.search(RESHARD_HINT, msg), msg
    msg = _load_error(opt, _fits_locally(saved[0]))
    assert msg is not None, "momentum saved at 2 ranks loaded silently at 1 rank"
    assert "rank 0" in msg and "world size 2" in msg, msg
    # Without the recorded world size and plan (a state dict from elsewhere), the shapes
    # alone still catch it: AdamW's row shards of 2 ranks are half the rows of 1.
    msg = _load_error(opt, _without_plan_keys(saved[0]))
    assert msg is not None and "exp_avg" in msg and "rank 0" in msg, msg
    with pytest.raises(ValueError, match=r"'embed\.weight'.*\(32, 16\).*\(64, 16\)"):
        opt.load_state_dict(_without_plan_keys(saved[0]))
    with pytest.raises(ValueError, match=RESHARD_HINT):
        opt.load_state_dict(_without_plan_keys(saved[1]))
    assert not opt.state, "a refused load left state behind"


def _load_at_3_worker(rank, world_size, saved, out_dir):
    results = {}
    for kind, sd in (("default", saved["default"][rank % 2]),
                     ("fc", _fits_locally(saved["fc"][rank % 2]))):
        _, opt = _gpt(world_size, muon_filter=_fc_only if kind == "fc" else None)
        msg = _load_error(opt, sd)
        assert msg is not None, f"rank {rank}: {kind} state of 2 ranks loaded at 3"
        assert f"rank {rank}" in msg and "world size 2" in msg and "world size 3" in msg, msg
        assert re.search(RESHARD_HINT, msg), msg
        # Would this rank have noticed on its own, from the shapes alone?
        results[kind] = _load_error(opt, _without_plan_keys(sd)) is not None
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_load_at_world_size_3_is_refused_on_every_rank(saved_at_2, tmp_path):
    """Rank r of 3 loads file r % 2 of 2: every rank refuses. With only two Muon matrices
    (``_fc_only``), ranks 0 and 1 own at 3 ranks what they owned at 2, so their momentum
    fits shape for shape while rank 2's does not: without the recorded world size and plan
    ranks 0 and 1 would load and train on into the next collective while rank 2 raises."""
    spawn(_load_at_3_worker, 3, {k: saved_at_2[k] for k in ("default", "fc")}, str(tmp_path))
    results = [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(3)]
    assert all(res["default"] for res in results)  # AdamW's shards: every rank sees it anyway
    noticed = [res["fc"] for res in results]
    assert any(noticed) and not all(noticed), noticed  # the mixed case, refused on every rank


# ---- parameters with a zero-size dimension ---------------------------------------------------

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


# ---- non-finite hyperparameters ---------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
HYPER = [(True, dict(lr=v)) for v in (NAN, INF, -INF, -1.0)] \
    + [(True, dict(momentum=v)) for v in (NAN, INF, -1.0)] \
    + [(True, dict(weight_decay=v)) for v in (NAN, INF, -1.0)] \
    + [(False, dict(lr=v)) for v in (NAN, INF, -INF)] \
    + [(False, dict(eps=v)) for v in (NAN, INF, -1.0)] \
    + [(False, dict(weight_decay=v)) for v in (NAN, INF, -1.0)] \
    + [(False, dict(betas=b)) for b in ((NAN, 0.9), (0.9, NAN), (INF, 0.9), (0.9, 1.0))]


@pytest.mark.parametrize("use_muon,kw", HYPER, ids=[f"{'muon' if m else 'adamw'}-{kw}" for m, kw in HYPER])
def test_hyperparameters_refused_exactly_where_torch_refuses(use_muon, kw):
    def raises(build) -> bool:
        try:
            build()
        except ValueError:
            return True
        return False

    torch_cls = torch.optim.Muon if use_muon else torch.optim.AdamW
    shape = (4, 4) if use_muon else (4,)
    theirs = raises(lambda: torch_cls([nn.Parameter(torch.zeros(shape))], **kw))
    ours = raises(lambda: mf.Muon([dict(params=[nn.Parameter(torch.zeros(shape))],
                                        use_muon=use_muon, **kw)]))
    assert ours == theirs, f"torch {'refuses' if theirs else 'accepts'} {kw}, matrixfsdp does not"
    if any(isinstance(v, float) and math.isnan(v) for v in (*kw.values(), *kw.get("betas", ()))):
        assert theirs, f"torch accepts {kw}"  # the premise: torch refuses NaN


def test_plan_digest_names_the_replica_that_steps_a_matrix():
    """HSDP: the same storage with a matrix stepped by another world rank (another replica)
    is another plan: optimizer state saved there would miss or carry that momentum."""
    from types import SimpleNamespace

    from matrixfsdp.layout.types import ParamSpec, Placement
    from matrixfsdp.optim.plan_stamp import plan_digest as _plan_digest

    spec = ParamSpec("w", (4, 4), 4, 1, True)
    ranges = [(0, 4), (0, 0)]

    def param(owner):
        return SimpleNamespace(_mf_param=SimpleNamespace(placement=Placement(spec, owner, ranges)))
    one, other = param(0), param(2)
    assert _plan_digest([one]) != _plan_digest([other])
    assert _plan_digest([one]) == _plan_digest([param(0)])
