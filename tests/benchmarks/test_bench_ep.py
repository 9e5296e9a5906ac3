"""`matrixfsdp bench --ep` (benchmarks/parallel/ep.py) at dp_shard_mod_ep 2 x ep 2 on a tiny MoE: the
report's bytes are the recorded calls' bytes, and the owner layout's against FSDP2 + EP's
(docs/nd-parallel.md, "Expert parallelism").

What is asserted, and why:

* the bytes the report gives (per domain and kind, per phase, in total) are the sums of the
  recorded calls' most loaded ranks, recomputed here from the raw records independently of
  the pass grouping (every rank is in every pass of this layout, and every collective of a
  pass costs the same on every group of the pass, so a pass costs its group's call summed
  over one group per pass: one group of each size per rank here);
* each domain is a 1-D layout, whose owner floor does not depend on the placement:
  ``M + E(P-1)/P`` per pass against FSDP2's ``(M + E)(P-1)/P``. Both systems move exactly
  that (``as_designed``, ``fsdp2_as_modelled``), the experts' units (whole experts split
  evenly: the even all-gather) at FSDP2's bytes, and the runtime's counters equal the
  recording;
* the optimizer step issues no collective (ours) and FSDP2 runs on the meshes' groups only.
"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from helpers.ep_models import TINY
from helpers.rank_pool import spawn

from benchmarks.parallel.ep import measure_rank, parse_args
from benchmarks.parallel.ep_model import SYSTEMS, EPBenchConfig
from benchmarks.parallel.ep_report import render, summarise
from matrixfsdp.diagnosis.agree import all_gather_object

CFG = EPBenchConfig(grids=[(2, 2)], model=TINY, seq=8, batch=1)


def _run(rank, world, path):
    records = all_gather_object(measure_rank(CFG, 2, 2))
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump({"records": records, "grid": summarise(records, 2, 2)}, f)


def _recount(records: list[dict], system: str, rank: int) -> dict:
    """One rank's view, recomputed from the raw calls: every collective it took part in,
    charged its group's most loaded rank (calls matched per group, in order)."""
    mine = records[rank][system]["calls"]
    out = {"gather": 0, "reduce": 0, "other": 0, "forward": 0, "backward": 0, "step": 0}
    seen: dict[str, int] = {}
    for c in mine:
        k = seen[c["group"]] = seen.get(c["group"], -1) + 1
        peers = [[x for x in records[r][system]["calls"] if x["group"] == c["group"]][k]
                 for r in c["ranks"]]
        cost = max(max(x["sent"], x["received"]) for x in peers)
        kind = c["tag"][1] if c["tag"] else (
            "gather" if c["op"].startswith("all_gather") or c["op"] == "broadcast" else
            "reduce" if c["op"].startswith("reduce") else "other")
        out[kind] += cost
        out[c["phase"]] += cost
    return out


def test_bench_ep_2x2_bytes_are_the_recorded_calls(tmp_path):
    path = tmp_path / "grid.json"
    spawn(_run, 4, str(path))
    raw = json.loads(path.read_text())
    records, g = raw["records"], raw["grid"]
    assert (g["d"], g["ep"], g["ranks"]) == (2, 2, 4)
    for system in SYSTEMS:
        crit = g["systems"][system]["critical"]
        # every rank takes part in every pass here (each rank is in one experts' group and in
        # the dense group), and a pass costs the same on every rank: the step's critical
        # bytes are any rank's own recount
        for r in range(4):
            mine = _recount(records, system, r)
            assert g["systems"][system]["per_rank_bytes"][r] == crit["total"]
            for kind in ("gather", "reduce"):
                assert mine[kind] == crit["experts"][kind] + crit["dense"][kind], (system, kind)
            assert mine["other"] == crit["other"]
            assert {p: mine[p] for p in ("forward", "backward", "step")} == crit["phases"]
        assert crit["experts"]["gather"] > 0 and crit["dense"]["reduce"] > 0
        assert g["systems"][system]["step_calls"] == 0
    ours, theirs = (g["systems"][s]["critical"] for s in SYSTEMS)
    assert theirs["other"] == 0 and ours["phases"]["step"] == 0
    # the runtime's counters, the model of both systems, the meshes' groups
    assert g["systems"]["matrixfsdp"]["comm_stats_agrees"]
    assert g["as_designed"] and g["fsdp2_as_modelled"] and g["within_floor"], (g["floor"], ours)
    assert g["systems"]["fsdp2_ep"]["mesh_groups_only"]
    # the experts' units: all Muon matrices over d = 2 ranks, each rank holding whole experts
    # of one size: one even all-gather of them, FSDP2's ring exactly, and so the owner floor
    # (broadcasting pieces would be 2x); a reduce adds the gradient flags and the 16-element
    # alignment of the stacks after them (at most 15 elements before each of its 3 stacks)
    assert g["floor"]["matrix_ratio"] == {"dense": 4 / 3}
    floor = g["floor"]["matrixfsdp"]["experts"]["gather"]
    assert ours["experts"]["gather"] == theirs["experts"]["gather"] == floor
    experts = [u for u in g["units"] if u["experts"]]
    flags = sum(u["flag_bytes"] for u in experts) * (2 - 1)
    extra = ours["experts"]["reduce"] - theirs["experts"]["reduce"]
    assert flags <= extra <= flags + 3 * 15 * 4 * len(experts), (extra, flags)
    # gathered: root once, blocks and experts twice (forward, backward), as FSDP2
    assert g["gathers"] == {"<root>": 1, "layers.0": 2, "layers.0.moe.experts": 2,
                            "layers.1": 2, "layers.1.moe.experts": 2}
    md = render({"config": {"model": vars(TINY), "seq": 8, "batch": 1, "warmup": 1},
                 "machine": None, "grids": [g]})
    assert "| 2 x 2 (4 ranks) | all | total |" in md and "owner floor" in md


def test_bench_ep_arguments():
    cfg = parse_args(["--ep", "--grids", "2x2,4x2", "--layers", "1", "--experts", "8"])
    assert cfg.grids == [(2, 2), (4, 2)] and cfg.model.layers == 1 and cfg.model.experts == 8
    with pytest.raises(SystemExit):  # 4 experts cannot split evenly over 8 ranks
        parse_args(["--ep", "--grids", "4x2", "--experts", "4"])
