"""No host synchronisation on the runtime's path: in forward, backward and the optimizer
step the library reads no tensor's value on the host (``.item()``, ``.tolist()``,
``bool()``, ``int()``, ``float()``, ``.cpu()``, ``.numpy()``), so on CUDA the host runs
ahead of the device. Seen by wrapping those ``torch.Tensor`` methods for the test (every
thread: backward's hooks and callbacks run in autograd's engine, where a torch-function
mode does not reach) and recording each call made from the library's own code (torch's
optimizers read their CPU step counters, which is no device synchronisation, and are not
the library's); nor does it hand the device host data (``torch.tensor(host values,
device=...)``, ``torch.as_tensor``: a pageable host-to-device copy on CUDA) or move a tensor
to the host (``.to("cpu")``). The one documented exception: a rank that had no gradient for some
parameter reads the reduced flags of every such unit, once, at the end of the backward pass."""

from __future__ import annotations

import os
import sys

import torch
from helpers.rank_pool import spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.train.models import GPT, GPTConfig

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}
MAKERS = ("tensor", "as_tensor")  # torch functions that copy host data to a tensor's device
LIBRARY = os.sep + os.path.join("src", "matrixfsdp") + os.sep


class HostReads:
    """While entered: records (phase, function, file:line) of every host read the library's
    code makes (the ``torch.Tensor`` methods in :data:`READS`, wrapped)."""

    def __init__(self):
        self.phase, self.seen, self.saved = "", [], {}

    def _record(self, what: str) -> None:
        code, line = sys._getframe(2).f_code, sys._getframe(2).f_lineno
        if LIBRARY in code.co_filename:
            self.seen.append((self.phase, code.co_name, f"{os.path.basename(code.co_filename)}:{line}",
                              what))

    def __enter__(self) -> HostReads:
        for name in READS:
            original = self.saved[name] = getattr(torch.Tensor, name)

            def recorded(t, *args, _name=name, _original=original, **kwargs):
                self._record(_name)
                return _original(t, *args, **kwargs)
            setattr(torch.Tensor, name, recorded)
        to = self.saved["to"] = torch.Tensor.to

        def moved(t, *args, **kwargs):  # .to("cpu") / .to(device="cpu"): a copy to the host
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, str) and torch.device(target).type == "cpu":
                self._record("to cpu")  # (a device variable is the tensors' own device here)
            return to(t, *args, **kwargs)
        torch.Tensor.to = moved
        for name in MAKERS:
            original = self.saved[name] = getattr(torch, name)

            def made(*args, _name=name, _original=original, **kwargs):
                if "device" in kwargs:  # host values made on a device: a host-to-device copy
                    self._record(f"torch.{_name}")
                return _original(*args, **kwargs)
            setattr(torch, name, made)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.saved.items():
            setattr(torch if name in MAKERS else torch.Tensor, name, original)


CFG = GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, d_mlp=48, seq_len=16)


def _worker(rank, world_size, shape):
    torch.manual_seed(0)
    model = GPT(CFG)
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    opt = mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=1e-3))
    reads = HostReads()
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=g)
        with reads:
            reads.phase = f"forward {step}"
            loss = model.loss(x[:, :-1], x[:, 1:])
            reads.phase = f"backward {step}"
            loss.backward()
            reads.phase = f"clip {step}"
            mf.clip_grad_norm_(model.parameters(), 1.0)
            reads.phase = f"step {step}"
            opt.step()
            opt.zero_grad()
    assert reads.seen == [], reads.seen


def test_no_host_read_in_forward_backward_clip_or_step():
    """1-D on gloo and on NCCL's path (grouped_gloo), and HSDP 2 x 2 on NCCL's path."""
    spawn(_worker, 2, (2,))
    spawn(_worker, 2, (2,), backend="grouped_gloo")
    spawn(_worker, 4, (2, 2), backend="grouped_gloo")


class Branchy(nn.Module):
    """A block whose extra layer only rank 0 uses."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, x, use_extra: bool):
        x = self.a(x)
        return self.extra(x) if use_extra else x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Branchy() for _ in range(2))

    def forward(self, x, use_extra):
        for b in self.blocks:
            x = b(x, use_extra)
        return x.square().mean()


def _branch_worker(rank, world_size):
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    reads = HostReads()
    with reads:
        reads.phase = "backward"
        model(torch.randn(4, 8), use_extra=rank == 0).backward()
    if rank == 0:  # had every gradient: knows every parameter was used
        assert reads.seen == [], reads.seen
    else:  # both units' extra layers unused here: their reduced flags, read once, at the end
        assert [(phase, fn, what) for phase, fn, _, what in reads.seen] == \
            [("backward", "attach_unused", "tolist")], reads.seen
    # used on rank 0 only: every shard here gets the average with zeros
    assert all(p.grad is not None for p in model.parameters() if p.numel())


def test_a_rank_without_a_gradient_reads_the_flags_once_and_copies_no_host_data():
    """A rank that used neither block's extra layer: no host data handed to the device for
    its flags, and one read of both units' reduced flags at the end of backward (before: a
    ``torch.tensor(flags)`` and a ``tolist()`` per unit, in the middle of backward)."""
    spawn(_branch_worker, 2, backend="grouped_gloo")
