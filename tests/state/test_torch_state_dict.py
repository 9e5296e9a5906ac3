"""torch's own state-dict functions on a MatrixFSDP model, as under FSDP2 (issue 23, point 2):
``model.state_dict()`` / ``load_state_dict()``, an optimizer's ``state_dict()`` /
``load_state_dict()``, ``torch.distributed.checkpoint.state_dict``'s ``get_state_dict`` /
``set_state_dict`` / ``get_model_state_dict`` / ... with ``StateDictOptions``, and torchtitan's
``CheckpointManager``, unchanged.

One spawn at 2 ranks saves (3 steps), one at 3 ranks loads and trains on (2 steps); this
process loads the same checkpoints at 1 rank and into plain torch. Every number is compared
with torch.optim.Muon (fp32 NS) + torch.optim.AdamW, or torch.optim.AdamW alone, on one
process (within PARITY_TOL; ``step`` exactly)."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.checkpointing import GLOBAL, SEQ, build_sharded, reference_snapshots, train_steps
from helpers.parity import ADAMW, MUON, ODD
from helpers.rank_pool import spawn
from helpers.reference import PARITY_TOL, batches, build_model, is_muon_name, linear_decay, reference_ns_fp32
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.runtime.param import placement_of
from matrixfsdp.tensors.row_shard import RowShard
from matrixfsdp.train.models import GPTConfig

SAVE_AT, STEPS = 3, 5  # save after 3 steps at 2 ranks; 2 more at 3 ranks
FULL_ON_0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
TITAN_ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)


def _muon_state(model, opt, sched):
    """The checkpoint through torch's helpers: {"model", "optim"} by name, and the schedule."""
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": sched.state_dict()}


def _full_to_file(model, opt, path, rank):
    """torch's full_state_dict + cpu_offload: full tensors on rank 0 only, saved for this
    process to compare with one process."""
    msd, osd = get_state_dict(model, opt, options=FULL_ON_0)
    if rank:
        assert msd == {} and osd == {}
        return
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in msd.values())
    torch.save({"model": msd, "optim": osd}, path)  # full tensors: a plain file


# ---- torchtitan: CheckpointManager + OptimizersContainer (AdamW), unchanged -------------------------
def _titan(world, tmp, seed=0, async_mode="disabled"):
    titan_opt = pytest.importorskip("torchtitan.components.optimizer")
    from torchtitan.components.checkpoint import CheckpointManager
    mf.register_elementwise(titan_opt.OptimizersContainer)  # it steps its AdamW, element-wise
    model = build_model("gpt", GPTConfig(**ODD), seed=seed)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    groups = [titan_opt.ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=TITAN_ADAMW)]
    opts = titan_opt.OptimizersContainer(
        titan_opt.OptimizersContainer.Config(param_groups=groups, implementation="for-loop"),
        model_parts=[model])
    sched = torch.optim.lr_scheduler.LambdaLR(opts.optimizers[0], linear_decay)
    ckpt = CheckpointManager(
        CheckpointManager.Config(enable=True, folder=os.path.join(tmp, "titan"), interval=1,
                                 keep_latest_k=0, last_save_model_only=False,
                                 initial_load_model_only=False, async_mode=async_mode),
        dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=sched, states={},
        sd_adapter=None)
    return model, opts, sched, ckpt


def _titan_train(model, opts, sched, data, steps, rank, world):
    per_rank = GLOBAL // world
    for i in steps:
        x = data[i][rank * per_rank:(rank + 1) * per_rank]
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opts.step()
        opts.zero_grad()
        sched.step()


