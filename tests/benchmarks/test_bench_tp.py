"""`matrixfsdp bench --tp` (benchmarks/parallel/tp.py) at dp 2 x tp 2 on a tiny Llama: the report's
structure, and the owner layout's bytes against FSDP2 + TP's (docs/nd-parallel.md).

What is asserted about the bytes, and why each bound:

* FSDP2 + TP moves exactly its model ``(M/T + E)(d-1)/d`` per unit pass, on data-parallel
  groups only, and MatrixFSDP exactly what its design predicts from the plan's placement
  (``M/T`` per pass over the dp groups + the plan's tp all-to-all + the even part):
  nothing travels that the byte flow does not need, and the runtime's own counters agree
  with the recorded calls;
* the balanced floor ``(M/T)(1 + (T-1)/(dT))`` is not reachable with whole matrices: a
  block's 7 matrices (4 of d x d, 3 of d x 2d) cannot be spread evenly over 2 rows x 2
  holders, so the exact floor is the best placement of whole matrices per unit (searched
  exhaustively, :func:`best_hop`); the plan balances Newton-Schulz cost over the model, not
  each unit's bytes, and may sit above it: allowed 5% (issue 13's slack on the 1-D floor),
  measured 3.6% here. Against the balanced floor: 10% (measured 7.5%);
* the optimizer step issues no collective.
"""

from __future__ import annotations

import json

import torch.distributed as dist
from helpers.rank_pool import spawn

from benchmarks.parallel.tp import measure, parse_args
from benchmarks.parallel.tp_model import SYSTEMS, LlamaConfig, TPBenchConfig
from benchmarks.parallel.tp_report import best_hop, render, row_hop

TINY = TPBenchConfig(grids=[(2, 2)], model=LlamaConfig(d_model=32, heads=4, ffn=64, layers=2,
                                                       vocab=64), seq=16, batch=2)


def _run(rank, world, path):
    res = measure(TINY, 2, 2)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(res, f)


def test_bench_tp_2x2_bytes_within_the_owner_floor(tmp_path):
    path = tmp_path / "grid.json"
    spawn(_run, 4, str(path))
    g = json.loads(path.read_text())
    assert (g["dp"], g["tp"], g["ranks"]) == (2, 2, 4)
    assert set(g["systems"]) == set(SYSTEMS)
    ours, theirs = (g["systems"][s]["critical"] for s in SYSTEMS)
    for c in (ours, theirs):
        assert set(c) >= {"gather", "reduce", "total", "tp_hop"}
        assert c["gather"] > 0 and c["reduce"] > 0
        assert c["total"] == c["gather"] + c["reduce"] + c["other"]
    assert set(g["ratio"]) == {"gather", "reduce", "total"}
    fl = g["floor"]
    assert fl["matrix_ratio"] == 2.5  # (dT + T - 1) / ((d - 1) T) at 2 x 2
    assert fl["balanced_ratio"] <= fl["whole_ratio"] <= fl["plan_ratio"] <= fl["matrix_ratio"]
    # every rank gathers the root once and each block twice (forward, backward), as FSDP2
    assert g["gathers"] == {"<root>": 1, "layers.0": 2, "layers.1": 2}
    # exact accounting: FSDP2 + TP as modelled, ours as designed, comm_stats = recording
    assert g["fsdp2_as_modelled"] and g["as_designed"], (theirs, ours, fl)
    assert g["systems"]["fsdp2_tp"]["dp_groups_only"]
    assert g["systems"]["matrixfsdp"]["comm_stats_agrees"]
    assert g["systems"]["fsdp2_tp"]["calls_rank0"] == {"all_gather_single": 5,
                                                      "reduce_scatter_single": 3}
    # the floors (module docstring): whole matrices + 5%, balanced + 10%
    assert ours["total"] <= 1.05 * fl["whole_ratio"] * theirs["total"], (g["ratio"], fl)
    assert ours["total"] <= 1.10 * fl["balanced_ratio"] * theirs["total"], (g["ratio"], fl)
    assert ours["tp_hop"] > 0 and theirs["tp_hop"] == 0
    assert all(g["systems"][s]["step_calls"] == 0 for s in SYSTEMS)
    md = render({"config": {"model": vars(TINY.model), "seq": 16, "batch": 2, "warmup": 1,
                            "sequence_parallel": False}, "machine": None, "grids": [g]})
    assert "| 2 x 2 (4 ranks) | total |" in md and "floor, whole matrices" in md


def test_tp_hop_floors_and_arguments():
    """The tp all-to-all of one row (T=2: the larger holder's bytes / 2) and the best
    placement of whole matrices: 7 matrices of 2,2,2,1,1,1,1 units on 2 x 2 cells can do
    no better than 3 units on a holder (1.5 on the all-to-all; balanced would be 1.25), on
    4 x 2 cells no better than the largest matrix alone (1)."""
    assert row_hop([6, 2], 2) == 3 and row_hop([3, 3, 3], 3) == 2 and row_hop([9, 0, 0], 3) == 6
    block = [8, 8, 8, 4, 4, 4, 4]
    assert best_hop(block, 2, 2) == 6 and best_hop(block, 4, 2) == 4
    cfg = parse_args(["--tp", "--grids", "2x2,4x2", "--layers", "1"])
    assert cfg.grids == [(2, 2), (4, 2)] and cfg.model.layers == 1
