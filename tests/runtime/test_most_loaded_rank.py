"""No rank carries P times its share: at 8 ranks, with 2 matrices per block (more ranks than
matrices), every unit's gather and reduce put on their most loaded rank at most
``1.05 x P/(P-1)`` times what FSDP2's collectives do for the same unit, and no tensor handed
to a collective is larger than FSDP2's for that unit.

What each rank sends and receives is recorded by wrapping torch.distributed's collective
functions in the rank's process (so it sees FSDP2's calls and ours alike) and charged by
NCCL's algorithms, written out here independently of matrixfsdp.runtime.collectives: ring all-gather /
reduce-scatter ``(P-1)/P`` of the buffer per rank, ring all-reduce twice that, pipelined
broadcast / reduce the buffer once (the root only sends, or only receives)."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
from helpers.rank_pool import spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.runtime.storage import UnitStorage

P = 8
D, HIDDEN, VOCAB, BLOCKS = 64, 256, 64, 4  # every dim divisible by 8: FSDP2 pads nothing


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _nbytes(t):
    return t.numel() * t.element_size()


_OPS = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
        "reduce_scatter_tensor", "broadcast", "reduce", "all_reduce")


@contextmanager
def recording(calls: list, tag: list):
    """Wrap torch.distributed's collectives: each call appends (tag, op, bytes, group size,
    this rank in the group, root in the group)."""
    saved = {name: getattr(dist, name) for name in _OPS if hasattr(dist, name)}

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            size, me = dist.get_world_size(group), dist.get_rank(group)
            root = kwargs.get("group_src", kwargs.get("group_dst"))
            if root is None and name in ("broadcast", "reduce"):
                root = dist.get_group_rank(group or dist.group.WORLD, args[1] if len(args) > 1
                                           else kwargs.get("src", kwargs.get("dst")))
            # the buffer: the all-gather's output, the reduce-scatter's input, else the tensor
            n = max(_nbytes(t) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
            calls.append((tag[0], name, n, size, me, root))
            return fn(*args, **kwargs)
        return recorded
    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def charge(op, n, size, me, root):
    """(sent, received) of rank ``me`` under NCCL's algorithms."""
    if size == 1:
        return 0, 0
    if op.startswith(("all_gather", "reduce_scatter")):
        return n * (size - 1) // size, n * (size - 1) // size
    if op == "all_reduce":
        return 2 * n * (size - 1) // size, 2 * n * (size - 1) // size
    toward = op == "reduce"  # a pipeline along the ring from (or to) the root
    first = (root + 1) % size if toward else root
    last = root if toward else (root - 1) % size
    return (0 if me == last else n), (0 if me == first else n)


def _ours(rank, calls, tag):
    torch.manual_seed(0)
    model = Model()
    mesh = init_device_mesh("cpu", (P,))
    for b in model.blocks:
        mf.fully_shard(b, mesh=mesh)
    mf.fully_shard(model, mesh=mesh, overlap=False)  # one unit's collectives at a time
    start_unshard, start_reduce = UnitStorage.start_unshard, UnitStorage.start_reduce
    names = {id(u.storage): u.name for u in mf.get_root(model).units}
    seen: dict = {}

    def set_tag(storage, phase):  # (unit, phase, how many times before: forward 0, backward 1)
        key = (names[id(storage)], phase)
        tag[0] = (*key, seen.get(key, 0))
        seen[key] = seen.get(key, 0) + 1

    def unshard(self, comm):
        set_tag(self, "gather")
        return start_unshard(self, comm)

    def reduce(self, comm, grads, trainable, *rest):
        set_tag(self, "reduce")
        return start_reduce(self, comm, grads, trainable, *rest)
    UnitStorage.start_unshard, UnitStorage.start_reduce = unshard, reduce
    try:
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
        with recording(calls, tag):
            model(ids).sum().backward()
    finally:
        UnitStorage.start_unshard, UnitStorage.start_reduce = start_unshard, start_reduce


