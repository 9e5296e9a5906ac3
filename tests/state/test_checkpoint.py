"""Checkpoints through torch.distributed.checkpoint: keyed by name, every element written once,
resume bit-identical at the same world size, resharding on load (4 -> 2 -> 3 -> 1 ranks)
against torch.optim.Muon + torch.optim.AdamW on one process, and out to plain torch."""

from __future__ import annotations

import math
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.checkpointing import (
    ALL_STEPS,
    GLOBAL,
    PHASES,
    SEQ,
    build_sharded,
    checkpoint_state,
    load_state,
    reference_snapshots,
    tie_and_freeze,
    train_steps,
)
from helpers.moe_models import MoELM
from helpers.parity import ADAMW, MUON, ODD
from helpers.rank_pool import spawn
from helpers.reference import PARITY_TOL, batches, build_model, is_muon_name, reference_ns_fp32
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import matrixfsdp as mf
from matrixfsdp.layout.types import ParamSpec, Placement
from matrixfsdp.runtime.param import placement_of
from matrixfsdp.tensors.row_shard import RowShard
from matrixfsdp.train.models import GPTConfig

BOUND = PARITY_TOL  # the fp32-NS parity bound (reference.py: where it comes from)


# ---- the placement-carrying value ------------------------------------------------------------
def test_row_shard_write_items_chunks_and_refusals():
    """A rank writes the rows it holds and nothing where it holds none; a tensor with no
    element is one empty chunk at 0; 0-d lives on one rank; no tensor op, no pickling."""
    spec = ParamSpec("w", (5, 3), 4, 1, False)
    pl = Placement(spec, None, [(0, 2), (2, 2), (2, 5)])
    local = torch.arange(9.0).view(3, 3)
    rs = RowShard.of(local, pl, 2)
    assert tuple(rs.shape) == (5, 3) and rs.offsets == (2, 0)
    (item,) = rs.__create_write_items__("w", rs)
    assert tuple(item.index.offset) == (2, 0) and tuple(item.tensor_data.chunk.sizes) == (3, 3)
    assert tuple(item.tensor_data.size) == (5, 3)
    assert rs.__get_tensor_shard__(item.index) is rs.local
    empty = RowShard.of(torch.empty(0, 3), pl, 1)
    assert empty.__create_write_items__("w", empty) == [] and empty.__create_chunk_list__() == []
    owner = Placement(ParamSpec("m", (4, 6), 4, 1, True), 1, [(0, 0), (0, 4)])
    assert RowShard.of(torch.empty(0, 6), owner, 0).__create_chunk_list__() == []
    nothing = RowShard.of(torch.empty(0, 3), Placement(ParamSpec("z", (0, 3), 4, 1, False), None,
                                                        [(0, 0), (0, 0)]), 1)
    (chunk,) = nothing.__create_chunk_list__()
    assert tuple(chunk.offsets) == (0, 0) and tuple(chunk.sizes) == (0, 3)
    scalar = Placement(ParamSpec("s", (), 4, 1, False), None, [(0, 0), (0, 1)])
    assert RowShard.of(torch.tensor(2.0), scalar, 1).__create_chunk_list__()[0].sizes == torch.Size([])
    assert RowShard.of(torch.empty(0), scalar, 0).__create_chunk_list__() == []
    with pytest.raises(NotImplementedError, match=r"'w' is one rank's rows.*\.local"):
        rs + 1
    with pytest.raises(TypeError, match="dcp.save"):
        pickle.dumps(rs)
    assert "rows 2:5" in repr(rs)


def test_model_state_dict_holds_what_get_state_dict_holds(world1):
    """model.state_dict() holds the RowShards of mf.get_state_dict (names, shapes, offsets,
    views of the parameters), as FSDP2's holds DTensors; load_state_dict takes them back, and
    torch.save refuses them (tests/state/test_torch_state_dict.py: torch's helpers on them)."""
    model, opt, _ = build_sharded(1)
    ours, torchs = mf.get_state_dict(model)["model"], model.state_dict()
    assert list(ours) == list(torchs)
    for n, v in torchs.items():
        assert isinstance(v, RowShard) and (v.shape, v.offsets) == (ours[n].shape, ours[n].offsets)
        assert v.local.data_ptr() == ours[n].local.data_ptr()
    assert not model.load_state_dict(torchs).missing_keys
    with pytest.raises(TypeError, match="dcp.save"):
        pickle.dumps(torchs)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict"):
        model.load_state_dict({})


