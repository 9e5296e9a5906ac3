"""The NCCL path on CPU: one collective per unit and direction, exact against one process.

``grouped_gloo`` (:mod:`matrixfsdp.bench.grouped_gloo`) is gloo with NCCL's uneven
all-gather and reduce-scatter (one broadcast / reduce per rank, as ``ProcessGroupNCCL``
runs them) and a count of every process-group call. On it the runtime finds the uneven
collectives (asking the group, not its name) and takes the path it takes on NCCL: a unit's
gather is one ``dist.all_gather`` of every rank's chunk, its reduce one
``dist.reduce_scatter``; under HSDP the replicate dim adds one uneven call per unit and
direction beside the all-reduce of its replicated rows; under TP the tp hop is one
all-to-all per unit and direction."""

from __future__ import annotations

import pytest
import torch
from _dist import spawn
from reference import assert_params_close, batches, rank_slice, train_reference
from test_parity import ADAMW, FP32_CASES, MUON, ODD, _groups, _run
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.bench import grouped_gloo
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
    """Process-group calls of one forward, one backward and one optimizer step."""
    out = {}
    grouped_gloo.reset_launches()
    loss = model(input_ids=x, labels=x).loss
    out["forward"] = dict(grouped_gloo.LAUNCHES)
    grouped_gloo.reset_launches()
    loss.backward()
    out["backward"] = dict(grouped_gloo.LAUNCHES)
    grouped_gloo.reset_launches()
    opt.step()
    opt.zero_grad()
    out["step"] = dict(grouped_gloo.LAUNCHES)
    return out


def _count_worker(rank, world_size, out_path):
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    counts = {}
    ours = _llama()
    mf.shard_model(ours, mesh=mesh)
    assert mf.get_root(ours).comm.grouped  # the group answered the probe
    opt = mf.Muon(mf.muon_param_groups(ours, lr=0.02))
    for _ in range(2):  # the second step: the prefetch order recorded in the first
        counts["ours"] = _launches_in(ours, x, opt)
    counts["ours_stats"] = mf.comm_stats(ours).calls
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
    total = {phase: sum(c.values()) for phase, c in ours.items()}
    theirs = {phase: sum(c.values()) for phase, c in fsdp2.items()}
    print("launches per phase, ours", ours, "FSDP2", fsdp2)
    assert theirs["forward"] == 5 and theirs["backward"] == 9, fsdp2
    # the root and 4 blocks gathered; 4 blocks gathered again, 5 units reduced
    assert ours["forward"] == {"all_gather": 1, "all_gather_v": 4}, ours
    assert ours["backward"] == {"all_gather_v": 4, "reduce_scatter_v": 4, "reduce_scatter": 1}, ours
    assert total["forward"] <= theirs["forward"] + 1 and total["backward"] <= theirs["backward"] + 1
    assert total["step"] == 0
    # the runtime's own counters agree (two steps)
    assert counts["ours_stats"] == {"all_gather": 2, "all_gather_v": 16, "reduce_scatter": 2,
                                    "reduce_scatter_v": 8}, counts["ours_stats"]


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_grouped_path_matches_torch(world_size, tmp_path):
    """The NCCL path's calls, different data per rank, fp32 NS: within PARITY_TOL of
    torch.optim.Muon + AdamW on one process (test_parity's cases: tied/fused shapes odd for
    every world size, micro-batches at 4, one block over 8 ranks)."""
    case = {**dict(same_data=False, ns_fp32=True, muon=MUON, adamw=ADAMW), **FP32_CASES[world_size]}
    ours, ref = _run(case, world_size, tmp_path, backend="grouped_gloo")
    assert_params_close(ours["params"], ref, what=f"grouped, {world_size} ranks: ")


STEPS, PER = 4, 2


