"""What a plan costs, summed up over its ranks (``plan_costs(...).summary``): model state,
buffers, bytes per step against FSDP2, each against a count by hand, and equal to the
per-rank prediction it sums up (the layout advice: test_plan_search.py)."""

from __future__ import annotations

import pytest
import torch

from matrixfsdp.__main__ import main
from matrixfsdp.costs.summary import plan_summary
from matrixfsdp.layout.planner import make_plan, plan_module
from matrixfsdp.layout.traffic import Dtypes, predict_comm, rank_held
from matrixfsdp.layout.types import ParamSpec, Placement, Plan
from matrixfsdp.layout.units import unit_layouts
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
    step = plan_summary(_small_plan()).step
    # root: a 20-element chunk per rank (5 emb rows), ring all-gather: (P-1)/P x 40 x 4 B = 80;
    # its reduce carries one gradient flag per parameter: 21-element chunks, 84 B.
    # block: a chunk is the bias rows (3, padded), aligned to 16, then the rank's matrix
    # (32): 48 elements (the reduce's 3 flags fit in the same 16), one even call of 96: 192 B.
    # A step: root gather + reduce, block two gathers + reduce.
    assert step.ours == 80 + 84 + 3 * 192
    # FSDP2: (P-1) x (ceil(8/2) x 4 + ceil(4/2) x 8 + ceil(5/2) x 1) = 35 elements a call
    assert step.fsdp2 == 2 * 80 + 3 * 35 * 4
    assert step.ours_replicate == step.fsdp2_replicate == 0


def test_a_matrix_crosses_once_at_3_ranks():
    """3 ranks: a (6, 4) matrix held by rank 0 and a (4,) bias split 2/1/1, one unit. The
    even parts travel in a ring all-gather ((P-1)/P of 3 x 2 elements), the matrix in one
    pipelined broadcast from its owner: its most loaded rank moves it once, where an owner
    that sent it to each rank in turn would move (P-1) x 24."""
    w, n = ParamSpec("w", (6, 4), 4, 0, True), ParamSpec("n", (4,), 4, 0, False)
    unit = [Placement(w, 0, [(0, 6), (0, 0), (0, 0)]), Placement(n, None, [(0, 2), (2, 3), (3, 4)])]
    step = plan_summary(Plan(3, ["root"], {pl.spec.name: pl for pl in unit})).step
    gather = 2 * 2 + 24  # (P-1)/P of the 3 x 2 bias rows, then the matrix once
    reduce = 2 * 4 + 24  # the same with 2 flags after the bias rows
    assert step.ours == (gather + reduce) * 4
    assert step.fsdp2 == 2 * 2 * (2 * 4 + 2 * 1) * 4  # (P-1) x (ceil(6/3) x 4 + ceil(4/3))


def test_model_state_and_buffers_match_a_hand_count():
    c = plan_summary(_small_plan())
    # per rank (elements): storage 20 (emb chunk) + 48 (bias chunk, aligned, its matrix);
    # gradients: the reduce segments, 21 + 48; optimizer: momentum 32 + AdamW 2 x its rows
    # (rank 0: 5 emb + 3 bias rows; rank 1: 5 + 2)
    rank0, rank1 = 68 + 69 + 32 + 2 * 23, 68 + 69 + 32 + 2 * 22
    assert (c.state.max, c.state.mean) == (rank0 * 4, (rank0 + rank1) * 4 / 2)
    # FSDP2's padded shards, each with its gradient and optimizer state: emb 20 and bias 3
    # elements x 4 (AdamW's two moments), the matrices' 16 + 16 x 3 (Muon's momentum)
    assert c.fsdp2_state == (4 * 20 + 4 * 3 + 3 * 32) * 4
    # the root's even parameters copied out of its gathered buffer (40); a block's buffer
    # (96, its matrices are views of it) and copied bias (6), three gathered, two reduces
    assert c.buffers == 40 * 4 + 3 * 102 * 4 + 2 * 102 * 4
    assert c.peak == c.state.max + c.buffers
    assert c.bare_shard_ranks == 0


def test_replicate_dim_bytes_match_a_hand_count():
    """HSDP, 2 replicas x 2 shard ranks, placements written out: each shard rank stores one
    matrix (stepped by one replica) and its bias rows."""
    specs = {n: ParamSpec(n, shape, 4, 0, n != "n") for n, shape in
             (("a", (8, 4)), ("b", (4, 8)), ("n", (5,)))}
    unit = [Placement(specs["a"], 1, [(0, 0), (0, 8)]), Placement(specs["b"], 2, [(0, 4), (0, 0)]),
            Placement(specs["n"], None, [(0, 3), (3, 5)])]
    step = plan_summary(Plan(4, ["root"], {pl.spec.name: pl for pl in unit}, replicas=2)).step
    # the root unit: one gather and one reduce over the shard group (48-element chunks:
    # 192 B each), then across replicas: the all-reduce of the reduced head (3 bias rows, 3
    # flags: 2 (R-1)/R x 24 B), the matrix's run to its replica (alignment and matrix:
    # 10 + 32 elements) and, after the step, its run back (13 + 32)
    assert step.ours_replicate == 24 + 42 * 4 + 45 * 4
    assert step.ours == 2 * 192 + step.ours_replicate
    assert step.fsdp2_replicate == 35 * 4  # 2 (R-1)/R x FSDP2's padded shard
    assert step.fsdp2 == 2 * 35 * 4 + step.fsdp2_replicate


