"""The runtime does what the planner charges at the scale it is for: one process plays a
rank of 16384 (:mod:`matrixfsdp.testing.hollow`: collectives complete at once) at the
layout ``matrixfsdp plan`` advises for Llama 3 405B (replicate 64 x shard 32 x tp 8, bf16
gathers, fp32 reduces, the first and last blocks kept gathered from forward to backward),
on a model of 405B's proportions (grouped-query attention, 8 kv heads; 1/128 of its
widths, 8 blocks) under torchtitan's TP plan. Its counters, per phase (launches, NCCL ops,
critical bytes; the step's split Newton-Schulz all-reduces included) equal the search's
cost path for that rank (``cost_path`` -> ``rank_counts`` + ``step_counts``), and the
runtime's placements equal the planner's.

At 1/128 of 405B's widths ``tp_ownership="auto"`` holds every tp-split matrix whole on a
tp rank (at 405B's it owns 630 of 882 by their tp groups: the latency of the split NS's
all-reduces outweighs a slice's hop at these sizes); ``"group"`` runs the other placement,
at a rank whose replica steps its tp group's matrices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
import matrixfsdp as mf
from matrixfsdp import testing
from matrixfsdp.advisor.layout_eval import cost_path
from matrixfsdp.costs.links import Links
from matrixfsdp.advisor.model_shapes import shapes_of
from matrixfsdp.costs.passes import rank_counts, step_counts
from matrixfsdp.layout.traffic import Dtypes
from benchmarks.parallel.tp_model import Llama, LlamaConfig, apply_tp

R, S, T = 64, 32, 8
CFG = LlamaConfig(d_model=128, heads=16, kv_heads=8, ffn=416, layers=8, vocab=1024)
testing.register("hollow")
with torch.device("meta"):
    twin = Llama(CFG)
own = sys.argv[2]
(_, plan, costs), = cost_path(shapes_of(twin, list(twin.layers)), R, S, T,
                              dtypes=Dtypes(4, 2, 4), links=Links(coalesced=True),
                              tp_ownership=own)
# "stepping": tp rank 5 of the last data-parallel rank that steps a group-owned matrix
rank = int(sys.argv[1]) if sys.argv[1] != "stepping" else T * max(
    pl.owner for pl in plan.placements.values() if pl.tp_group) + 5
if True:
    dist.init_process_group("hollow", store=dist.HashStore(), rank=rank, world_size=R * S * T)
    mesh = init_device_mesh("cpu", (R, S, T), mesh_dim_names=("replicate", "shard", "tp"))
    torch.manual_seed(0)
    model = apply_tp(Llama(CFG), mesh["tp"])
    dp = mesh["replicate", "shard"]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.layers:
        mf.fully_shard(b, mesh=dp, mp_policy=mp, tp_ownership=own)
    mf.fully_shard(model, mesh=dp, mp_policy=mp, tp_ownership=own)
    model.layers[0].set_reshard_after_forward(False)  # the advice's "edges" at 1 micro-batch
    model.layers[-1].set_reshard_after_forward(False)
    opt = mf.Muon(mf.muon_param_groups(model, lr=0.02))
    stats = mf.comm_stats(model)
    x = torch.randint(0, CFG.vocab, (1, 17))
    for step in range(2):  # the second: a steady step (the first one's broadcasts included)
        stats.reset()
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    calls, crit = stats.phase("calls"), stats.phase("critical_bytes")
    ran = {ph: {"launches": stats.launches[ph], "calls": calls[ph],
                "critical_bytes": float(crit[ph])} for ph in calls if calls[ph]}
    d, t = rank // T, rank % T
    pred = rank_counts(costs.units, d % S, t, 1, keep="edges")
    pred.update(step_counts(plan, d, T, t))
    placed = lambda p: {n: (pl.owner, pl.tp_owner, pl.tp_group) for n, pl in p.placements.items()}
    print(json.dumps({"rank": rank, "own": own, "ran": ran, "pred": pred,
                      "same_plan": placed(mf.get_root(model).plan) == placed(plan),
                      "group_owned": sum(pl.tp_group for pl in plan.placements.values()),
                      "kinds": sorted(stats.counts)}))
"""


def test_a_rank_of_16384_issues_what_the_planner_charges_at_405bs_advised_layout():
    """The last rank (replica 63, shard 31, tp 7) under ``auto``, and a rank of a replica
    that steps group-owned matrices (tp rank 5 of the last data-parallel rank that steps
    one: replica 2) under ``group``: every phase's
    launches, ops and critical bytes as the search's cost path charges them, to the byte
    (before: the replicate all-reduce's bytes were charged as a fraction, 2(R-1)/R, where
    the ring moves whole bytes: 14 bytes apart at 64 replicas)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    runs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(rank), own], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank, own in (("16383", "auto"), ("stepping", "group"))]
    got = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr[-3000:]
        got.append(json.loads(stdout.strip().splitlines()[-1]))
    for case in got:
        print(case)
        assert case["same_plan"], case["rank"]
        assert case["ran"] == case["pred"], case
        assert {"gather", "reduce", "replicate"} <= case["ran"].keys(), case
    auto, group = got
    assert auto["group_owned"] == 0 and {"tp_all_to_all", "tp_grad_all_to_all"} <= set(auto["kinds"])
    assert group["group_owned"] > 0 and "step" in group["ran"], group
    assert not {"tp_all_to_all", "tp_grad_all_to_all"} & set(group["kinds"]), group