# ---- 2 ranks: train, save ----------------------------------------------------------------------
def _save_worker(rank, world, tmp):
    data = batches(STEPS + 1, 1, GLOBAL, SEQ)
    model, opt, sched = build_sharded(world)
    train_steps(model, opt, sched, data, range(SAVE_AT), rank, world)
    state = _muon_state(model, opt, sched)
    assert all(isinstance(v, RowShard) for v in state["model"].values())
    exp_avg = state["optim"]["state"]["embed.weight"]["exp_avg"]
    assert isinstance(exp_avg, RowShard) and tuple(exp_avg.shape) == (256, 35)
    assert tuple(exp_avg.local.shape) == (128, 35) and exp_avg.offsets == (128 * rank, 0)
    # every rank lists every state, as under FSDP2 (empty where it holds none of it)
    momentum = state["optim"]["state"]["layers.0.attn.q.weight"]["momentum_buffer"]
    owner = placement_of(dict(model.named_parameters())["layers.0.attn.q.weight"]).owner
    assert tuple(momentum.shape) == (35, 35) and momentum.local.numel() == (35 * 35 if owner == rank else 0)
    dcp.save(state, checkpoint_id=os.path.join(tmp, "muon"))
    for sd in (state["model"], state["optim"], model.state_dict(), opt.state_dict()):
        with pytest.raises(TypeError, match=r"one rank.s rows.*dcp\.save.*get_model_state_dict\("
                                            r"model, options=StateDictOptions\(full_state_dict=True"):
            torch.save(sd, io.BytesIO())  # never this rank's rows under the full names

    # full_state_dict: every rank the exact full tensors (a gather: no arithmetic)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert all(torch.equal(full[n], v) for n, v in mf.full_state_dict(model).items())
    assert all(type(v) is torch.Tensor for v in full.values())
    full_optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    assert tuple(full_optim["state"]["embed.weight"]["exp_avg"].shape) == (256, 35)
    assert full_optim["state"]["layers.0.attn.q.weight"]["momentum_buffer"].shape == (35, 35)
    # cpu_offload alone: the same RowShards, on the CPU
    offloaded = get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))
    assert all(isinstance(v, RowShard) and v.local.device.type == "cpu" for v in offloaded.values())
    _full_to_file(model, opt, os.path.join(tmp, f"full{SAVE_AT}.pt"), rank)

    # asynchronous: torch's default stager copies the RowShards (through _local_tensor), in
    # a thread on torchtitan's own gloo group; the step after the call changes nothing saved
    model, opts, sched, ckpt = _titan(world, tmp, async_mode="async")
    _titan_train(model, opts, sched, data, range(SAVE_AT), rank, world)
    assert ckpt.save(curr_step=SAVE_AT)
    _titan_train(model, opts, sched, data, [SAVE_AT], rank, world)
    ckpt.maybe_wait_for_saving()
    ckpt.close()


