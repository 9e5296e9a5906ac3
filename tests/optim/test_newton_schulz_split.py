"""Newton-Schulz over slices (``tp_ownership="group"``): ``newton_schulz_split_`` run by T
threads, each on its slice of the same matrices, with an all-reduce that sums over the
threads, against ``zeropower_via_newtonschulz`` on the whole matrices (torch.optim.Muon's
NS): tall, wide and square matrices sliced along either dim, batched, and per-head blocks
sliced by columns. fp32: within fp32 rounding; bf16: within bf16's own spread."""

from __future__ import annotations

import threading

import pytest
import torch

from matrixfsdp.optim.muon import MUON_DEFAULTS
from matrixfsdp.optim.newton_schulz import newton_schulz_split_, zeropower_via_newtonschulz

NS = (MUON_DEFAULTS["ns_coefficients"], MUON_DEFAULTS["ns_steps"], MUON_DEFAULTS["eps"])


class _Group:
    """T threads' all-reduce (sum), in lockstep."""

    def __init__(self, T: int):
        self.T, self.parts, self.barrier = T, {}, threading.Barrier(T)

    def all_reduce(self, t: int, x: torch.Tensor) -> None:
        self.parts[t] = x.clone()
        self.barrier.wait()
        total = sum(self.parts[s] for s in range(self.T))
        self.barrier.wait()
        x.copy_(total)


def _split_ns(full: torch.Tensor, T: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Each of T threads runs the NS on its slice; the slices put back together."""
    group, out = _Group(T), [None] * T
    slices = full.chunk(T, dim=full.dim() - 2 + dim)
    shape = tuple(full.shape[-2:])

    def run(t: int) -> None:
        x = slices[t].to(dtype, copy=True).contiguous()
        out[t] = newton_schulz_split_(x, *NS, shape, dim, lambda a, t=t: group.all_reduce(t, a))
    threads = [threading.Thread(target=run, args=(t,)) for t in range(T)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return torch.cat(out, dim=full.dim() - 2 + dim)


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)], ids=["tall", "wide", "square"])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("batch", [None, 3])
def test_split_ns_is_whole_ns(shape, dim, batch):
    torch.manual_seed(0)
    full = torch.randn(*(() if batch is None else (batch,)), *shape)
    want = zeropower_via_newtonschulz(full, *NS, dtype=torch.float32)
    got = _split_ns(full, 4, dim, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # bf16: each slice's Gram rounded before the sum; torch's own bf16 NS moves by as much
    # between summation orders (here: against its fp32 result)
    got16 = _split_ns(full, 4, dim, torch.bfloat16).float()
    own16 = zeropower_via_newtonschulz(full, *NS).float()
    assert (got16 - want).abs().max() <= 2 * (own16 - want).abs().max() + 1e-2


def test_per_head_blocks_sliced_by_columns():
    """Per-head Muon of a matrix sliced by columns: each head's rows a matrix of its own,
    sliced like the matrix (the batch of heads over the group)."""
    torch.manual_seed(1)
    heads, rows, cols = 4, 8, 32
    full = torch.randn(heads * rows, cols)
    want = zeropower_via_newtonschulz(full.view(heads, rows, cols), *NS, dtype=torch.float32)
    got = _split_ns(full.view(heads, rows, cols), 2, 1, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
