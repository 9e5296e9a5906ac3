"""The per-operation step profile (``python -m studies.step_ops``): its timed step
is the real Muon step, it checks that itself and raises when they part, and it times every
operation of every matrix."""

from __future__ import annotations

import collections

import pytest
import torch
from helpers.cli import captured_fds
from torch import nn

import matrixfsdp as mf
from studies import step_ops


def _muon_with_grads(seed: int = 0) -> tuple[mf.Muon, dict]:
    """A plain (unsharded) Muon on a tall and a wide matrix, one step taken, fresh grads."""
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(12, 8, generator=g)), nn.Parameter(torch.randn(6, 10, generator=g))]
    opt = mf.Muon([dict(params=params, use_muon=True, lr=0.02)])
    for _ in range(2):  # the second step starts from a momentum that is not zero
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if not opt.state:
            opt.step()
    return opt, opt.param_groups[0]


def test_timed_step_is_bit_identical_to_the_real_step():
    """The split step leaves parameters and momentum bit-equal to ``Muon._muon_step`` (the
    same operations on the same data, in the same order: exact by construction)."""
    opt, group = _muon_with_grads()
    real, _ = _muon_with_grads()
    with torch.no_grad():
        step_ops._timed_muon_step(opt, group, collections.defaultdict(float))
        real._muon_step(real.param_groups[0])
    for p, q in zip(group["params"], real.param_groups[0]["params"]):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], real.state[q]["momentum_buffer"])


def test_the_check_raises_when_the_timed_step_parts_from_the_real_one(monkeypatch):
    opt, group = _muon_with_grads()
    with torch.no_grad():
        step_ops._check_same_as_real_step(opt, group)  # the real split: passes
        monkeypatch.setattr(step_ops, "adjusted_lr", lambda lr, fn, shape: 2 * lr)
        with pytest.raises(RuntimeError, match="no longer matches Muon._muon_step"):
            step_ops._check_same_as_real_step(opt, group)


def test_every_operation_is_timed_once_per_matrix(monkeypatch):
    """Each matrix adds one reading to each of its five operations (the tall one to
    ``add_tall``, the wide one to ``add_wide``): counted with a clock that ticks 1 ms per
    reading, so the sums are counts, not times."""
    ticks = iter(range(10_000))
    monkeypatch.setattr(step_ops.time, "thread_time", lambda: next(ticks) * 1e-3)
    opt, group = _muon_with_grads()
    acc: dict[str, float] = collections.defaultdict(float)
    with torch.no_grad():
        step_ops._timed_muon_step(opt, group, acc)
    assert dict(acc) == pytest.approx({"lerp_": 2, "lerp_ns_dtype": 2, "ns": 2, "mul_": 2,
                                       "add_tall": 1, "add_wide": 1})


def test_step_ops_profile_runs_end_to_end():
    """Its ``main`` in this process (the ranks it launches are separate processes)."""
    tiny = ["--layers", "1", "--d-model", "32", "--heads", "2", "--mlp", "64", "--seq", "16"]
    with captured_fds() as got:
        step_ops.main(["--ranks", "2", "--steps", "3", *tiny])
    stdout, stderr = got
    rows = [line for line in stdout.splitlines() if line.startswith(("| 0 ", "| 1 "))]
    assert len(rows) == 2 and all(row.endswith("x |") for row in rows), stdout + stderr[-4000:]
