"""``matrixfsdp plan``'s peers as their code runs, and the model's new parts: torch's Muon on
FSDP2 (+ TP) DTensors against the collectives torch itself issues (one process as rank 0
of 8 on torch's fake process group), DistMuon's refusals, bucket search and buffers, the
pipeline schedules, the default global batch, calibrated constants, and the bounding term
the table names."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from helpers import plan_shapes
from torch import nn

from matrixfsdp.__main__ import main
from matrixfsdp.advisor.advice import explain, peers_best
from matrixfsdp.advisor.peers import bucket_sizes, dtensor_ns_ops
from matrixfsdp.advisor.search import default_global_batch, search
from matrixfsdp.costs.constants import OP_KINDS, Constants
from matrixfsdp.costs.links import Group, GroupCost, Links
from matrixfsdp.costs.steptime import SCHEDULES, Workload
from matrixfsdp.layout.traffic import Dtypes

CFG = dataclasses.replace(plan_shapes.CFG, n_layers=8)


@pytest.fixture
def fake_world():
    """This process as rank 0 of 8 on torch's fake process group (collectives complete at
    once, shapes right)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    if dist.is_initialized():  # another file's one-rank group in this worker (conftest's
        dist.destroy_process_group()  # world1 makes it again when next asked)
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()


def _traced(monkeypatch) -> list:
    """Every all-gather / all-reduce DTensor issues: (kind, elements handed in, group size)."""
    import torch.distributed._functional_collectives as funcol

    seen = []
    gather, reduce = funcol.all_gather_single, funcol.all_reduce

    def size(group) -> int:
        return group[0].size(group[1])

    def all_gather_single(t, gather_dim, group, tag=""):
        seen.append(("all_gather", t.numel(), size(group)))
        return gather(t, gather_dim, group, tag)

    def all_reduce(t, reduceOp, group, tag=""):  # noqa: N803 (torch's name)
        seen.append(("all_reduce", t.numel(), size(group)))
        return reduce(t, reduceOp, group, tag)
    monkeypatch.setattr(funcol, "all_gather_single", all_gather_single)
    monkeypatch.setattr(funcol, "all_reduce", all_reduce)
    return seen


@pytest.mark.parametrize("style, shape", [(None, (64, 256)), (None, (256, 64)),
                                          ("colwise", (64, 256)), ("colwise", (256, 64)),
                                          ("rowwise", (64, 256)), ("rowwise", (256, 64))],
                         ids=["1-D-wide", "1-D-tall", "colwise-wide", "colwise-tall",
                              "rowwise-wide", "rowwise-tall"])
def test_torch_muon_on_dtensor_issues_what_the_model_charges(fake_world, monkeypatch, style,
                                                             shape):
    """torch.optim.Muon's step on an FSDP2 (+ TP) parameter issues exactly the collectives
    :func:`dtensor_ns_ops` lists (kind, elements, group), two NS iterations."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rows, cols = shape
    lin = nn.Linear(cols, rows, bias=False)
    if style is None:
        S, T, dim = 8, 1, None
        fully_shard(lin, mesh=init_device_mesh("cpu", (8,)))
    else:
        S, T, dim = 4, 2, 0 if style == "colwise" else 1
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(lin, mesh["tp"], ColwiseParallel() if dim == 0 else RowwiseParallel())
        fully_shard(lin, mesh=mesh["dp"])
    p = lin.weight
    p.grad = torch.ones_like(p)
    opt = torch.optim.Muon([p], ns_steps=2)
    seen = _traced(monkeypatch)
    opt.step()
    ops, flops = dtensor_ns_ops(rows, cols, S, T, dim, 2)
    assert Counter(seen) == Counter((k, n, S if g == "dp" else T) for k, g, n in ops)
    a, b = min(shape), max(shape)
    whole = 2 * (4 * a * a * b + 2 * a ** 3)
    assert flops <= whole and (flops == whole) == (style == "colwise" and rows <= cols)


def _shapes():
    return plan_shapes.gpt_shapes(CFG)


def test_distmuon_runs_where_torchtitan_does_with_its_best_bucket_and_its_buffers():
    s = search(_shapes(), 32, 1e15, dtypes=Dtypes(4, 2, 4), global_batch=64)
    for e in s.layouts:
        refused = e.layout.tp > 1 or e.layout.pp > 1
        assert (e.distmuon is None) == refused, e.layout
        if not refused:
            assert e.distmuon_blocks in bucket_sizes(CFG.n_layers)
            assert e.distmuon_memory > e.fsdp2_memory  # its two slots' buffers
    assert bucket_sizes(8) == [1, 2, 4, 8] and bucket_sizes(6) == [1, 2, 4, 6]


def test_pipeline_schedules_shrink_the_bubble():
    one, inter, zb = SCHEDULES
    assert inter.bubble(8, 1.0, 2.0, 1.0) == pytest.approx(one.bubble(8, 1.0, 2.0, 1.0) / 2)
    assert zb.bubble(8, 1.0, 2.0, 1.0) == pytest.approx(7 * 1.0 / 2)  # (F + B - 2W) / v
    assert not one.allows(2, 4, 8) and one.allows(4, 4, 8)  # 1F1B: m >= pp
    assert not inter.allows(8, 8, 8)  # 16 stages of 8 blocks
    assert not inter.allows(9, 4, 16) and inter.allows(10, 4, 16)  # m % (m // pp)
    s = search(_shapes(), 32, 1e15, dtypes=Dtypes(4, 2, 4), global_batch=64, tp=[1], pp=[4],
               shard=[8], checkpointing=(False,))
    by = {e.layout.schedule.name: e for e in s.layouts}
    assert set(by) == {x.name for x in SCHEDULES}
    for system in ("step", "fsdp2"):
        bubbles = [getattr(by[x.name], system).bubble for x in SCHEDULES]
        assert bubbles[0] > bubbles[1] > bubbles[2] > 0


def test_default_batch_is_llama3s_16m_tokens_in_whole_micro_batches(capsys):
    assert default_global_batch(8192) == 2048 and default_global_batch(4096) == 4096
    main(["plan", "--model", "llama3-8b", "--world-size", "4096", "--json", "--pp", "1"])
    out = json.loads(capsys.readouterr().out)
    assert out["global_batch"] == 2048
    for x in out["layouts"]:  # no fraction of a sequence per rank: tp x pp >= 2 here
        dp = 4096 // (x["tp"] * x["pp"])
        assert dp <= 2048 and x["micro_batches"] * dp == 2048


def test_the_table_names_what_bounds_each_step(capsys):
    """With NS made slow, Newton-Schulz bounds our step (its critical path is nearly all NS)
    and the largest term above the floor names the busiest owner's matrix; the floor is the
    step's model FLOPs over every rank."""
    shapes = _shapes()
    w = Workload(seq=8, tflops=1e12, ns_tflops=1e5)
    s = search(shapes, 8, 1e15, workload=w, global_batch=8, tp=[1], pp=[1],
               checkpointing=(False,))
    e = peers_best(s, 1e15)["matrixfsdp"]
    x = explain(e, "matrixfsdp", s.floor)
    assert x.bound == e.step.bound == "Newton-Schulz"
    assert e.step.path["Newton-Schulz"] > 0.99 * e.step.total
    assert sum(e.step.path.values()) == pytest.approx(e.step.total)
    assert x.overhead.startswith("the busiest owner's NS (layers.") and "x" in x.overhead
    assert x.over_floor == pytest.approx(e.step.total / s.floor)
    blocks, head = shapes.forward_flops_per_token(8)
    assert s.floor == pytest.approx(3 * (blocks + head) * 64 / (8 * 1e12))
    main(["plan", "--model", "llama3-8b", "--world-size", "1024"])
    text = capsys.readouterr().out
    assert "| system | its best fitting layout | step s | vs compute floor | MFU | bound by " \
        "(critical path) |" in text
    assert "x the compute floor" in text