def test_set_state_dict_refuses_a_misplaced_missing_or_unknown_entry(world1):
    model, opt, _ = build_sharded(1)
    name = "layers.0.attn.q.weight"
    for change, match in (
            (lambda st: st["model"].pop(name), rf"the model has 1 names the checkpoint lacks \(\['{name}'\]"),
            (lambda st: st["model"].update(extra=torch.zeros(1)),
             r"the checkpoint has 1 names the model lacks \(\['extra'\]"),
            (lambda st: st["model"].update({name: RowShard(torch.zeros(0, 35), (35, 35), (0, 0))}),
             rf"parameter '{name}'.*another placement"),
            (lambda st: st["model"].update({name: torch.zeros(3, 35)}), rf"'{name}' has shape \(3, 35\)"),
            (lambda st: st["optim"]["state"].update(nope={}), "'nope'"),
            (lambda st: st["optim"]["param_groups"][0]["params"].pop(), "parameter group 0 differs")):
        state = mf.get_state_dict(model, opt)
        change(state)
        with pytest.raises(ValueError, match=match):
            mf.set_state_dict(model, opt, state)


def test_state_of_a_fresh_optimizer_is_what_its_first_step_creates(world1):
    """get_state_dict creates the missing state (zeros, step 0) without touching a parameter;
    training on from it equals training from no state, bit for bit."""
    data = batches(2, 1, GLOBAL, SEQ)
    (m1, o1, s1), (m2, o2, s2) = build_sharded(1), build_sharded(1)
    before = {n: p.detach().clone() for n, p in m2.named_parameters()}
    state = mf.get_state_dict(m2, o2)
    assert len(o2.state) == len(list(m2.parameters()))
    assert all(torch.equal(p, before[n]) for n, p in m2.named_parameters())
    assert all(float(st["step"]) == 0 for st in state["optim"]["state"].values() if "step" in st)
    for model, opt, sched in ((m1, o1, s1), (m2, o2, s2)):
        train_steps(model, opt, sched, data, range(2), 0, 1)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
        assert all(torch.equal(v, o2.state[p2][k]) for k, v in o1.state[p1].items())


# ---- resume at the same world size: bit-identical -----------------------------------------------
def _resume_worker(rank, world, tmp):
    data = batches(6, 1, GLOBAL, SEQ)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    eps8 = {**ADAMW, "eps": 1e-8}
    for tag, mp, tweak in (("fp32", None, None), ("bf16", bf16, None), ("tied", None, tie_and_freeze)):
        kw = dict(mp=mp, ns_dtype=torch.bfloat16, adamw=eps8, tweak=tweak)  # bf16 NS, eps 1e-8: torch's
        straight = build_sharded(world, **kw)
        train_steps(*straight, data, range(6), rank, world)
        first = build_sharded(world, **kw)
        train_steps(*first, data, range(3), rank, world)
        state = checkpoint_state(*first)
        plain = (tweak or (lambda m: m))(build_model("gpt", GPTConfig(**ODD)))
        assert list(state["model"]) == list(plain.state_dict())  # every name, tied ones too
        assert all(v.dtype == torch.float32 for v in state["model"].values())  # fp32 masters
        if tweak is not None:
            assert state["model"]["head.weight"] is state["model"]["embed.weight"]
            assert "pos.weight" not in state["optim"]["state"]  # frozen: no optimizer state
            assert "head.weight" not in state["optim"]["state"]  # one parameter, one state
        saved = mf.save_checkpoint(state, os.path.join(tmp, tag, "step_3"))
        assert saved.bytes > 0 and mf.latest_checkpoint(os.path.join(tmp, tag)) == saved.path
        resumed = build_sharded(world, **kw, seed=123)  # other initial weights: all must come from the file
        load_state(*resumed, saved.path)
        for a, b in zip(mf.full_state_dict(first[0]).values(), mf.full_state_dict(resumed[0]).values()):
            assert torch.equal(a, b)
        train_steps(*resumed, data, range(3, 6), rank, world)
        (m1, o1, s1), (m2, o2, s2) = straight, resumed
        for (n, a), b in zip(mf.full_state_dict(m1).items(), mf.full_state_dict(m2).values()):
            assert a.dtype == torch.float32 and torch.equal(a, b), f"{tag} {n}"
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            st1, st2 = o1.state.get(p1, {}), o2.state.get(p2, {})
            assert st1.keys() == st2.keys(), (tag, placement_of(p1).spec.name)
            for k in st1:
                assert st1[k].dtype == torch.float32 and torch.equal(st1[k], st2[k]), \
                    f"{tag} {placement_of(p1).spec.name} {k}"
            if placement_of(p1).spec.muon:
                assert ("momentum_buffer" in st1) == (placement_of(p1).owner == rank)
        assert s1.state_dict() == s2.state_dict()
        assert [g["lr"] for g in o1.param_groups] == [g["lr"] for g in o2.param_groups]