# ---- 3 ranks: load, train on, and the other options ----------------------------------------------
def _load_worker(rank, world, tmp):
    data = batches(STEPS + 1, 1, GLOBAL, SEQ)
    model, opt, sched = build_sharded(world, seed=123)  # other weights: everything comes from the checkpoint
    state = _muon_state(model, opt, sched)  # a fresh optimizer: torch's init step made its state
    dcp.load(state, checkpoint_id=os.path.join(tmp, "muon"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["sched"])
    for p in model.parameters():  # momentum lives on the matrix's owner at 3 ranks
        if placement_of(p).spec.muon:
            assert ("momentum_buffer" in opt.state.get(p, {})) == (placement_of(p).owner == rank)
    loaded = mf.full_state_dict(model)
    train_steps(model, opt, sched, data, range(SAVE_AT, STEPS), rank, world)
    _full_to_file(model, opt, os.path.join(tmp, f"full{STEPS}.pt"), rank)
    _model_loads(rank, world, loaded)
    _optimizer_from_full_tensors_is_refused(rank, world, tmp, data)

    model, opts, sched, ckpt = _titan(world, tmp, seed=123)
    assert ckpt.load(step=SAVE_AT)
    assert sched.last_epoch == SAVE_AT
    _titan_train(model, opts, sched, data, range(SAVE_AT, STEPS), rank, world)
    full = get_model_state_dict(model, options=FULL_ON_0)
    if rank == 0:
        torch.save(full, os.path.join(tmp, f"titan{STEPS}.pt"))
    ckpt.close()
    _fsdp2_loads(rank, world, tmp)


def _model_loads(rank, world, loaded):
    """A model's state from full tensors: torch's set_model_state_dict with full_state_dict
    (every rank) or broadcast_from_rank0 (rank 0 only), and plain load_state_dict; strict
    and its errors as torch's."""
    for options in (StateDictOptions(full_state_dict=True),
                    StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)):
        model, _, _ = build_sharded(world, seed=7)
        given = loaded if rank == 0 or not options.broadcast_from_rank0 else {}
        set_model_state_dict(model, {n: v.clone() for n, v in given.items()}, options=options)
        assert all(torch.equal(loaded[n], v) for n, v in mf.full_state_dict(model).items())
    model, _, _ = build_sharded(world, seed=7)
    keys = model.load_state_dict(loaded)
    assert not keys.missing_keys and not keys.unexpected_keys
    assert all(torch.equal(loaded[n], v) for n, v in mf.full_state_dict(model).items())
    partial = {n: v for n, v in loaded.items() if n != "head.weight"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head.weight"'):
        model.load_state_dict(partial)
    assert model.load_state_dict(partial, strict=False).missing_keys == ["head.weight"]
    keys = set_model_state_dict(model, partial, options=StateDictOptions(strict=False))
    assert keys.missing_keys == ["head.weight"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head.weight"'):
        set_model_state_dict(model, partial)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
        model.load_state_dict({**loaded, "extra": torch.zeros(1)})
    with pytest.raises(RuntimeError, match=r"'embed\.weight' has shape \(128, 35\), the model \(256, 35\)"):
        model.load_state_dict({**loaded, "embed.weight": loaded["embed.weight"][:128]})
    wrong = RowShard(torch.zeros(86, 35), (256, 35), (0, 0), "embed.weight")  # not this rank's rows
    if rank:
        with pytest.raises(RuntimeError, match=r"'embed\.weight'.*another placement"):
            model.load_state_dict({**loaded, "embed.weight": wrong})
    model.load_state_dict(model.state_dict(), assign=True)  # the parameter objects stay
    assert all(placement_of(p) is not None for p in model.parameters())


def _optimizer_from_full_tensors_is_refused(rank, world, tmp, data):
    """torch's full_state_dict / broadcast_from_rank0 loading optimizer state would place the
    rows by DTensor placements, which cannot say "rows a:b on this rank": refused on every rank
    before anything is loaded, naming the parameter and matrixfsdp.set_state_dict."""
    full = torch.load(os.path.join(tmp, f"full{SAVE_AT}.pt"))["optim"]
    model, opt, sched = build_sharded(world)
    train_steps(model, opt, sched, data, range(1), rank, world)
    before = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    for options, match in ((StateDictOptions(full_state_dict=True), r"rows of '.*'.*set_state_dict"),
                           (StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
                            r"to_local\(\) is refused.*set_state_dict")):
        given = full if rank == 0 or not options.broadcast_from_rank0 else {}
        with pytest.raises(Exception, match=match):
            set_optimizer_state_dict(model, opt, given, options=options)
        assert {id(p): st.keys() for p, st in opt.state.items()} == {i: st.keys() for i, st in before.items()}
        assert all(torch.equal(v, before[id(p)][k]) for p, st in opt.state.items() for k, v in st.items())


def _fsdp2_loads(rank, world, tmp):
    """The checkpoint saved at 2 ranks loads into FSDP2 (DTensor Shard(0)) at 3 through the
    same helpers: the parameters, and the AdamW state of a torch.optim.AdamW on the parameters
    mf.Muon steps with AdamW."""
    from torch.distributed.fsdp import fully_shard
    model = build_model("gpt", GPTConfig(**ODD), seed=123)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    adamw = torch.optim.AdamW([p for n, p in named if not is_muon_name(n, p)], **ADAMW)
    msd, osd = get_state_dict(model, adamw)
    dcp.load({"model": msd, "optim": {"state": osd["state"]}}, checkpoint_id=os.path.join(tmp, "muon"))
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, adamw, osd)
    full = {n: p.full_tensor() for n, p in named}
    state = {n: {k: v.full_tensor() if k != "step" else v for k, v in adamw.state[p].items()}
             for n, p in named if p in adamw.state}
    if rank == 0:
        torch.save({"model": full, "state": state}, os.path.join(tmp, "fsdp2.pt"))


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("torch_state_dict"))
    torch.set_num_threads(1)
    spawn(_save_worker, 2, tmp)
    spawn(_load_worker, 3, tmp)
    return dict(tmp=tmp, ref=reference_snapshots({SAVE_AT, SAVE_AT + 1, STEPS}),
                titan=_adamw_reference(STEPS))


