"""The planner: classification, whole-matrix owners, balance against the lower bound."""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
from helpers.rank_pool import spawn

import matrixfsdp as mf
from matrixfsdp.layout.planner import make_plan, ns_flops, plan_module
from matrixfsdp.layout.report import format_report
from matrixfsdp.layout.types import ParamSpec
from matrixfsdp.layout.units import calls, unit_layout
from matrixfsdp.train.models import GPT, PRESETS, GPTConfig


def _meta_plan(cfg, world_size, **kw):
    with torch.device("meta"):
        model = GPT(cfg)
    return plan_module(model, list(model.layers), world_size, **kw)


def test_ns_flops_counts_the_wide_orientation():
    # 5 steps x (X X^T: 2*a*a*b, B = bA + cA^2: 2*a^3, B X: 2*a*a*b), a = min, b = max
    assert ns_flops((64, 256)) == ns_flops((256, 64)) == 5 * (4 * 64 * 64 * 256 + 2 * 64**3)


def test_default_classification():
    plan = _meta_plan(GPTConfig(d_model=32, n_heads=2, n_layers=2, d_mlp=64, seq_len=8), 4)
    muon = {n for n, pl in plan.placements.items() if pl.spec.muon}
    assert muon == {f"layers.{i}.{m}.weight" for i in range(2)
                    for m in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc", "mlp.proj")}
    for name in ("embed.weight", "pos.weight", "head.weight", "norm.weight", "layers.0.norm1.bias"):
        assert plan.placements[name].owner is None  # AdamW, even rows over all ranks


def test_muon_filter_overrides():
    plan = _meta_plan(GPTConfig(d_model=32, n_heads=2, n_layers=1, d_mlp=64, seq_len=8), 2,
                      muon_filter=lambda n, p: n == "head.weight")
    assert [n for n, pl in plan.placements.items() if pl.spec.muon] == ["head.weight"]


def test_bench_config_is_perfectly_balanced():
    # 8 blocks x (4 attention 384x384 + 2 MLP 384x1536) over 4 ranks: total/P is reachable.
    plan = _meta_plan(GPTConfig(), 4)
    assert plan.imbalance == plan.imbalance_bound == 1.0


def test_global_planning_leaves_no_rank_idle_at_8_ranks():
    # 7 matrices per block (Llama: q, k, v, o, w1, w2, w3) and 8 ranks: per-block planning
    # would leave a rank idle in every block; planned together, every rank owns matrices.
    cfg = GPTConfig(d_model=256, n_heads=4, n_kv_heads=2, n_layers=8, d_mlp=704, gated_mlp=True)
    plan = _meta_plan(cfg, 8)
    assert all(c > 0 for c in plan.rank_cost)
    assert plan.imbalance <= 1.10
    assert plan.imbalance <= plan.imbalance_bound * 1.05


def test_fewer_matrices_than_ranks_hits_the_bound():
    specs = [ParamSpec(f"m{i}", (64 * (i + 1), 64), 4, 0, True) for i in range(5)]
    plan = make_plan(specs, 8, ["u"])
    assert plan.imbalance == plan.imbalance_bound  # the largest matrix alone sets the max
    assert len({pl.owner for pl in plan.placements.values()}) == 5  # one matrix per rank


def _optimum(costs: list[int], world: int) -> int:
    """The smallest largest-rank load of any assignment (brute force; item 0 on rank 0
    without loss of generality)."""
    best = sum(costs)
    for rest in itertools.product(range(world), repeat=len(costs) - 1):
        load = [0] * world
        load[0] = costs[0]
        for c, r in zip(costs[1:], rest):
            load[r] += c
        best = min(best, max(load))
    return best


@pytest.mark.parametrize("world,n", [(2, 10), (3, 8), (4, 7), (5, 7)])
def test_owners_are_within_two_percent_of_the_brute_force_optimum(world, n):
    """The largest per-rank NS cost of the owners the plan chose (recomputed from the
    placements) is within 2% of the best of all world**n assignments, and never below it.
    Integer costs and a deterministic planner: the same on every machine. Measured: optimal
    in 16 of 20 cases, 1.03% above in the worst; round-robin owners are 7.5-50% above in
    the worst case of each size, so a planner that stops balancing fails."""
    g = torch.Generator().manual_seed(world)
    for _ in range(5):
        shapes = torch.randint(16, 512, (n, 2), generator=g).tolist()
        specs = [ParamSpec(f"m{i}", tuple(s), 4, i % 2, True) for i, s in enumerate(shapes)]
        plan = make_plan(specs, world, ["a", "b"])
        load = [0] * world
        for pl in plan.placements.values():
            load[pl.owner] += ns_flops(pl.spec.shape)
        best = _optimum([ns_flops(tuple(s)) for s in shapes], world)
        assert load == plan.rank_cost
        assert best <= max(load) <= best * 1.02, (world, shapes, max(load) / best)


def test_imbalance_stays_close_to_the_lower_bound_at_scale():
    """40 matrices (too many to brute-force): within 5% of max(largest, total / P)."""
    g = torch.Generator().manual_seed(0)
    for world in (2, 3, 5, 8, 16):
        shapes = torch.randint(16, 512, (40, 2), generator=g).tolist()
        specs = [ParamSpec(f"m{i}", tuple(s), 4, i % 4, True) for i, s in enumerate(shapes)]
        plan = make_plan(specs, world, ["a", "b", "c", "d"])
        assert plan.imbalance <= plan.imbalance_bound * 1.05, (world, plan.imbalance)


@pytest.mark.parametrize("world, shard", [(64, 32), (64, 8), (1024, 4)])
def test_hsdp_spreads_each_block_over_its_shard_ranks(world, shard):
    """HSDP: the replicate dim's reduce and broadcast at a shard rank carry every matrix it
    stores, so a block's matrices at one shard rank stay within its largest (the owner
    floor, reachable here), while NS stays at its optimum (96 MLP matrices over 64 ranks: two
    on some; one at 1024 ranks). With ranks to spare, a block's matrices at one shard rank
    share one owner (one reduce and one broadcast, not one per matrix)."""
    cfg = GPTConfig(d_model=64, n_heads=4, n_kv_heads=1, n_layers=32, d_mlp=224,
                    gated_mlp=True)  # Llama's shapes: q, o 64 x 64; k, v 16 x 64; MLP 224 x 64
    plan = _meta_plan(cfg, world, shard_size=shard)
    held: dict[tuple[int, int], int] = collections.defaultdict(int)
    owners: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    for pl in plan.placements.values():
        if pl.owner is not None:
            held[(pl.spec.unit, pl.owner_shard)] += pl.spec.numel
            owners[(pl.spec.unit, pl.owner_shard)].add(pl.owner)
    assert max(held.values()) == 224 * 64
    assert max(plan.rank_cost) == ns_flops((224, 64)) * (2 if world == 64 else 1)
    if world == 1024:
        assert all(len(o) == 1 for o in owners.values())


def test_even_rows_are_fsdp2_chunks_padded_alike_on_every_rank():
    """Even parameters split as FSDP2's Shard(0): ceil(rows / P)-row chunks, the last ranks'
    short or empty; every rank stores each chunk padded, so the even part is one size."""
    specs = [ParamSpec(f"b{i}", (5,), 4, 0, False) for i in range(8)]
    plan = make_plan(specs, 4, ["u"])
    assert all(pl.row_ranges == [(0, 2), (2, 4), (4, 5), (5, 5)] for pl in plan.placements.values())
    lay = unit_layout(plan, 0)
    assert lay.even_numel == 8 * 2 and [lay.segment(r).size for r in range(4)] == [16] * 4
    assert plan.rank_bytes == [16 * 4] * 4
    # equal chunks: one even all-gather / reduce-scatter, on any process group
    assert [c.kind for c in calls(lay, False)] == ["all_gather"]


def test_layout_pieces_are_whole_matrices_on_their_owners():
    """The even part (7 rows over 3 ranks: chunks of 3) first, then each whole matrix on
    its owner, 64-byte aligned in its chunk, in the gathered buffer and in storage; a
    reduce's chunks carry one flag per parameter after the even part. Uneven chunks: an even
    call of the even parts and one per holder (its region), one launch where the group
    coalesces; the gathered buffer holds the holders' regions alone."""
    specs = [ParamSpec("w", (6, 5), 4, 0, True), ParamSpec("b", (7,), 4, 0, False),
             ParamSpec("v", (3, 4), 4, 0, True)]
    plan = make_plan(specs, 3, ["u"])
    lay = unit_layout(plan, 0)
    assert lay.rows == [1] and lay.chunk[1] == 3 and lay.even_numel == 3
    assert sorted((pc.index, pc.numel) for pc in lay.pieces) == [(0, 30), (2, 12)]
    for pc in lay.pieces:
        assert pc.rank == plan.placements[specs[pc.index].name].owner
        assert pc.offset % 16 == 0 and pc.offset >= lay.even_numel
        assert lay.whole_offset(pc.index) % 16 == 0
        assert lay.segment(pc.rank).offsets[pc.index] == pc.offset  # the chunk is the segment
    assert lay.chunk_total == 3 * 3 + 13 * len(lay.holders) + 30 + 12
    holders = lay.holders
    regions = [lay.region(h) for h in holders]
    assert lay.gathered_numel < lay.chunk_total  # no even part in it: that goes to a transient
    assert lay.gathered_numel >= sum(n for _, n in regions)
    for h, (first, n) in zip(holders, regions):
        assert (lay.base(h) + first) % 16 == 0 and first + n == lay.chunk_size(h)
    assert [(c.kind, c.root) for c in calls(lay, False)] == \
        [("all_gather", None)] + [("broadcast", h) for h in holders]
    assert [c.kind for c in calls(lay, True)] == ["reduce_scatter"] + ["reduce"] * len(holders)
    red, index = lay.reduce_layout((True, True, True))
    assert index == [0, 1, 2] and red.flags == 3 and red.head == 3 + 3
    assert all(pc.offset >= red.head and pc.offset % 16 == 0 for pc in red.pieces)


def test_report_is_readable():
    plan = _meta_plan(GPTConfig(d_model=32, n_heads=2, n_layers=2, d_mlp=64, seq_len=8), 3)
    text = format_report(plan)
    assert "| rank | matrices |" in text and "lower bound" in text
    assert text.count("\n| ") >= 4  # header plus one row per rank


def test_llama3_405b_plans_on_meta_at_4096_ranks():
    plan = _meta_plan(PRESETS["llama3-405b"], 4096)
    assert sum(pl.spec.muon for pl in plan.placements.values()) == 126 * 7
    assert plan.imbalance <= plan.imbalance_bound * 1.0001  # fewer matrices than ranks


TIED = GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, d_mlp=64, seq_len=8)


def _tied_gpt() -> GPT:
    model = GPT(TIED)
    model.head.weight = model.embed.weight  # one tensor at two places of the root unit
    return model


def _where(plan):
    return [(n, pl.spec, pl.owner, pl.row_ranges) for n, pl in plan.placements.items()], \
        plan.rank_bytes, plan.rank_cost


def _tied_plans_agree(rank, world):
    torch.manual_seed(0)
    model = _tied_gpt()
    for block in model.layers:
        mf.fully_shard(block)
    mf.fully_shard(model)
    with torch.device("meta"):
        meta = _tied_gpt()
    planned = plan_module(meta, list(meta.layers), world)  # the CLI's and the bench's path
    assert "head.weight" not in planned.placements  # planned once, under its first name
    assert _where(planned) == _where(mf.plan_of(model))


def test_tied_head_plans_once_as_fully_shard_does():
    """``matrixfsdp plan`` / the bench (``plan_module``) and training (``fully_shard``) plan
    a tied head alike: once, so rank bytes and owners match at 2 ranks."""
    spawn(_tied_plans_agree, 2)