def test_resume_is_bit_identical_with_and_without_mixed_precision(tmp_path):
    """2 ranks, different data: 6 steps straight vs 3 steps, save, a fresh model with other
    weights loads the checkpoint, 3 more steps. Parameters, Muon momentum (owner only),
    AdamW moments and steps, the lr schedule: bit for bit; without and with a bf16
    MixedPrecisionPolicy (the checkpoint holds the fp32 masters), and with a tied head and a
    frozen parameter (both names in the model state, no optimizer state for the frozen one)."""
    torch.set_num_threads(1)
    spawn(_resume_worker, 2, str(tmp_path))


# ---- reshard: 4 -> 2 -> 3 ranks, against one process --------------------------------------------
def _chain_worker(rank, world, tmp, phase):
    data = batches(ALL_STEPS, 1, GLOBAL, SEQ)
    start = sum(n for _, n in PHASES[:phase])
    model, opt, sched = build_sharded(world)
    if phase:
        load_state(model, opt, sched, os.path.join(tmp, f"ckpt{phase - 1}"))
        for p in model.parameters():  # momentum moved to each matrix's new owner
            if placement_of(p).spec.muon:
                assert ("momentum_buffer" in opt.state.get(p, {})) == (placement_of(p).owner == rank)
        # the loaded state, saved again as it is: must equal the checkpoint it came from
        dcp.save(checkpoint_state(model, opt, sched), checkpoint_id=os.path.join(tmp, f"reloaded{phase}"))
    train_steps(model, opt, sched, data, range(start, start + PHASES[phase][1]), rank, world)
    dcp.save(checkpoint_state(model, opt, sched), checkpoint_id=os.path.join(tmp, f"ckpt{phase}"))
    _moe_phase(rank, world, tmp, phase, data)