def _state_spread(shard_size: int):
    specs = [ParamSpec("emb", (64, 64), 4, 0, False)]
    for u in range(1, 5):
        specs += [ParamSpec(f"b{u}.w", (64, 64), 4, u, True), ParamSpec(f"b{u}.n", (64,), 4, u,
                                                                          False)]
    return make_plan(specs, 8, ["root", "b1", "b2", "b3", "b4"], shard_size=shard_size)


@pytest.mark.parametrize("shard_size", [8, 2])
def test_the_summary_sums_up_the_per_rank_prediction(shard_size):
    """The model state is every rank's holdings, the bytes per step every rank's
    collectives on NCCL (bf16 gathers, two micro-batches): 1-D, each collective's most
    loaded rank is every rank's; HSDP, the busiest shard rank differs by unit, so the
    step's critical path (their sum) is at least any one rank's."""
    plan, d = _state_spread(shard_size), Dtypes(4, 2, 4)
    c = plan_summary(plan, d, micro_batches=2)
    held = [rank_held(unit_layouts(plan), w, 0, d).total for w in range(8)]
    assert (c.state.max, c.state.mean) == (max(held), sum(held) / 8)
    per_rank = [sum(k["critical_bytes"] for k in comm.values())
                for comm in predict_comm(plan, d, micro_batches=2)]
    if shard_size == 8:
        assert c.step.ours == max(per_rank) == min(per_rank)
        assert c.bare_shard_ranks == 4  # 4 matrices on 8 shard ranks
    else:
        assert c.step.ours >= max(per_rank) > c.step.ours - c.step.ours_replicate
        owners = sorted(pl.owner for pl in plan.placements.values() if pl.owner is not None)
        assert owners == [0, 1, 2, 3] and c.bare_shard_ranks == 0


@pytest.mark.parametrize("text, n", [("80GiB", 80 * GiB), ("80 GB", 80 * 10**9), ("1.5G", 3 * GiB // 2),
                                     ("1024", 1024)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


def test_cli_says_when_no_layout_fits(capsys):
    """405B on 16384 ranks restricted to 8 ranks per shard group, no tp, no pp: about 190 GiB
    of parameters per rank (1/8 of the model, fp32), even with every block checkpointed (the
    search checkpoints the fewest blocks that fit, all where none fit); the advice says no
    layout fits and names the smallest."""
    main(["plan", "--model", "llama3-405b", "--world-size", "16384", "--shard-size", "8",
          "--tp", "1", "--pp", "1", "--device-memory", "80GiB", "--max-rows", "2"])
    assert "2048 sequences per step do not split into whole micro-batches of 1" \
        in capsys.readouterr().out  # Llama 3's 16M tokens: fewer sequences than ranks
    main(["plan", "--model", "llama3-405b", "--world-size", "16384", "--shard-size", "8",
          "--tp", "1", "--pp", "1", "--device-memory", "80GiB", "--max-rows", "2",
          "--global-batch", "16384"])
    out = capsys.readouterr().out
    assert "1 layouts searched" in out and "0 fit in 80.0 GiB" in out
    assert "No layout fits; the smallest: **replicate 2048 x shard 8 x tp 1 x pp 1**" in out
    assert "activation checkpointing 126 of 126 blocks" in out.split("\n")[2]


def test_llama3_405b_at_16384_ranks():
    """The 1-D plan of 405B at 16384 ranks: the owners of the MLP weights hold the most (the
    matrix, its gradient and momentum), NS per step at its bound, FSDP2's padding of every
    k/v/norm to one row per rank costs it more bytes than the owner layout here."""
    with torch.device("meta"):
        net = GPT(PRESETS["llama3-405b"])
    c = plan_summary(plan_module(net, list(net.layers), 16384))
    mlp = 16384 * 53248 * 4  # bytes of the largest matrix
    assert 3 * mlp < c.state.max < 3 * mlp * 1.01 and c.state.ratio > 30
    assert c.ns.max == c.ns_bound
    assert c.bare_shard_ranks == 16384 - 882
    assert c.step.ratio < 1.0
