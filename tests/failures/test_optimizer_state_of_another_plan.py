"""Optimizer state saved at another world size or plan is refused on every rank (with a
pointer to the resharding path), and the plan's digest tells apart plans whose matrices
another replica steps."""

from __future__ import annotations

import os
import re

import pytest
import torch
from helpers.rank_pool import spawn
from helpers.reference import is_muon_name as _default_rule
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
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