# ---- one process: torch.optim.Muon + AdamW, and AdamW alone ----------------------------------------
def _adamw_reference(steps):
    model = build_model("gpt", GPTConfig(**ODD))
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **TITAN_ADAMW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_decay)
    for x in batches(STEPS + 1, 1, GLOBAL, SEQ)[:steps]:
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _compare(ours_model, ours_state, snap, what):
    """Parameters and optimizer state by name within PARITY_TOL, steps exactly; the worst
    |difference|."""
    worst = 0.0
    for n, p in snap["model"].items():
        torch.testing.assert_close(ours_model[n], p, rtol=PARITY_TOL, atol=PARITY_TOL,
                                   msg=lambda m, n=n: f"{what} {n}: {m}")
        worst = max(worst, (ours_model[n] - p).abs().max().item())
    assert set(ours_state) == set(snap["state"]), what
    for n, ref in snap["state"].items():
        assert set(ours_state[n]) == set(ref), (what, n)
        for k, v in ref.items():
            if k == "step":
                assert torch.equal(ours_state[n][k], v), (what, n)
                continue
            torch.testing.assert_close(ours_state[n][k], v, rtol=PARITY_TOL, atol=PARITY_TOL,
                                       msg=lambda m, n=n, k=k: f"{what} {n} {k}: {m}")
            worst = max(worst, (ours_state[n][k] - v).abs().max().item())
    return worst


def test_save_at_2_load_at_3_continues_as_one_process(ran):
    """torch's get_state_dict + dcp.save at 2 ranks; at 3 ranks torch's get_state_dict,
    dcp.load, set_state_dict, 2 more steps. The full state (torch's full_state_dict +
    cpu_offload, on rank 0) after 3 and after 5 steps is one process's: parameters, Muon
    momentum, AdamW's exp_avg / exp_avg_sq (full shapes) within PARITY_TOL, steps exactly."""
    worst = {}
    for step in (SAVE_AT, STEPS):
        full = torch.load(os.path.join(ran["tmp"], f"full{step}.pt"))
        worst[step] = _compare(full["model"], full["optim"]["state"], ran["ref"][step], f"after {step}")
        groups = full["optim"]["param_groups"]
        assert [g["lr"] for g in groups] == pytest.approx(ran["ref"][step]["lr"])
    print(f"\nlargest |difference| to one process (2 ranks, then 3): {worst}")


def test_checkpoint_loads_at_one_rank_and_into_plain_torch(ran, world1):
    """The 2-rank checkpoint, read by this process: into a MatrixFSDP model at 1 rank through
    torch's helpers, and into the plain model and torch.optim.Muon / AdamW through the same
    helpers (the optimizer state read back is the full one: embed.weight's exp_avg is
    (256, 35) and one process's, not one rank's half). One more step in each: one process's."""
    path, snap, data = os.path.join(ran["tmp"], "muon"), ran["ref"], batches(STEPS + 1, 1, GLOBAL, SEQ)
    model, opt, sched = build_sharded(1, seed=9)
    state = _muon_state(model, opt, sched)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["sched"])
    train_steps(model, opt, sched, data, [SAVE_AT], 0, 1)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    worst_mf = _compare(msd, osd["state"], snap[SAVE_AT + 1], "mf at 1 rank")

    plain = build_model("gpt", GPTConfig(**ODD), seed=9)
    named = list(plain.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_muon_name(n, p)], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named if not is_muon_name(n, p)], **ADAMW)
    msd, osd = get_state_dict(plain, [muon, adamw])
    dcp.load({"model": msd, "optim": {"state": osd["state"]}}, checkpoint_id=path)
    assert osd["state"]["embed.weight"]["exp_avg"].shape == (256, 35)
    for group, lr in zip(osd["param_groups"], snap[SAVE_AT]["lr"]):
        group["lr"] = lr  # the schedule's lr after 3 steps (mf.Muon's groups hold other keys)
    set_state_dict(plain, [muon, adamw], model_state_dict=msd, optim_state_dict=osd)
    assert _compare(msd, osd["state"], snap[SAVE_AT], "plain torch, loaded") <= PARITY_TOL
    with reference_ns_fp32():
        x = data[SAVE_AT]
        plain.loss(x[:, :-1], x[:, 1:]).backward()
        for o in (muon, adamw):
            o.step()
    msd, osd = get_state_dict(plain, [muon, adamw])
    worst_plain = _compare(msd, osd["state"], snap[SAVE_AT + 1], "plain torch, one more step")
    print(f"\nlargest |difference| to one process: mf at 1 rank {worst_mf:.3g}, plain {worst_plain:.3g}")


