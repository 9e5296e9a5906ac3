"""``grouped_gloo``: gloo with NCCL's uneven all-gather and reduce-scatter, and a count of
every process-group call, so the runtime's NCCL path runs (and is counted) on CPU.

torch's ``ProcessGroupNCCL`` runs ``dist.all_gather(list, t)`` with outputs of different
sizes as one group of out-of-place broadcasts, one from each rank (``_broadcast_oop``
between ``startCoalescing`` and ``endCoalescing``), and ``dist.reduce_scatter(t, list)``
with different sizes as one group of reduces to each rank (``_reduce_oop``); equal sizes
take its flat all-gather / reduce-scatter. gloo refuses the uneven all-gather ("invalid
tensor size"). This backend is a Python ``ProcessGroup`` (registered with
``torch.distributed.Backend.register_backend``) over a ``ProcessGroupGloo`` on the same
store, that does what NCCL does: an uneven all-gather is one broadcast per rank, an
uneven reduce-scatter one reduce per rank (its inputs left as they were, as NCCL's
out-of-place reduces leave them), on the gloo group underneath; everything else is gloo's
own call. Each call to it is one *launch* (NCCL issues a coalesced group as one), counted in
:data:`LAUNCHES` by kind.

    register()
    dist.init_process_group("grouped_gloo", ...)   # every group made after: grouped_gloo too

``uneven=False`` (:func:`register`'s argument) makes it refuse uneven all-gathers as gloo
does, for the same counts on the path gloo takes.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

NAME = "grouped_gloo"
LAUNCHES: Counter = Counter()  # kind -> calls, over every group of this process
_settings = {"uneven": True}


class _Works(dist.Work):
    """Several of the inner group's works as one (a coalesced group)."""

    def __init__(self, works: list):
        super().__init__()
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class GroupedGloo(dist.ProcessGroup):
    """gloo, with NCCL's uneven all-gather / reduce-scatter and a launch count."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.me, self.n = rank, size
        # torch's C++ side (functional collectives: DTensor's own) reaches the gloo group
        # underneath; the Python calls above reach this class
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.inner)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return NAME

    # c10d names a group after making it; a Python group keeps the name itself
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    # ---- NCCL's uneven collectives ----------------------------------------------------------
    def allgather(self, output_lists, input_list, opts=None):
        outs, inp = output_lists[0], input_list[0]
        if len({o.numel() for o in outs}) == 1:
            LAUNCHES["all_gather"] += 1
            return self.inner.allgather(output_lists, input_list, opts or dist.AllgatherOptions())
        if not _settings["uneven"]:
            raise RuntimeError("ProcessGroupGloo::allgather: invalid tensor size (grouped_gloo "
                               "registered with uneven=False)")
        LAUNCHES["all_gather_v"] += 1
        works = []
        for r, out in enumerate(outs):
            if r == self.me and out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            works.append(self.inner.broadcast([out], _bcast(r)))
        return _Works(works)

    def reduce_scatter(self, output_list, input_lists, opts=None):
        out, inps = output_list[0], input_lists[0]
        opts = opts or dist.ReduceScatterOptions()
        if len({t.numel() for t in inps}) == 1:
            LAUNCHES["reduce_scatter"] += 1
            return self.inner.reduce_scatter(output_list, input_lists, opts)
        LAUNCHES["reduce_scatter_v"] += 1
        works = []
        for r, t in enumerate(inps):
            if r == self.me:
                if out.data_ptr() != t.data_ptr():
                    out.copy_(t)
                target = out
            else:
                target = t.clone()  # NCCL's out-of-place reduce leaves the input as it was
            ro = dist.ReduceOptions()
            ro.rootRank, ro.reduceOp = r, opts.reduceOp
            works.append(self.inner.reduce([target], ro))
        return _Works(works)

    # ---- everything else: gloo's own --------------------------------------------------------
    def all_gather_single(self, output, input, opts=None):
        LAUNCHES["all_gather"] += 1
        return self.inner._allgather_base(output, input, opts or dist.AllgatherOptions())

    def reduce_scatter_single(self, output, input, opts=None):
        LAUNCHES["reduce_scatter"] += 1
        return self.inner._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions())

    def broadcast(self, tensors, opts=None):
        LAUNCHES["broadcast"] += 1
        return self.inner.broadcast(tensors, opts or dist.BroadcastOptions())

    def reduce(self, tensors, opts=None):
        LAUNCHES["reduce"] += 1
        return self.inner.reduce(tensors, opts or dist.ReduceOptions())

    def allreduce(self, tensors, opts=None):
        LAUNCHES["all_reduce"] += 1
        return self.inner.allreduce(tensors, opts or dist.AllreduceOptions())

    def allreduce_coalesced(self, tensors, opts=None):
        LAUNCHES["all_reduce"] += 1
        return self.inner.allreduce_coalesced(tensors, opts or dist.AllreduceCoalescedOptions())

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        LAUNCHES["all_to_all"] += 1
        return self.inner.alltoall_base(output, input, output_split_sizes or [],
                                        input_split_sizes or [], opts or dist.AllToAllOptions())

    def alltoall(self, output_tensors, input_tensors, opts=None):
        LAUNCHES["all_to_all"] += 1
        return self.inner.alltoall(output_tensors, input_tensors, opts or dist.AllToAllOptions())

    def gather(self, output_lists, input_list, opts=None):
        LAUNCHES["gather"] += 1
        return self.inner.gather(output_lists, input_list, opts or dist.GatherOptions())

    def scatter(self, output_list, input_lists, opts=None):
        LAUNCHES["scatter"] += 1
        return self.inner.scatter(output_list, input_lists, opts or dist.ScatterOptions())

    def barrier(self, opts=None):
        LAUNCHES["barrier"] += 1
        return self.inner.barrier(opts or dist.BarrierOptions())

    def send(self, tensors, dst: int, tag: int = 0):
        LAUNCHES["send"] += 1
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int = 0):
        LAUNCHES["recv"] += 1
        return self.inner.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag: int = 0):
        LAUNCHES["recv"] += 1
        return self.inner.recv_anysource(tensors, tag)


def _bcast(root: int) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return opts


def _create(store, rank: int, size: int, timeout: timedelta) -> GroupedGloo:
    return GroupedGloo(store, rank, size, timeout)


def register(uneven: bool = True) -> None:
    """Make ``grouped_gloo`` a backend name (CPU tensors) for ``init_process_group`` /
    ``new_group``; ``uneven`` False: refuse uneven all-gathers, as gloo."""
    _settings["uneven"] = uneven
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])


def reset_launches() -> None:
    LAUNCHES.clear()



