"""Cluster-scale costs of a plan: memory per rank, bytes per step against FSDP2, the shard
size advice and the device-memory verdict, each against a count by hand."""

from __future__ import annotations

import pytest

from matrixfsdp.__main__ import main
from matrixfsdp.planning.costs import (
    fsdp2_replica_traffic,
    fsdp2_unit_traffic,
    plan_costs,
    recommend_shard_size,
    replica_traffic,
    step_bytes,
    unit_traffic,
)
from matrixfsdp.planning.planner import make_plan
from matrixfsdp.planning.report import format_costs
from matrixfsdp.planning.types import ParamSpec, Placement, Plan
from matrixfsdp.train.cluster import parse_bytes, plan_preset

GiB = 2**30


def _small_plan():
    """2 ranks, fp32: a root unit with an embedding (10, 4); one block with matrices
    a (8, 4), b (4, 8) (equal NS cost: one per rank) and a bias (5,)."""
    specs = [ParamSpec("emb", (10, 4), 4, 0, False), ParamSpec("a", (8, 4), 4, 1, True),
             ParamSpec("b", (4, 8), 4, 1, True), ParamSpec("n", (5,), 4, 1, False)]
    plan = make_plan(specs, 2, ["root", "block"])
    assert {plan.placements["a"].owner, plan.placements["b"].owner} == {0, 1}
    assert plan.placements["n"].row_ranges == [(0, 3), (3, 5)]  # rank 0 takes the extra row
    return plan


def test_step_bytes_match_a_hand_count():
    plan = _small_plan()
    block = plan.unit_params(1)
    # ours: (P-1) E + sum_o m_o = 1 x 3 (rank 0's bias rows) + 32 + 32 = 67 elements
    assert unit_traffic(block, 2) == 67 * 4
    # FSDP2: (P-1) x (ceil(8/2) x 4 + ceil(4/2) x 8 + ceil(5/2) x 1) = 35 elements
    assert fsdp2_unit_traffic(block, 2) == 35 * 4
    step = plan_costs(plan).step
    # root (20 elements, no padding): forward gather + reduce; block: two gathers + reduce
    assert step.ours == 2 * 80 + 3 * 268
    assert step.fsdp2 == 2 * 80 + 3 * 140
    assert step.ours_mean == 2 * 80 + 3 * (3 + 32) * 4  # a broadcast's mean rank: m (P-1)/P


def test_a_matrix_costs_every_rank_its_size_once_at_3_ranks():
    """3 ranks: a (6, 4) matrix owned by rank 0 and a (4,) bias split 2/1/1. The broadcast
    (reduce) of the matrix is pipelined: every rank moves its 24 elements about once,
    where an owner that sent it to each rank in turn would move (P-1) x 24."""
    w, n = ParamSpec("w", (6, 4), 4, 0, True), ParamSpec("n", (4,), 4, 0, False)
    unit = [Placement(w, 0, [(0, 6), (0, 0), (0, 0)]), Placement(n, None, [(0, 2), (2, 3), (3, 4)])]
    assert unit_traffic(unit, 3) == (2 * 2 + 24) * 4  # (P-1) E + m_0
    assert fsdp2_unit_traffic(unit, 3) == 2 * (2 * 4 + 2 * 1) * 4  # (P-1) x (ceil(6/3) x 4 + ceil(4/3))


def test_memory_matches_a_hand_count():
    c = plan_costs(_small_plan())
    # every rank stores FSDP2's padded chunks: emb 5 rows (80 B) + bias 3 rows (12 B; rank
    # 1 holds 2 of them and pads the third) + its 32-element matrix (128 B). Gradients
    # alike; optimizer: momentum 128 + AdamW 2 x the (padded) rows.
    assert (c.params.max, c.params.mean) == (220, 220)
    assert (c.grads.max, c.grads.mean) == (220, 220)
    assert (c.optim.max, c.optim.mean) == (128 + 2 * 92, 128 + 2 * 92)
    assert (c.state.max, c.state.mean) == (752, 752)
    assert c.buffers == 40 * 4 + 2 * 69 * 4  # root unit + two of the largest block
    assert c.bare_shard_ranks == 0


def test_replicate_dim_bytes_match_a_hand_count():
    """HSDP, 2 replicas x 2 shard ranks, placements written out: each shard rank stores one
    matrix (stepped by one replica) and its bias rows."""
    specs = {n: ParamSpec(n, shape, 4, 0, n != "n") for n, shape in
             (("a", (8, 4)), ("b", (4, 8)), ("n", (5,)))}
    unit = [Placement(specs["a"], 1, [(0, 0), (0, 8)]), Placement(specs["b"], 2, [(0, 4), (0, 0)]),
            Placement(specs["n"], None, [(0, 3), (3, 5)])]
    # all-reduce of the bias rows: 2 (R-1)/R x 3; reduce to + broadcast from the owner: 2 x 32
    assert replica_traffic(unit, 2, 2) == (3 + 2 * 32) * 4
    assert fsdp2_replica_traffic(unit, 2, 2) == 35 * 4  # 2 (R-1)/R x FSDP2's padded shard
    plan = Plan(4, ["root"], {pl.spec.name: pl for pl in unit}, replicas=2)
    step = step_bytes(plan)  # the root unit: one gather, one reduce, the replicate dim once
    assert step.ours == 2 * 67 * 4 + 268 and step.ours_replicate == 268
    assert step.replicate_busiest == 268  # shard rank 0: 3 + 2 x 32; shard rank 1: 2 + 2 x 32