def _constants(**kw) -> dict:
    fit = [[2, 100e-6, 1e9], [4, 300e-6, 0.5e9]]
    data = {"device": "cpu", "backend": "gloo", "ranks": 4, "coalesced": False, "launch": 0.0,
            "gemm": {"float32": [[256, 256, 256, 1e10], [1024, 1024, 1024, 2e10]]},
            "ns": {"bfloat16": [[256, 1024, 3e10]]}, "adamw_bytes_per_s": 1e9,
            "muon_bytes_per_s": 2e9, "collectives": {k: fit for k in OP_KINDS}}
    data.update(kw)
    return data


def test_calibrated_constants_drive_the_model(tmp_path, capsys):
    c = Constants.from_json(_constants())
    assert c.gemm_rate("float32", 256, 256, 256) == 1e10  # a measured shape: its own
    assert 1e10 < c.gemm_rate("float32", 512, 512, 512) < 2e10
    assert c.op("broadcast", 3).latency == pytest.approx(200e-6)  # between 2 and 4 ranks
    assert c.op("broadcast", 8).latency == pytest.approx(700e-6)  # beyond: the last slope
    g = GroupCost.of(Group(4, 1), Links(constants=c))  # inside a node, measured
    assert not g.coalesced and g.ops([("broadcast", 1e6)] * 3) == pytest.approx(3 * (300e-6 + 2e-3))
    assert GroupCost.of(Group(16, 1), Links(constants=c)).lat["broadcast"] < 300e-6  # model
    with pytest.raises(ValueError, match="missing ns"):
        Constants.from_json({k: v for k, v in _constants().items() if k != "ns"})
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_constants()))
    main(["plan", "--model", "bench-cpu", "--world-size", "4", "--seq", "256", "--micro-batch",
          "8", "--global-batch", "32", "--param-dtype", "fp32", "--constants", str(path),
          "--json"])
    out = json.loads(capsys.readouterr().out)
    assert any("measured by matrixfsdp calibrate" in a for a in out["assumptions"])
    with pytest.raises(SystemExit, match="cannot read"):
        main(["plan", "--model", "bench-cpu", "--constants", str(tmp_path / "none.json")])


def test_the_busiest_owner_s_ns_is_one_figure_under_its_label():
    """plan.md gave the busiest owner's NS as 0.825 s in the advice and 0.834 s in the
    table, both under "the busiest owner's NS": the table's figure was the whole optimizer
    step. Now the label carries the NS alone everywhere, and the optimizer step's column
    says its total and what it is made of."""
    from matrixfsdp.advisor.advice import _optimizer_term, _s, bound_rows

    shapes = _shapes()
    w = Workload(seq=8, tflops=1e12, ns_tflops=1e5)
    s = search(shapes, 8, 1e15, workload=w, global_batch=8, tp=[1], pp=[1],
               checkpointing=(False,))
    e = peers_best(s, 1e15)["matrixfsdp"]
    x = explain(e, "matrixfsdp", s.floor)
    assert x.overhead == _optimizer_term(e, "matrixfsdp") and x.bound == "Newton-Schulz"
    assert x.overhead_s == e.step.ns  # the NS alone, as the advice's bullet gives it
    row = next(r for r in bound_rows(s, 1e15) if r.startswith("| MatrixFSDP |"))
    step_cell = row.rstrip(" |").rsplit(" | ", 1)[1]
    assert step_cell == (f"{_s(e.step.ns + e.step.optimizer_other)} s: {x.overhead} {_s(e.step.ns)} s, "
                         f"the rest {_s(e.step.optimizer_other)} s"), step_cell
