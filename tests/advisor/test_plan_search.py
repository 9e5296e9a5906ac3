"""``matrixfsdp plan``'s layout search: the per-layout model against hand counts and the
per-rank reference, the advice rule (the fastest layout that fits, never one that does not
while one fits), the JSON, and a transformers config read from disk."""

from __future__ import annotations

import json

import pytest
from helpers.plan_shapes import GiB, gpt_shapes

from matrixfsdp.__main__ import main
from matrixfsdp.advisor.evaluated import KEYS
from matrixfsdp.advisor.model_shapes import stage_blocks, stages, tp_specs
from matrixfsdp.advisor.search import search
from matrixfsdp.costs.comm_costs import UnitComm
from matrixfsdp.costs.links import Group, GroupCost, Links, Mesh
from matrixfsdp.costs.state_costs import state_spread
from matrixfsdp.costs.steptime import simulate_pass
from matrixfsdp.layout.planner import make_plan, with_even_params
from matrixfsdp.layout.traffic import Dtypes, rank_held
from matrixfsdp.layout.units import unit_layouts
from matrixfsdp.train.models import GPTConfig


@pytest.mark.parametrize("world, shard, tp", [(8, 8, 1), (8, 4, 1), (16, 2, 1), (64, 64, 1),
                                              (8, 8, 2), (8, 4, 2), (4, 2, 4)])