def _fsdp2(rank, calls, tag):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model()
    mesh = init_device_mesh("cpu", (P,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    tag[0] = ("fsdp2", "")
    with recording(calls, tag):
        model(ids).sum().backward()


def _worker(rank, world_size, out_dir):
    ours, fsdp2 = [], []
    _ours(rank, ours, [None])
    _fsdp2(rank, fsdp2, [None])
    every = [None] * world_size
    dist.all_gather_object(every, (ours, fsdp2))
    if rank == 0:
        torch.save(every, os.path.join(out_dir, "calls.pt"))


def _critical(per_rank_calls):
    """Per call (in issue order, the same on every rank): its tag, op, buffer bytes, and the
    most loaded rank's max(sent, received)."""
    out = []
    for same in zip(*per_rank_calls):
        tag, op, n, size, _, root = same[0]
        load = max(max(charge(op, n, size, me, root)) for (_, _, _, _, me, _) in same)
        out.append((tag, op, n, load))
    return out


def test_most_loaded_rank_moves_its_fair_share_at_8_ranks(tmp_path):
    spawn(_worker, P, str(tmp_path))
    every = torch.load(tmp_path / "calls.pt")
    ours = _critical([e[0] for e in every])
    fsdp2 = _critical([e[1] for e in every])
    # FSDP2: one all-gather per unit gather (forward: root, blocks in order; backward:
    # blocks in reverse), one reduce-scatter per unit reduce (blocks in reverse, root last)
    fs_gathers = [c for c in fsdp2 if c[1].startswith("all_gather")]
    fs_reduces = [c for c in fsdp2 if c[1].startswith("reduce_scatter")]
    assert len(fs_gathers) == 1 + 2 * BLOCKS and len(fs_reduces) == 1 + BLOCKS
    fs_unit = {("<root>", "gather", 0): fs_gathers[0], ("<root>", "reduce", 0): fs_reduces[-1]}
    for i in range(BLOCKS):
        fs_unit[(f"blocks.{i}", "gather", 0)] = fs_gathers[1 + i]
        fs_unit[(f"blocks.{i}", "gather", 1)] = fs_gathers[2 * BLOCKS - i]
        fs_unit[(f"blocks.{i}", "reduce", 0)] = fs_reduces[BLOCKS - 1 - i]
    floor = 1.05 * P / (P - 1)
    groups: dict = {}
    for tag, op, n, load in ours:
        g = groups.setdefault(tag, [0, 0, 0, []])  # critical bytes, buffer bytes, calls, ops
        g[0] += load
        g[1] += n
        g[2] += 1
        g[3].append(op)
    worst = 0.0
    # a reduce's chunks carry one flag per parameter of the unit (fp32: whether the rank had
    # a gradient for it), so its buffers hold P flags per parameter more than FSDP2's
    params = {"<root>": 2, **{f"blocks.{i}": 4 for i in range(BLOCKS)}}
    assert set(groups) == set(fs_unit), (sorted(groups), sorted(fs_unit))
    for (unit, phase, k), (load, buffered, _, ops) in groups.items():
        ref = fs_unit[(unit, phase, k)]
        ratio = load / ref[3]
        worst = max(worst, ratio)
        print(f"{unit:10s} {phase:6s} ours {load:7d} B on the most loaded rank ({len(ops)} calls) "
              f"vs FSDP2 {ref[3]:7d} B: {ratio:.3f}x; buffers {buffered} vs {ref[2]} B")
        assert ratio <= floor, (unit, phase, load, ref[3], ops)
        # (b) no tensor larger than FSDP2's for the unit; together no more than its buffer
        flags = P * params[unit] * 4 if phase == "reduce" else 0
        assert max(n for t, _, n, _ in ours if t == (unit, phase, k)) <= ref[2] + flags
        assert buffered <= ref[2] + flags, (unit, phase, buffered, ref[2])
    print(f"worst unit: {worst:.3f}x FSDP2 (bound {floor:.3f}x)")
    # the step's sum over collectives: the critical path
    total = sum(c[3] for c in ours) / sum(c[3] for c in fsdp2)
    print(f"critical path over the step: {total:.3f}x FSDP2's")
    assert total <= floor