def _moe_phase(rank, world, tmp, phase, data):
    """3-D expert stacks (5 and 3 experts) split over 4, then 2, then 3 ranks: reload, save again
    unchanged (compared with the checkpoint by the test), one step, save."""
    torch.manual_seed(0)
    model = MoELM()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    opt = mf.Muon(mf.muon_param_groups(model, **MUON, adamw_lr=3e-3))
    if phase:
        state = mf.get_state_dict(model, opt)
        dcp.load(state, checkpoint_id=os.path.join(tmp, f"moe{phase - 1}"))
        mf.set_state_dict(model, opt, state)
        for p in model.parameters():
            if placement_of(p).spec.is_experts:  # momentum follows the experts this rank holds
                assert ("momentum_buffer" in opt.state.get(p, {})) == (p.numel() > 0)
        dcp.save(mf.get_state_dict(model, opt), checkpoint_id=os.path.join(tmp, f"moe_reloaded{phase}"))
    x = data[phase][rank * (GLOBAL // world):(rank + 1) * (GLOBAL // world), :9]
    torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    dcp.save(mf.get_state_dict(model, opt), checkpoint_id=os.path.join(tmp, f"moe{phase}"))


def _converted(path, tmp):
    """A DCP checkpoint through torch's own converter: a plain torch.save file, loaded."""
    out = os.path.join(tmp, os.path.basename(path) + ".pt")
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _worst(diffs, a, b, what):
    torch.testing.assert_close(a, b, rtol=BOUND, atol=BOUND, msg=lambda m: f"{what}: {m}")
    d = (a - b).abs().max().item() if a.numel() else 0.0
    diffs[what.split(" ")[-1]] = max(diffs.get(what.split(" ")[-1], 0.0), d)


def _compare_to_reference(ckpt, snap, diffs, where):
    for n, p in snap["model"].items():
        _worst(diffs, ckpt["model"][n], p, f"{where} param")
    assert set(ckpt["optim"]["state"]) == set(snap["state"]), where
    for n, ref in snap["state"].items():
        ours = ckpt["optim"]["state"][n]
        assert set(ours) == set(ref), (where, n, set(ours), set(ref))
        for k, v in ref.items():
            if k == "step":
                assert torch.equal(ours[k], v), (where, n)
            else:
                _worst(diffs, ours[k], v, f"{where} {n} {k}")


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("chain"))
    torch.set_num_threads(1)
    for phase, (world, _) in enumerate(PHASES):
        spawn(_chain_worker, world, tmp, phase)
    ends = [sum(n for _, n in PHASES[:i + 1]) for i in range(len(PHASES))]
    snaps = reference_snapshots(set(ends) | {ALL_STEPS})
    return dict(tmp=tmp, ends=ends, snaps=snaps,
                ckpts=[_converted(os.path.join(tmp, f"ckpt{i}"), tmp) for i in range(len(PHASES))])


def test_reshard_chain_4_2_3_matches_one_process(chain):
    """Save at 4 ranks, load at 2, train, save, load at 3, train, save. Each checkpoint holds
    what torch.optim.Muon (fp32 NS) + torch.optim.AdamW on one process hold after the same
    steps: parameters, momentum, exp_avg, exp_avg_sq by name within PARITY_TOL, steps exactly;
    each reload, saved again, equals the checkpoint it came from bit for bit (also for a model
    whose 3-D expert stacks are split by experts: 5 and 3 experts over 4, 2, 3 ranks)."""
    tmp, diffs = chain["tmp"], {}
    for i, end in enumerate(chain["ends"]):
        ckpt = chain["ckpts"][i]
        _compare_to_reference(ckpt, chain["snaps"][end], diffs, f"after {end} steps (ckpt{i})")
        assert [g["lr"] for g in ckpt["optim"]["param_groups"]] == pytest.approx(chain["snaps"][end]["lr"])
        assert ckpt["sched"]["last_epoch"] == end
    for phase in (1, 2):
        for again, before in (
                (f"reloaded{phase}", chain["ckpts"][phase - 1]),
                (f"moe_reloaded{phase}", _converted(os.path.join(tmp, f"moe{phase - 1}"), tmp))):
            flat_a, flat_b = _flatten(_converted(os.path.join(tmp, again), tmp)), _flatten(before)
            assert flat_a.keys() == flat_b.keys()
            assert any(k.endswith("w_in.momentum_buffer") for k in flat_a) or "moe" not in again
            for k, v in flat_b.items():
                assert torch.equal(flat_a[k], v) if isinstance(v, torch.Tensor) else flat_a[k] == v, k
    print(f"\nlargest |difference| to one process after resharding: {diffs}")


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_every_element_written_once(chain):
    """At 4 ranks: each tensor's chunks tile it exactly (no copy twice, no empty chunk from a
    non-owner); a Muon matrix and its momentum are one chunk (the owner's); the bytes of all
    chunks are those of the model plus the optimizer state."""
    md = FileSystemReader(os.path.join(chain["tmp"], "ckpt0")).read_metadata()
    expected = 0
    for key, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            continue
        assert sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size), key
        elem = torch.empty((), dtype=m.properties.dtype).element_size()
        expected += math.prod(m.size) * elem
        if (key.startswith("model.layers.") and len(m.size) == 2) or key.endswith(".momentum_buffer"):
            assert len(m.chunks) == 1, key  # a matrix, or its momentum: the owner's one chunk
    model = build_model("gpt", GPTConfig(**ODD))
    n_params = sum(p.numel() for p in model.parameters())
    n_muon = sum(p.numel() for n, p in model.named_parameters() if is_muon_name(n, p))
    n_adamw_tensors = sum(1 for n, p in model.named_parameters() if not is_muon_name(n, p))
    assert expected == 4 * (n_params + n_muon + 2 * (n_params - n_muon) + n_adamw_tensors)


