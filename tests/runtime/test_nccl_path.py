"""The NCCL path on CPU: one launch per unit and direction, exact against one process.

``grouped_gloo`` (:mod:`matrixfsdp.testing.grouped_gloo`) is gloo with NCCL's coalescing (the
ops issued between ``_start_coalescing`` and ``_end_coalescing`` go out as one launch) and a
count of every launch and op. On it the runtime finds the coalescing (asking the group, not
its name) and takes the path it takes on NCCL: a unit's gather is one launch of an even
all-gather plus one broadcast per rank holding its matrices, its reduce one launch of a
reduce-scatter plus one reduce per holder; under HSDP the replicate dim adds one launch per
unit and direction; under TP the tp hop is one all-to-all per unit and direction."""

from __future__ import annotations

import pytest
import torch
from helpers import tp_training
from helpers.parity import ADAMW, FP32_CASES, MUON, ODD, muon_groups, run_parity
from helpers.rank_pool import spawn
from helpers.reference import assert_params_close, batches, rank_slice, train_reference
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp import testing
from matrixfsdp.train.models import GPTConfig

transformers = pytest.importorskip("transformers")

# a Llama of 4 blocks, 7 matrices each (q, k, v, o, gate, up, down) and two norms
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
             use_cache=False, tie_word_embeddings=False)


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def _launches_in(model, x, opt):
    """Process-group launches and ops of one forward, one backward and one optimizer step."""
    out = {}
    testing.COUNTS.reset()
    loss = model(input_ids=x, labels=x).loss
    out["forward"] = dict(testing.COUNTS.launches), dict(testing.COUNTS.ops)
    testing.COUNTS.reset()
    loss.backward()
    out["backward"] = dict(testing.COUNTS.launches), dict(testing.COUNTS.ops)
    testing.COUNTS.reset()
    opt.step()
    opt.zero_grad()
    out["step"] = dict(testing.COUNTS.launches), dict(testing.COUNTS.ops)
    return out


def _count_worker(rank, world_size, out_path):
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    counts = {}
    ours = _llama()
    mf.shard_model(ours, mesh=mesh)
    root = mf.get_root(ours)
    assert root.comm.coalesce  # the group answered the probe
    opt = mf.Muon(mf.muon_param_groups(ours, lr=0.02))
    for _ in range(2):  # the second step: the prefetch order recorded in the first
        mf.comm_stats(ours).reset()
        counts["ours"] = _launches_in(ours, x, opt)
    counts["ours_stats"] = mf.comm_stats(ours).calls, dict(mf.comm_stats(ours).launches)
    counts["holders"] = [len(u.layout.holders) for u in root.units]
    theirs = _llama()
    for block in theirs.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    for _ in range(2):
        counts["fsdp2"] = _launches_in(theirs, x, opt)
    if rank == 0:
        torch.save(counts, out_path)


def test_one_call_per_unit_and_direction_at_4_ranks(tmp_path):
    """transformers' Llama, 4 blocks of 7 matrices and a root, 4 ranks: a forward is 5
    process-group calls and a backward 9, FSDP2's own counts on the same backend (gloo's path
    takes 33 and 66); the optimizer step none."""
    out = str(tmp_path / "counts.pt")
    spawn(_count_worker, 4, out, backend="grouped_gloo")
    counts = torch.load(out)
    ours, fsdp2 = counts["ours"], counts["fsdp2"]
    total = {phase: sum(c[0].values()) for phase, c in ours.items()}
    theirs = {phase: sum(c[0].values()) for phase, c in fsdp2.items()}
    print("launches and ops per phase, ours", ours, "FSDP2", fsdp2)
    assert theirs["forward"] == 5 and theirs["backward"] == 9, fsdp2
    # the root (no matrix: one even all-gather) and 4 blocks gathered, each block in one
    # launch; 4 blocks gathered again, 5 units reduced
    assert ours["forward"][0] == {"all_gather": 1, "coalesced": 4}, ours
    assert ours["backward"][0] == {"coalesced": 8, "reduce_scatter": 1}, ours
    assert total["forward"] == theirs["forward"] and total["backward"] == theirs["backward"]
    assert total["step"] == 0
    # inside each launch: an even all-gather / reduce-scatter plus one op per rank holding
    # the block's matrices (grows with the owners, not the ranks)
    root, *blocks = counts["holders"]
    assert root == 0 and all(1 <= h <= 4 for h in blocks), counts["holders"]
    assert ours["forward"][1] == {"all_gather": 5, "broadcast": sum(blocks)}, ours
    assert ours["backward"][1] == {"all_gather": 4, "broadcast": sum(blocks),
                                   "reduce_scatter": 5, "reduce": sum(blocks)}, ours
    # the runtime's own counters (one step) agree
    ops, launches = counts["ours_stats"]
    assert ops == {"all_gather": 9, "broadcast": 2 * sum(blocks), "reduce_scatter": 5,
                   "reduce": sum(blocks)}, ops
    assert launches == {"gather": 9, "reduce": 5}, launches


@pytest.mark.parametrize("world_size", [2, 4])
def test_grouped_path_matches_torch(world_size, tmp_path):
    """The NCCL path's calls, different data per rank, fp32 NS: within PARITY_TOL of
    torch.optim.Muon + AdamW on one process (test_parity's cases: tied/fused shapes odd for
    every world size, micro-batches at 4). The ops are gloo's path's, launched together:
    test_parity runs them at 8 ranks, one block over 8."""
    case = {**dict(same_data=False, ns_fp32=True, muon=MUON, adamw=ADAMW), **FP32_CASES[world_size]}
    ours, ref = run_parity(case, world_size, tmp_path, backend="grouped_gloo")
    assert_params_close(ours["params"], ref, what=f"grouped, {world_size} ranks: ")