def _state_spread(shard_size: int):
    specs = [ParamSpec("emb", (64, 64), 4, 0, False)]
    for u in range(1, 5):
        specs += [ParamSpec(f"b{u}.w", (64, 64), 4, u, True), ParamSpec(f"b{u}.n", (64,), 4, u,
                                                                          False)]
    return make_plan(specs, 8, ["root", "b1", "b2", "b3", "b4"], shard_size=shard_size)


def test_recommendation_is_the_largest_balanced_shard_size():
    """8 ranks, 4 equal matrices. Shard size 8 leaves shard ranks without a matrix; by hand,
    model state max/mean is 1.327 at 4, 1.195 at 2 (below), 1.108 at 1."""
    two = _state_spread(2)
    assert sorted(pl.owner for pl in two.placements.values() if pl.owner is not None) == [0, 1,
                                                                                          2, 3]
    c = plan_costs(two)
    # per world rank: params 8192 (emb rows) + 2 x 16384 (its shard rank's matrices) + 512;
    # owners add their matrix's gradient and momentum to the rows' gradient and AdamW state
    owner, other = 41472 + (8704 + 16384) + (16384 + 2 * 8704), 41472 + 8704 + 2 * 8704
    assert (c.state.max, c.state.mean) == (owner, (owner + other) / 2)
    assert plan_costs(_state_spread(8)).bare_shard_ranks == 4
    assert recommend_shard_size(_state_spread(8), max_ratio=1.33)[0].shard_size == 4
    assert recommend_shard_size(_state_spread(8), max_ratio=1.20)[0].shard_size == 2
    assert recommend_shard_size(_state_spread(8), max_ratio=1.11)[0].shard_size == 1
    assert recommend_shard_size(_state_spread(8), max_ratio=1.10) is None


def test_device_memory_verdict():
    c = plan_costs(_small_plan())
    assert c.peak == 752 + 712
    assert "fits in 1.4 KiB" in format_costs(c, 1464, "fp32")
    assert "**does not fit** in 1.4 KiB" in format_costs(c, 1463, "fp32")


@pytest.mark.parametrize("text, n", [("80GiB", 80 * GiB), ("80 GB", 80 * 10**9), ("1.5G", 3 * GiB // 2),
                                     ("1024", 1024)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


def test_cli_says_when_no_layout_fits(capsys):
    """405B on 16384 ranks restricted to 8 ranks per shard group, no tp, no pp: about 190 GiB
    of parameters per rank (1/8 of the model, fp32) on either side of activation
    checkpointing; the advice says no layout fits and names the smallest."""
    main(["plan", "--model", "llama3-405b", "--world-size", "16384", "--shard-size", "8",
          "--tp", "1", "--pp", "1", "--device-memory", "80GiB", "--max-rows", "2"])
    out = capsys.readouterr().out
    assert "2 layouts searched" in out and "0 fit in 80.0 GiB" in out
    assert "No layout fits; the smallest: **replicate 2048 x shard 8 x tp 1 x pp 1**" in out
    assert "activation checkpointing on" in out.split("\n")[2]


def test_llama3_405b_at_16384_ranks():
    """The 1-D plan and the recommended HSDP one at 16384 ranks (timing: the final report)."""
    cp = plan_preset("llama3-405b", 16384, None, 80 * GiB)
    c = cp.costs
    mlp = 16384 * 53248 * 4  # bytes of the largest matrix
    assert mlp < c.params.max < mlp * 1.01 and c.params.ratio > 30  # the owners of MLP weights
    assert c.ns.max == c.ns_bound  # NS per step at its bound: the largest matrix
    assert c.bare_shard_ranks == 16384 - 882
    assert c.step.ratio < 1.0  # FSDP2 pads every k/v/norm to one row per rank
    plan, rec = cp.recommended
    assert rec.shard_size == 16 and rec.state.ratio <= 1.10 and rec.bare_shard_ranks == 0
    for larger in (32, 64):  # the larger shard sizes break the 1.10 rule
        bigger = make_plan([pl.spec for pl in plan.placements.values()], 16384, plan.unit_names,
                           shard_size=larger)
        assert plan_costs(bigger).state.ratio > 1.10
    assert rec.ns.max == rec.ns_bound
    assert rec.peak > 80 * GiB and cp.fitting[1].peak <= 80 * GiB