def _hsdp_worker(rank, world_size, out_path):
    """2 x 2 HSDP on the NCCL path: the replicate dim's matrices reduced in one uneven
    reduce-scatter per unit and broadcast in one uneven all-gather."""
    cfg = GPTConfig(**ODD)
    torch.manual_seed(0)
    from matrixfsdp.train.models import GPT
    model = GPT(cfg)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    root = mf.get_root(model)
    assert root.comm.grouped and root.replication.comm.grouped
    opt = mf.Muon(_groups(model, MUON, ADAMW, torch.float32))
    replica = mesh["replicate"].get_local_rank()
    for i, x in enumerate(batches(STEPS, 2, PER, 16)):
        if i == STEPS - 1:
            mf.comm_stats(model).reset()
        x = rank_slice(x, replica, PER, False)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    calls = mf.comm_stats(model).calls
    state = mf.full_state_dict(model)
    if rank == 0:
        torch.save({"params": state, "calls": calls}, out_path)


def test_hsdp_on_the_grouped_path_matches_torch(tmp_path):
    """2 x 2, different data per replica, fp32 NS: within PARITY_TOL of one process; per
    unit holding matrices one replicate-dim reduce-scatter per backward and one all-gather
    per step (beside the all-reduce of its replicated rows), no reduce or broadcast."""
    out = str(tmp_path / "out.pt")
    spawn(_hsdp_worker, 4, out, backend="grouped_gloo")
    ours = torch.load(out)
    ref = train_reference(GPTConfig(**ODD), batches(STEPS, 2, PER, 16), muon_kw=MUON,
                          adamw_kw=ADAMW, ns_fp32=True)
    assert_params_close(ours["params"], ref, what="grouped HSDP 2x2: ")
    calls = ours["calls"]
    blocks = ODD["n_layers"]
    assert calls["replicate_reduce_scatter_v"] == blocks, calls
    assert calls["replicate_all_gather_v"] == blocks, calls
    assert calls["replicate_allreduce"] == blocks + 1, calls
    assert "replicate_reduce" not in calls and "replicate_broadcast" not in calls, calls
    assert "broadcast" not in calls and "reduce" not in calls, calls


def _tp_worker(rank, world_size, out_path):
    import test_tp
    from collectives import Collectives
    from tp_models import apply_tp, build_llama
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = test_tp._shard(apply_tp(build_llama(), mesh["tp"], True), mesh["dp"])
    assert mf.get_root(model).comm.grouped
    opt = test_tp._optimizer(model)
    counted = Collectives()
    mf.comm_stats(model).reset()
    test_tp._train(model, opt, test_tp._data(2), mesh["dp"].get_local_rank(), counted)
    calls = mf.comm_stats(model).calls
    state = mf.full_state_dict(model)
    if rank == 0:
        torch.save({"params": state, "calls": calls, "step": counted["step"]}, out_path)


def test_tp_on_the_grouped_path_matches_torch(tmp_path):
    """dp 2 x tp 2 (torchtitan's Llama plan): within PARITY_TOL of one process with
    clipping; each block's gather one tp all-to-all and one uneven all-gather, its reduce
    one uneven reduce-scatter and one tp all-to-all; no collective in the step."""
    import test_tp
    out = str(tmp_path / "out.pt")
    spawn(_tp_worker, 4, out, backend="grouped_gloo")
    ours = torch.load(out)
    ref = test_tp._reference(test_tp._data(2))
    assert_params_close(ours["params"], ref[-1], what="grouped dp 2 x tp 2: ")
    assert ours["step"] == 0
    calls = ours["calls"]
    assert "broadcast" not in calls and "reduce" not in calls, calls
    assert calls["tp_all_to_all"] == calls["all_gather_v"], calls  # one hop per block gather
    assert calls["tp_grad_all_to_all"] == calls["reduce_scatter_v"], calls


def test_uneven_probe_says_no_on_gloo_and_yes_on_grouped_gloo(tmp_path):
    """The runtime asks the group once at set-up: gloo refuses an uneven all-gather (the
    per-piece path), grouped_gloo answers it (one call per unit)."""
    spawn(_probe_worker, 2, backend="gloo")
    spawn(_probe_worker, 2, backend="grouped_gloo")


def _probe_worker(rank, world_size):
    import torch.distributed as dist

    from matrixfsdp.runtime.collectives import uneven_supported
    assert uneven_supported(dist.group.WORLD, torch.device("cpu")) == \
        (dist.get_backend() == grouped_gloo.NAME)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group is still usable after a refused probe
    assert t.item() == world_size
