"""Overlap, checked by what it does rather than by a clock (these cores are shared): with
overlap on, every gather after a unit's first is already in flight when its unit needs it
(prefetched), reduces stay in flight while the next unit's backward runs, and under HSDP
every unit's broadcast travels at once from the start of forward and the replicate-dim
reduces are still in flight when backward ends; with overlap off, none of this happens.
Overlap changes no number: the parameters are bit-identical either way. The time it hides
under a modelled link is measured by ``matrixfsdp bench --link`` (docs/benchmarks.md)."""

from __future__ import annotations

import os

import torch
from helpers.rank_pool import spawn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.train.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=4, d_mlp=64, seq_len=16)
STEPS = 3


def _run(rank, overlap, mesh_shape, dims):
    """What overlap did in the last step, and the final parameters."""
    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=dims)
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh, overlap=overlap)
    opt = mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=3e-3))
    root = mf.get_root(model)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):  # the first step records the order the later ones prefetch in
        x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=g)
        root.schedule.counts = dict.fromkeys(root.schedule.counts, 0)
        root.replication.max_inflight = 0
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    counts = dict(root.schedule.counts, broadcasts_in_flight=root.replication.max_inflight)
    return counts, mf.full_state_dict(model)


def _worker(rank, world_size, out_dir, mesh_shape, dims):
    out = {overlap: _run(rank, overlap, mesh_shape, dims) for overlap in (True, False)}
    if rank == 0:
        torch.save(out, os.path.join(out_dir, "overlap.pt"))


def _same_numbers(r):
    for n, p in r[False][1].items():
        assert torch.equal(r[True][1][n], p), n


def test_overlap_prefetches_and_defers_and_changes_no_number(tmp_path):
    spawn(_worker, 2, str(tmp_path), (2,), None)
    r = torch.load(tmp_path / "overlap.pt")
    on, off = r[True][0], r[False][0]
    print(f"overlap on: {on}; off: {off}")
    blocks = CFG.n_layers
    # forward: every block is prefetched by the unit before it (root, block 0, ...);
    # backward: every block but the last one run is prefetched by the block after it
    assert on["prefetched"] == blocks + (blocks - 1), on
    assert on["deferred_reduces"] >= blocks, on  # each reduce left in flight for the next
    assert off["prefetched"] == 0 and off["deferred_reduces"] == 0, off
    _same_numbers(r)


def test_hsdp_replicate_dim_collectives_overlap_and_change_no_number(tmp_path):
    # A (2, 1) mesh: the shard groups have one rank, so every collective that leaves a rank
    # crosses the replicate dim (reduces in backward, broadcasts in the next forward).
    spawn(_worker, 2, str(tmp_path), (2, 1), ("replicate", "shard"))
    r = torch.load(tmp_path / "overlap.pt")
    on, off = r[True][0], r[False][0]
    print(f"overlap on: {on}; off: {off}")
    # on: every block's broadcast travels at once from the start of forward, and the
    # replicate-dim reduces are still in flight when backward ends (waited there);
    # off: one broadcast at a time, at its unit's gather, each reduce finished at once
    assert on["broadcasts_in_flight"] >= CFG.n_layers, on
    assert on["deferred_follow_ups"] >= 1, on
    assert off["broadcasts_in_flight"] == 1 and off["deferred_follow_ups"] == 0, off
    _same_numbers(r)
