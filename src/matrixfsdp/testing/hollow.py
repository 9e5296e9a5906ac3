"""``hollow``: one process plays one rank of a world of any size, to judge the library at P =
16384 on a laptop: a process group whose every collective completes at once, counted as
NCCL would issue it.

It moves no data. It answers as if every rank held what this rank holds: an all-gather
repeats this rank's part in every slot, a reduce-scatter hands back this rank's slice, a
broadcast, reduce or all-reduce leaves the tensor as it is (a MIN / MAX over equal ranks).
Numbers are therefore not one process's, but every size, call and loop the runtime makes
is the one it makes as that rank of that world, and finishes in this process's time.

It has NCCL's capabilities, not gloo's: the ops issued between ``_start_coalescing`` and
``_end_coalescing`` are one launch, and an all-gather / reduce-scatter over a list of parts
of different sizes is accepted, as NCCL's group of one broadcast / reduce per part (P ops).
:data:`matrixfsdp.testing.COUNTS` counts what NCCL would see: launches, ops, the longest
list of tensors any call was handed, and the bytes handed to gathers.

    from matrixfsdp import testing
    testing.register("hollow")
    dist.init_process_group("hollow", store=dist.HashStore(), rank=P - 1, world_size=P)
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .counts import COUNTS


class _Done(dist.Work):
    """A work that is over when made."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Hollow(dist.ProcessGroup):
    """Rank ``rank`` of ``size``; every collective completes at once (module docstring)."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self.me, self.n = rank, size
        self._coalescing = False

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "hollow"

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _count(self, kind: str, ops: int = 1, tensors: int = 1) -> _Done:
        COUNTS.op(kind, ops, tensors=tensors, launch=not self._coalescing)
        return _Done()

    # ---- NCCL's coalescing ------------------------------------------------------------------
    def _start_coalescing(self, device) -> None:
        self._coalescing = True

    def _end_coalescing(self, device) -> _Done:
        self._coalescing = False
        COUNTS.launches["coalesced"] += 1
        return _Done()

    # ---- gathers ----------------------------------------------------------------------------
    def _gathered(self, inp: torch.Tensor) -> None:
        COUNTS.gather_input_bytes = max(COUNTS.gather_input_bytes, _nbytes(inp))

    def allgather(self, output_lists, input_list, opts=None):
        outs, inp = output_lists[0], input_list[0]
        self._gathered(inp)
        for out in outs:
            if out.numel() == inp.numel():
                out.copy_(inp)
        uneven = len({o.numel() for o in outs}) > 1
        return self._count("all_gather", len(outs) if uneven else 1, len(outs))

    def _allgather_base(self, output, input, opts=None):
        self._gathered(input)
        output.view(self.n, -1).copy_(input.reshape(1, -1).clone())
        return self._count("all_gather")

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self._gathered(i)
            o.view(self.n, -1).copy_(i.reshape(1, -1).clone())
        return self._count("all_gather", len(outputs), len(outputs))

    def reduce_scatter(self, output_list, input_lists, opts=None):
        out, inps = output_list[0], input_lists[0]
        out.copy_(inps[self.me])
        uneven = len({t.numel() for t in inps}) > 1
        return self._count("reduce_scatter", len(inps) if uneven else 1, len(inps))

    def _reduce_scatter_base(self, output, input, opts=None):
        output.copy_(input.reshape(self.n, -1)[self.me].view(output.shape))
        return self._count("reduce_scatter")

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            o.copy_(i.reshape(self.n, -1)[self.me].view(o.shape))
        return self._count("reduce_scatter", len(outputs), len(outputs))

    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ---- the rest: the tensors stay as they are ---------------------------------------------
    def broadcast(self, tensors, opts=None):
        return self._count("broadcast", tensors=len(tensors))

    def reduce(self, tensors, opts=None):
        return self._count("reduce", tensors=len(tensors))

    def allreduce(self, tensors, opts=None):
        return self._count("all_reduce", tensors=len(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self._count("all_reduce", len(tensors), len(tensors))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._count("all_to_all", tensors=max(len(output_split_sizes or []), 1))

    def barrier(self, opts=None):
        return self._count("barrier")

    def gather(self, output_lists, input_list, opts=None):
        self._gathered(input_list[0])
        return self._count("gather", tensors=max(len(output_lists[0]) if output_lists else 0, 1))

    def scatter(self, output_list, input_lists, opts=None):
        return self._count("scatter", tensors=max(len(input_lists[0]) if input_lists else 0, 1))

    def send(self, tensors, dst: int, tag: int = 0):
        return self._count("send")

    def recv(self, tensors, src: int, tag: int = 0):
        return self._count("recv")