def test_load_at_one_rank_and_into_plain_torch(chain, world1):
    """The last checkpoint of the chain loads at world size 1 (the 4th world size) and, through
    torch's dcp_to_torch_save, into the plain model and torch.optim.Muon / AdamW with the
    name -> index recipe of docs/checkpoint.md; one more step in each matches one process."""
    last, snaps = chain["ends"][-1], chain["snaps"]
    data = batches(ALL_STEPS, 1, GLOBAL, SEQ)
    model, opt, sched = build_sharded(1, seed=7)
    load_state(model, opt, sched, os.path.join(chain["tmp"], f"ckpt{len(PHASES) - 1}"))
    # the same checkpoint as full tensors (dcp_to_torch_save) through set_state_dict: the same state
    other, other_opt, _ = build_sharded(1, seed=8)
    mf.set_state_dict(other, other_opt, chain["ckpts"][-1])
    a, b = mf.get_state_dict(model, opt), mf.get_state_dict(other, other_opt)
    assert all(torch.equal(v.local, b["model"][n].local) for n, v in a["model"].items())
    for n, st in a["optim"]["state"].items():
        for k, v in st.items():
            w = b["optim"]["state"][n][k]
            assert torch.equal(v.local, w.local) if isinstance(v, RowShard) else torch.equal(v, w), (n, k)
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    train_steps(model, opt, sched, data, [last], 0, 1)
    mine = mf.get_state_dict(model, opt)
    ref = snaps[ALL_STEPS]
    for n, p in ref["model"].items():
        torch.testing.assert_close(mine["model"][n].local, p, rtol=BOUND, atol=BOUND)
    for n, st in ref["state"].items():
        for k, v in st.items():
            ours = mine["optim"]["state"][n][k]
            torch.testing.assert_close(ours.local if isinstance(ours, RowShard) else ours, v,
                                       rtol=BOUND, atol=BOUND)

    # plain torch: the recipe of docs/checkpoint.md
    plain = build_model("gpt", GPTConfig(**ODD), seed=7)
    ckpt = chain["ckpts"][-1]
    plain.load_state_dict(ckpt["model"])
    named = list(plain.named_parameters())
    muon_names = [n for n, p in named if is_muon_name(n, p)]
    adamw_names = [n for n, p in named if not is_muon_name(n, p)]
    muon = torch.optim.Muon([dict(plain.named_parameters())[n] for n in muon_names], **MUON)
    adamw = torch.optim.AdamW([dict(plain.named_parameters())[n] for n in adamw_names], **ADAMW)
    for o, names in ((muon, muon_names), (adamw, adamw_names)):
        o.load_state_dict(to_torch_optimizer_state(ckpt["optim"], names, o))
    # the lr the schedule reached travels with the groups (one more step needs no scheduler)
    assert [muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"]] == pytest.approx(snaps[last]["lr"])
    with reference_ns_fp32():
        x = data[last]
        plain.loss(x[:, :-1], x[:, 1:]).backward()
        for o in (muon, adamw):
            o.step()
    for n, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), ref["model"][n], rtol=BOUND, atol=BOUND)
    for o, names in ((muon, muon_names), (adamw, adamw_names)):
        for n, p in zip(names, o.param_groups[0]["params"]):
            for k, v in o.state[p].items():
                torch.testing.assert_close(v, ref["state"][n][k], rtol=BOUND, atol=BOUND)


def to_torch_optimizer_state(optim_state: dict, names: list[str], opt: torch.optim.Optimizer) -> dict:
    """The docs/checkpoint.md recipe: our by-name optimizer state -> torch's by-index one, for
    a torch optimizer with one group over ``names`` in this order."""
    index = {n: i for i, n in enumerate(names)}
    saved = next(g for g in optim_state["param_groups"] if names[0] in g["params"])
    mine = opt.state_dict()["param_groups"][0]
    group = {**mine, **{k: v for k, v in saved.items() if k in mine and k != "params"}}
    group["params"] = list(range(len(names)))
    return {"state": {index[n]: s for n, s in optim_state["state"].items() if n in index},
            "param_groups": [group]}