def test_state_spread_is_the_per_rank_model(world, shard, tp):
    """The search's model state (difference arrays, all ranks at once) equals max and mean
    of :func:`traffic.rank_held`, rank by rank, the model tests/advisor/test_plan_model.py checks
    against 8 gloo ranks."""
    shapes = gpt_shapes()
    plan = make_plan(tp_specs(shapes, tp), world, shapes.unit_names, shard_size=shard)
    units = unit_layouts(plan, tp)
    every = [rank_held(units, w, t).total for w in range(world) for t in range(tp)]
    top, mean = state_spread(units, world // shard, shard, tp, 4)
    assert top == max(every) and mean == pytest.approx(sum(every) / len(every))


@pytest.mark.parametrize("world, shard", [(8, 8), (16, 4)])
def test_a_stage_planned_from_its_blocks_is_the_stage_planned_whole(world, shard):
    """The search plans a stage's blocks once and adds each stage's root parameters: the
    same owners, ranges and bytes as planning each stage whole (the root's rows add the same
    bytes to every rank, so the assignment cannot change)."""
    shapes = gpt_shapes()
    for st in stages(shapes.specs, shapes.unit_names, 2):
        whole = make_plan(st.specs, world, st.unit_names, shard_size=shard)
        blocks = make_plan([s for s in st.specs if s.unit], world, st.unit_names,
                           shard_size=shard)
        built = with_even_params(blocks, [s for s in st.specs if s.unit == 0])
        assert list(built.placements) == list(whole.placements)
        assert [(p.owner, p.row_ranges) for p in built.placements.values()] == \
            [(p.owner, p.row_ranges) for p in whole.placements.values()]
        assert (built.rank_bytes, built.rank_cost) == (whole.rank_bytes, whole.rank_cost)


def test_model_as_tensor_parallelism_and_stages_see_it():
    shapes = gpt_shapes()
    specs = {s.name: s for s in tp_specs(shapes, 2)}
    assert specs["layers.0.attn.k.weight"].tp == 2 and specs["layers.0.mlp.proj.weight"].tp == 2
    assert specs["embed.weight"].shape == (32, 32) and specs["head.weight"].shape == (32, 32)
    assert specs["pos.weight"].shape == (8, 32) and specs["norm.weight"].tp == 1
    assert tp_specs(shapes, 64) is None  # k: 16 x 32, neither dim split 64 ways
    assert tp_specs(shapes, 3) is None  # nor is the vocabulary (64 rows)
    assert [list(r) for r in stage_blocks(6, 4)] == [[0, 1], [2, 3], [4], [5]]
    first, *_, last = stages(shapes.specs, shapes.unit_names, 4)
    assert {s.name for s in first.specs if s.unit == 0} == {"embed.weight", "pos.weight"}
    assert {s.name for s in last.specs if s.unit == 0} == {"norm.weight", "norm.bias",
                                                           "head.weight"}
    assert first.blocks == 2 and last.blocks == 1


def test_link_model_by_hand():
    """Each op its own latency at its group's size; each launch its base; NVLink 450 GB/s
    per direction (H100)."""
    links = Links()
    node = GroupCost.of(Group(8, 1), links)  # one node: NVLink
    assert node.bw["all_gather"] == 450e9 and node.lat["all_gather"] == pytest.approx(7 * 1.9e-6)
    assert node.ring(8e9) == pytest.approx(14e-6 + 7 * 1.9e-6 + 7e9 / 450e9)
    ring = GroupCost.of(Group(64, 1), links)  # 8 nodes, 8 ranks each: 8 NICs per node
    assert ring.bw["broadcast"] == 400e9
    fill = 56 * 1.9e-6 + 7 * 4e-6  # P - 1 = 63 steps, 7 of them across nodes
    assert ring.lat["broadcast"] == ring.lat["all_gather"] == pytest.approx(fill)
    # a unit's gather: one even all-gather and three holders' broadcasts, coalesced (NCCL):
    # one launch, each op its own ring fill, the bytes added up
    ops = [("all_gather", 1e6), ("broadcast", 2e6), ("broadcast", 2e6), ("broadcast", 3e6)]
    assert ring.launches(4) == 1
    assert ring.ops(ops) == pytest.approx(14e-6 + 4 * fill + 8e6 / 400e9)
    gloo = GroupCost.of(Group(64, 1), Links(coalesced=False))  # one launch per op
    assert gloo.launches(4) == 4 and gloo.ops(ops) == pytest.approx(4 * 14e-6 + 4 * fill + 8e6 / 400e9)
    rep = GroupCost.of(Group(16, 64), links)  # one rank per node: one NIC
    assert rep.bw["all_to_all"] == 50e9
    assert rep.all_to_all(1e9) == pytest.approx(14e-6 + 4e-6 + 1e9 / 50e9)
    tiny = 1024.0  # latency-bound: the tree's log2(16) = 4 network hops beat the ring's 30
    assert rep.all_reduce(tiny) == pytest.approx(14e-6 + 2 * 4 * 4e-6 + 2 * tiny / 50e9)
    assert Mesh(2, 4, 16, 8).replicate_group == Group(4, 128)


def test_a_pass_prefetches_one_unit_ahead():
    """Root + 2 blocks, every gather 1 s and reduce 0.5 s on one link, blocks computing 2 s
    forward and 4 s backward, the root (its head, at the end) 1 s and 2 s. Forward: the
    root's gather (0-1) and block 1's, prefetched with it (1-2); block 1 computes 2-4 while
    block 2's gather runs (2-3), block 2 4-6, the head 6-7. Backward: the head 7-9, block 2
    gathered again (9-10), computes 10-14 while block 1's gather runs (10-11); block 2's
    reduce (14-14.5) under block 1's compute (14-18); block 1's reduce and the root's, at
    the end of backward (18-19)."""
    mc = Mesh(1, 1, 8, 1).costs(Links())
    units = [UnitComm(gather=1.0, reduce=0.5) for _ in range(3)]
    t = simulate_pass(units, [1.0, 2.0, 2.0], [2.0, 4.0, 4.0], mc, broadcasts=False)
    assert t == pytest.approx(19.0)
    fwd = simulate_pass(units, [1.0, 2.0, 2.0], [2.0, 4.0, 4.0], mc, False, forward_only=True)
    assert fwd == pytest.approx(7.0)


def _search(device_memory, **kw):
    cfg = GPTConfig(vocab_size=4096, d_model=1024, n_heads=16, n_kv_heads=8, n_layers=8,
                    d_mlp=2816, gated_mlp=True, seq_len=2048)
    return search(gpt_shapes(cfg), 32, device_memory, dtypes=Dtypes(4, 2, 4), **kw)


def test_the_advice_is_the_fastest_layout_that_fits():
    everything = _search(1e15)
    fastest = min(everything.layouts, key=lambda e: e.step.total)
    assert everything.recommended is fastest
    # a device just too small for the fastest layout: the advice is the fastest that fits
    # (another layout, or the same one checkpointing more blocks or keeping fewer gathered)
    tight = _search(fastest.largest_rank_bytes - 1)
    rec = tight.recommended
    assert rec.fits and rec.step.total >= fastest.step.total
    assert (rec.layout, rec.checkpointed, rec.keep) != \
        (fastest.layout, fastest.checkpointed, fastest.keep)
    assert all(rec.step.total <= e.step.total for e in tight.fitting)
    assert len(tight.layouts) == len(everything.layouts)  # searched alike, memory-aware advice
    # nothing fits: the smallest layout, said not to fit
    none = _search(1.0)
    assert not none.fitting and not none.recommended.fits
    assert none.recommended.largest_rank_bytes == min(e.largest_rank_bytes for e in none.layouts)


def test_layouts_searched_cover_replicate_shard_tp_pp():
    s = _search(1e15)
    seen = {(e.layout.replicate, e.layout.shard, e.layout.tp, e.layout.pp) for e in s.layouts}
    assert (1, 32, 1, 1) in seen and (32, 1, 1, 1) in seen and (2, 4, 4, 1) in seen
    assert (1, 4, 8, 1) in seen and (1, 8, 1, 4) in seen and (2, 2, 2, 4) in seen
    assert all(r * sh * t * p == 32 for r, sh, t, p in seen)
    assert s.global_batch == 2 ** 24 // 8192  # Llama 3's 16M tokens
    assert {e.micro_batches for e in s.layouts if e.layout.tp * e.layout.pp == 8} == \
        {s.global_batch // 4}
    restricted = _search(1e15, tp=[2], pp=[1], shard=[4])
    assert {(e.layout.replicate, e.layout.shard, e.layout.tp, e.layout.pp)
            for e in restricted.layouts} == {(4, 4, 2, 1)}


@pytest.mark.parametrize("model, world", [
    ("llama3-8b", 64), ("llama3-8b", 1024),
    # 70B's advice is checked in the suite by test_plan_placements (its target); here heavy
    pytest.param("llama3-70b", 1024, marks=pytest.mark.heavy)])
def test_json_advice_fits_is_fastest_and_on_its_floor(capsys, model, world):
    """The ``--json`` keys for the advice and every layout; the advice fits, no fitting
    layout is faster in the model, and it moves no more than FSDP2's critical-path bytes
    times the owner floor of its layout (llama3-8b at 1024 ranks: a small HSDP shard group,
    where each block's matrices must sit on distinct shard ranks to reach it)."""
    main(["plan", "--model", model, "--world-size", str(world), "--json"])
    out = json.loads(capsys.readouterr().out)
    rec, layouts = out["recommended"], out["layouts"]
    assert set(KEYS) <= set(rec) and all(set(KEYS) <= set(x) for x in layouts)
    assert len(layouts) == out["layouts_searched"] > 100
    assert rec["fits"] and rec["largest_rank_bytes"] <= rec["device_memory_bytes"] == 80 * GiB
    assert all(rec["step_seconds"] <= x["step_seconds"] for x in layouts if x["fits"])
    # (up to the pieces' alignment in a chunk: at most 15 elements each, ~1e-7 here)
    assert rec["critical_bytes_vs_fsdp2"] <= rec["owner_floor"] * (1 + 1e-6)
    assert rec["step_seconds"] < rec["fsdp2_step_seconds"]
    # NS at its bound, or (tp groups owning matrices of unequal NS, more matrices than
    # owners) within what packing whole items allows: 70B's fc and q on one owner, 1.21x
    assert rec["ns_vs_bound"] == pytest.approx(1.0, abs=0.1) or \
        (rec["tp"] > 1 and rec["ns_vs_bound"] < 1.25)
    # DistMuon: no time where torchtitan refuses it (tp > 1, pp > 1), a time elsewhere
    assert all((x["distmuon_step_seconds"] is None) == (x["tp"] > 1 or x["pp"] > 1)
               for x in layouts)
    best = out["best_per_system"]
    assert best["matrixfsdp"]["step_seconds"] == rec["step_seconds"]
    for name, key in (("fsdp2_torch_muon", "fsdp2_step_seconds"),
                      ("distmuon", "distmuon_step_seconds")):
        if best[name] is not None:  # each peer's fastest layout it can run and that fits it
            assert all(best[name][key] <= x[key] for x in layouts
                       if x[key] is not None and x[name.split("_")[0] + "_fits"])


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 2048,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_cli_plans_a_transformers_config_on_disk(tmp_path, capsys):
    pytest.importorskip("transformers")
    (tmp_path / "tiny-llama").mkdir()
    path = tmp_path / "tiny-llama" / "config.json"
    path.write_text(json.dumps(LLAMA))
    main(["plan", "--model", str(path), "--world-size", "16", "--seq", "2048", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "tiny-llama/config.json" and out["world_size"] == 16
    n = 2 * 1024 * 256 + 4 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 704 + 2 * 256) + 256
    assert out["parameters"] == n
    assert out["recommended"]["fits"] and {x["tp"] for x in out["layouts"]} == {1, 2, 4, 8}
    main(["plan", "--model", str(tmp_path / "tiny-llama"), "--world-size", "16", "--tp", "2",
          "--pp", "2"])  # the directory works too; the text names the advice
    assert "tp 2 x pp 2" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="neither a preset"):
        main(["plan", "--model", str(tmp_path / "missing.json")])
