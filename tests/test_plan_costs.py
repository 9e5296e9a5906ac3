"""Cluster-scale costs of a plan: memory per rank, bytes per step against FSDP2 and the
peak memory, each against a count by hand (the layout advice: test_plan_search.py)."""

from __future__ import annotations

import pytest
import torch

from matrixfsdp.__main__ import main
from matrixfsdp.planning.costs import (
    fsdp2_replica_traffic,
    fsdp2_unit_traffic,
    plan_costs,
    replica_traffic,
    step_bytes,
    unit_traffic,
)
from matrixfsdp.planning.planner import make_plan, plan_module
from matrixfsdp.planning.types import ParamSpec, Placement, Plan
from matrixfsdp.train.cluster import parse_bytes
from matrixfsdp.train.models import GPT, PRESETS

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


def test_model_state_per_rank_under_hsdp():
    """8 ranks, 4 equal matrices, shard size 2: model state of an owner and of a rank that
    owns none, by hand; at shard size 8 four shard ranks hold no matrix."""
    two = _state_spread(2)
    assert sorted(pl.owner for pl in two.placements.values() if pl.owner is not None) == [0, 1,
                                                                                          2, 3]
    c = plan_costs(two)
    # per world rank: params 8192 (emb rows) + 2 x 16384 (its shard rank's matrices) + 512;
    # owners add their matrix's gradient and momentum to the rows' gradient and AdamW state
    owner, other = 41472 + (8704 + 16384) + (16384 + 2 * 8704), 41472 + 8704 + 2 * 8704
    assert (c.state.max, c.state.mean) == (owner, (owner + other) / 2)
    assert plan_costs(_state_spread(8)).bare_shard_ranks == 4


def test_peak_memory():
    assert plan_costs(_small_plan()).peak == 752 + 712  # model state + gather buffers


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
    """The 1-D plan of 405B at 16384 ranks: the owners of the MLP weights hold the most, NS
    per step at its bound, FSDP2's padding of every k/v/norm to one row per rank costs it
    more bytes than the owner layout here."""
    with torch.device("meta"):
        net = GPT(PRESETS["llama3-405b"])
    c = plan_costs(plan_module(net, list(net.layers), 16384))
    mlp = 16384 * 53248 * 4  # bytes of the largest matrix
    assert mlp < c.params.max < mlp * 1.01 and c.params.ratio > 30
    assert c.ns.max == c.ns_bound
    assert c.bare_shard_ranks == 16384 - 882
    assert c.step.ratio < 1.0