STEPS, PER = 4, 2


def _hsdp_worker(rank, world_size, out_path):
    """2 x 2 HSDP on the NCCL path: per unit the replicate dim's all-reduce and matrix
    reduces in one launch, its matrix broadcasts in one."""
    cfg = GPTConfig(**ODD)
    torch.manual_seed(0)
    from matrixfsdp.train.models import GPT
    model = GPT(cfg)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    root = mf.get_root(model)
    assert root.comm.coalesce and root.replication.comm.coalesce
    opt = mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32))
    replica = mesh["replicate"].get_local_rank()
    for i, x in enumerate(batches(STEPS, 2, PER, 16)):
        if i == STEPS - 1:
            mf.comm_stats(model).reset()
        x = rank_slice(x, replica, PER, False)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    stats = mf.comm_stats(model)
    calls, launches = stats.calls, dict(stats.launches)
    holding = sum(1 for u in root.units if u.layout.has_replica_owned and
                  bool(u.layout.segment(root.groups.shard_rank).replica_runs))
    state = mf.full_state_dict(model)
    if rank == 0:
        torch.save({"params": state, "calls": calls, "launches": launches, "holding": holding},
                   out_path)


def test_hsdp_on_the_grouped_path_matches_torch(tmp_path):
    """2 x 2, different data per replica, fp32 NS: within PARITY_TOL of one process; on the
    replicate dim, per unit one launch per backward (the all-reduce of its replicated rows
    and a reduce of each replica's matrices) and, where this rank holds matrices a replica
    steps, one launch of broadcasts per step."""
    out = str(tmp_path / "out.pt")
    spawn(_hsdp_worker, 4, out, backend="grouped_gloo")
    ours = torch.load(out)
    ref = train_reference(GPTConfig(**ODD), batches(STEPS, 2, PER, 16), muon_kw=MUON,
                          adamw_kw=ADAMW, ns_fp32=True)
    assert_params_close(ours["params"], ref, what="grouped HSDP 2x2: ")
    calls, launches, holding = ours["calls"], ours["launches"], ours["holding"]
    blocks = ODD["n_layers"]
    assert calls["replicate_allreduce"] == blocks + 1, calls
    assert launches["replicate"] == blocks + 1 + holding, (launches, holding)
    assert calls["replicate_reduce"] >= holding and calls["replicate_broadcast"] >= holding


def _tp_worker(rank, world_size, out_path):
    from helpers.collectives import Collectives
    from helpers.tp_models import apply_tp, build_llama
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tp_training.tp_shard(apply_tp(build_llama(), mesh["tp"], True), mesh["dp"])
    assert mf.get_root(model).comm.coalesce
    opt = tp_training.tp_optimizer(model)
    counted = Collectives()
    mf.comm_stats(model).reset()
    tp_training.tp_train(model, opt, tp_training.tp_data(2), mesh["dp"].get_local_rank(), counted)
    stats = mf.comm_stats(model)
    state = mf.full_state_dict(model)
    if rank == 0:
        torch.save({"params": state, "calls": stats.calls, "launches": dict(stats.launches),
                    "step": counted["step"]}, out_path)


def test_tp_on_the_grouped_path_matches_torch(tmp_path):
    """dp 2 x tp 2 (torchtitan's Llama plan): within PARITY_TOL of one process with
    clipping; each block's gather one tp all-to-all and one launch over the dp group, its
    reduce one launch and one tp all-to-all; no collective in the step."""
    out = str(tmp_path / "out.pt")
    spawn(_tp_worker, 4, out, backend="grouped_gloo")
    ours = torch.load(out)
    ref = tp_training.tp_reference(tp_training.tp_data(2))
    assert_params_close(ours["params"], ref[-1], what="grouped dp 2 x tp 2: ")
    assert ours["step"] == 0
    calls, launches = ours["calls"], ours["launches"]
    # one launch per unit and direction over dp (each an even all-gather / reduce-scatter
    # plus broadcasts / reduces inside), beside at most one tp hop per unit and direction
    assert launches["gather"] == calls["all_gather"] + calls["tp_all_to_all"], (calls, launches)
    assert launches["reduce"] == calls["reduce_scatter"] + calls["tp_grad_all_to_all"], \
        (calls, launches)
    assert 0 < calls["tp_all_to_all"] <= calls["all_gather"], calls
    assert 0 < calls["tp_grad_all_to_all"] <= calls["reduce_scatter"], calls


def test_coalescing_probe_says_no_on_gloo_and_yes_on_grouped_gloo(tmp_path):
    """The runtime asks the group once at set-up: gloo refuses to coalesce (one launch per
    op), grouped_gloo coalesces (one launch per unit and direction)."""
    spawn(_probe_worker, 2, backend="gloo")
    spawn(_probe_worker, 2, backend="grouped_gloo")


def _probe_worker(rank, world_size):
    import torch.distributed as dist

    from matrixfsdp.runtime.collectives import coalescing_supported
    assert coalescing_supported(dist.group.WORLD, torch.device("cpu")) == \
        (dist.get_backend() == "grouped_gloo")
    t = torch.ones(1)
    dist.all_reduce(t)  # the group is still usable after a refused probe
    assert t.item() == world_size