def test_torchtitan_checkpoint_manager_reshards(ran):
    """torchtitan's CheckpointManager + OptimizersContainer (torch.optim.AdamW over every
    parameter), unchanged: saved at 2 ranks after 3 steps (asynchronously, training on while
    it writes), loaded at 3, 2 more steps: one process's AdamW."""
    full = torch.load(os.path.join(ran["tmp"], f"titan{STEPS}.pt"))
    worst = 0.0
    for n, p in ran["titan"].items():
        torch.testing.assert_close(full[n], p, rtol=PARITY_TOL, atol=PARITY_TOL,
                                   msg=lambda m, n=n: f"{n}: {m}")
        worst = max(worst, (full[n] - p).abs().max().item())
    print(f"\ntorchtitan, 2 ranks then 3: largest |difference| to one process {worst:.3g}")


def test_fsdp2_loads_the_checkpoint(ran):
    """Into FSDP2 at 3 ranks: the parameters and the AdamW state after 3 steps are one
    process's."""
    got, snap = torch.load(os.path.join(ran["tmp"], "fsdp2.pt")), ran["ref"][SAVE_AT]
    adamw_state = {n: st for n, st in snap["state"].items() if "exp_avg" in st}
    worst = _compare(got["model"], got["state"], {**snap, "state": adamw_state}, "FSDP2")
    print(f"\nloaded into FSDP2 at 3 ranks: largest |difference| to one process {worst:.3g}")


def test_init_step_of_torch_helpers_is_exact(world1):
    """torch's helpers create a fresh optimizer's state by one step with zero gradients and lr
    0: on mf.Muon it changes no parameter and gives the state torch.optim.Muon + AdamW get
    from the same step on one process (zeros; AdamW's step 1)."""
    model, opt, _ = build_sharded(1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ours = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    plain = build_model("gpt", GPTConfig(**ODD))
    named = list(plain.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_muon_name(n, p)], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named if not is_muon_name(n, p)], **ADAMW)
    ref = get_optimizer_state_dict(plain, [muon, adamw])
    assert ours["state"].keys() == ref["state"].keys()
    for n, st in ref["state"].items():
        assert ours["state"][n].keys() == st.keys(), n
        assert all(torch.equal(ours["state"][n][k], v) for k, v in st.items()), n


class _OneMatrix(torch.nn.Module):
    """A block with one Muon matrix: at 2 ranks one rank owns every matrix."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Linear(8, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8, bias=False)])

    def forward(self, x):
        return self.layers[0](self.emb(x))


def _one_owner(rank, world):
    torch.manual_seed(0)
    model = _OneMatrix()
    mesh = init_device_mesh("cpu", (world,))
    mf.fully_shard(model.layers[0], mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    kinds = {type(v["exp_avg"]) for v in opt.state_dict()["state"].values()}
    assert kinds == {RowShard}, (rank, kinds)


def test_optimizer_state_is_row_shards_on_every_rank_when_one_rank_owns_every_matrix():
    """(before: the rank owning the one matrix took torch's AdamW over model.parameters() for
    an optimizer on mf.matrix_params and gave its local rows as plain tensors under the full
    names, while its peer gave RowShards)"""
    spawn(_one_owner, 2)
