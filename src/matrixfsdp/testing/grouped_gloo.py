"""``grouped_gloo``: gloo with NCCL's coalescing, a count of every launch and op, and
optionally a modelled link, so the runtime's NCCL path runs (and is counted and timed) on
CPU, wrapped around the process group from outside the runtime.

torch's ``ProcessGroupNCCL`` runs the collectives issued between ``_start_coalescing`` and
``_end_coalescing`` as one NCCL group: one launch, one work. gloo refuses to ("does not
implement startCoalescing"). This backend is a Python ``ProcessGroup`` (registered with
``torch.distributed.Backend.register_backend``) over a ``ProcessGroupGloo`` on the same
store that does what NCCL does: the ops of a coalesced group go to gloo one by one and come
back as one work; everything else is gloo's own call. :data:`matrixfsdp.testing.COUNTS`
counts launches by kind (a coalesced group is one, ``coalesced``) and every op inside them.

    from matrixfsdp import testing
    testing.register("grouped_gloo")
    dist.init_process_group("grouped_gloo", ...)   # every group made after: grouped_gloo too

``testing.register("grouped_gloo", coalesce=False)`` makes it refuse coalescing as gloo does
(gloo's path, counted alike); ``link=Link(...)``: every launch of the groups made after completes no
earlier than its launch latency plus its most loaded rank's bytes (NCCL's algorithms,
:func:`~matrixfsdp.layout.loads.op_load`) over the link, one transfer after the other
on each rank (``benchmarks/parallel/link.py``).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..layout.loads import op_load
from .counts import COUNTS

SETTINGS: dict = {"coalesce": True, "link": None}  # of the groups made next (testing.register)


class Link:
    """One rank's network link: transfers one after the other, each ``latency_s`` (the
    launch) plus its bytes at ``bytes_per_s``; ``charged``: the bytes put on it."""

    def __init__(self, bytes_per_s: float, latency_s: float = 0.0):
        self.bytes_per_s, self.latency_s = bytes_per_s, latency_s
        self._free = 0.0
        self.charged = 0

    def ready_at(self, nbytes: int) -> float:
        start = max(time.perf_counter(), self._free)
        self._free = start + self.latency_s + nbytes / self.bytes_per_s
        self.charged += nbytes
        return self._free


class _Works(dist.Work):
    """Several of the inner group's works as one (a coalesced group), done no earlier than
    ``ready_at`` (``time.perf_counter()``; 0: at once)."""

    def __init__(self, works: list, ready_at: float = 0.0):
        super().__init__()
        self.works, self.ready_at = works, ready_at

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works) and time.perf_counter() >= self.ready_at


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GroupedGloo(dist.ProcessGroup):
    """gloo, with NCCL's coalescing and uneven all-gather / reduce-scatter, launch and op
    counts, and a link."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.me, self.n = rank, size
        self.coalesce: bool = SETTINGS["coalesce"]
        self.link: Link | None = SETTINGS["link"]
        self._group: list | None = None  # inside a coalesced group: [works, critical bytes]
        # torch's C++ side (functional collectives: DTensor's own) reaches the gloo group
        # underneath; the Python calls below reach this class
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.inner)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "grouped_gloo"

    # c10d names a group after making it; a Python group keeps the name itself
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _done(self, kind: str, works, critical: int, payload: int = 0, ops: int = 1):
        """Count ``ops`` ops of ``kind`` handing over ``payload`` bytes, and a launch unless
        inside a coalesced group (which collects the works); its works, delayed by the link
        (``critical``: its most loaded rank's bytes) if there is one. One work and no link:
        gloo's own work, as it is (torch's C++ side may wait on it, which a Python work
        would make take the GIL, and deadlock)."""
        COUNTS.op(kind, ops, payload, launch=self._group is None)
        if self._group is not None:
            self._group[0] += works if isinstance(works, list) else [works]
            self._group[1] += critical
            return _Works([])
        if self.link is None and not isinstance(works, list):
            return works
        works = works if isinstance(works, list) else [works]
        ready = self.link.ready_at(critical) if self.link is not None and self.n > 1 else 0.0
        return _Works(works, ready)

    # ---- NCCL's coalescing ------------------------------------------------------------------
    def _start_coalescing(self, device) -> None:
        if not self.coalesce:
            raise RuntimeError("Backend grouped_gloo does not implement startCoalescing "
                               "(registered with coalesce=False, as gloo)")
        self._group = [[], 0]

    def _end_coalescing(self, device):
        (works, critical), self._group = self._group, None
        COUNTS.launches["coalesced"] += 1
        ready = self.link.ready_at(critical) if self.link is not None and self.n > 1 else 0.0
        return _Works(works, ready)

    # ---- list forms (equal parts; gloo refuses unequal ones, as it does) --------------------
    def allgather(self, output_lists, input_list, opts=None):
        n = sum(map(_nbytes, output_lists[0]))
        return self._done("all_gather", self.inner.allgather(
            output_lists, input_list, opts or dist.AllgatherOptions()),
            op_load("all_gather", n, self.n, self.me).critical, n)

    def reduce_scatter(self, output_list, input_lists, opts=None):
        n = sum(map(_nbytes, input_lists[0]))
        return self._done("reduce_scatter", self.inner.reduce_scatter(
            output_list, input_lists, opts or dist.ReduceScatterOptions()),
            op_load("reduce_scatter", n, self.n, self.me).critical, n)

    # ---- everything else: gloo's own --------------------------------------------------------
    def all_gather_single(self, output, input, opts=None):
        return self._done("all_gather", self.inner._allgather_base(
            output, input, opts or dist.AllgatherOptions()),
            op_load("all_gather", _nbytes(output), self.n, self.me).critical, _nbytes(output))

    def reduce_scatter_single(self, output, input, opts=None):
        return self._done("reduce_scatter", self.inner._reduce_scatter_base(
            output, input, opts or dist.ReduceScatterOptions()),
            op_load("reduce_scatter", _nbytes(input), self.n, self.me).critical, _nbytes(input))

    # torch's C++ side (functional collectives: DTensor's) calls these through the Python
    # group; without them its fallback would enqueue on gloo holding the GIL while a gloo
    # worker that frees a finished work's tensors waits for the GIL (a deadlock, seen)
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.inner._allgather_base(o, i, opts or dist.AllgatherOptions())
                 for o, i in zip(outputs, inputs)]
        return self._done("all_gather", works if len(works) > 1 else works[0],
                          op_load("all_gather", sum(map(_nbytes, outputs)), self.n, self.me).critical,
                          sum(map(_nbytes, outputs)))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.inner._reduce_scatter_base(o, i, opts or dist.ReduceScatterOptions())
                 for o, i in zip(outputs, inputs)]
        return self._done("reduce_scatter", works if len(works) > 1 else works[0],
                          op_load("reduce_scatter", sum(map(_nbytes, inputs)), self.n, self.me).critical,
                          sum(map(_nbytes, inputs)))

    # the same calls under their C++ names (what torch's C++ side looks up on a Python group)
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _allgather_base(self, output, input, opts=None):
        return self.all_gather_single(output, input, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_single(output, input, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        load = op_load("broadcast", _nbytes(tensors[0]), self.n, self.me, opts.rootRank)
        return self._done("broadcast", self.inner.broadcast(tensors, opts), load.critical,
                          _nbytes(tensors[0]))

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        load = op_load("reduce", _nbytes(tensors[0]), self.n, self.me, opts.rootRank)
        return self._done("reduce", self.inner.reduce(tensors, opts), load.critical,
                          _nbytes(tensors[0]))

    def allreduce(self, tensors, opts=None):
        n = sum(map(_nbytes, tensors))
        return self._done("all_reduce", self.inner.allreduce(tensors, opts or dist.AllreduceOptions()),
                          op_load("all_reduce", n, self.n, self.me).critical, n)

    def allreduce_coalesced(self, tensors, opts=None):
        return self._done("all_reduce", self.inner.allreduce_coalesced(
            tensors, opts or dist.AllreduceCoalescedOptions()),
            op_load("all_reduce", sum(map(_nbytes, tensors)), self.n, self.me).critical)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        # this rank's own bytes (the others' splits are not known here)
        mine = max(_nbytes(output), _nbytes(input)) * (self.n - 1) // max(self.n, 1)
        return self._done("all_to_all", self.inner.alltoall_base(
            output, input, output_split_sizes or [], input_split_sizes or [],
            opts or dist.AllToAllOptions()), mine, _nbytes(input))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return self._done("all_to_all", self.inner.alltoall(
            output_tensors, input_tensors, opts or dist.AllToAllOptions()),
            max(sum(map(_nbytes, output_tensors)), sum(map(_nbytes, input_tensors))))

    def gather(self, output_lists, input_list, opts=None):
        return self._done("gather", self.inner.gather(output_lists, input_list,
                                                      opts or dist.GatherOptions()),
                          sum(map(_nbytes, input_list)))

    def scatter(self, output_list, input_lists, opts=None):
        return self._done("scatter", self.inner.scatter(output_list, input_lists,
                                                        opts or dist.ScatterOptions()),
                          sum(map(_nbytes, output_list)))

    def barrier(self, opts=None):
        return self._done("barrier", self.inner.barrier(opts or dist.BarrierOptions()), 0)

    def send(self, tensors, dst: int, tag: int = 0):
        return self._done("send", self.inner.send(tensors, dst, tag), sum(map(_nbytes, tensors)))

    def recv(self, tensors, src: int, tag: int = 0):
        return self._done("recv", self.inner.recv(tensors, src, tag), sum(map(_nbytes, tensors)))

    def recv_anysource(self, tensors, tag: int = 0):
        return self._done("recv", self.inner.recv_anysource(tensors, tag),
                          sum(map(_nbytes, tensors)))
