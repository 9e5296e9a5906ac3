"""The two collectives the runtime needs, over uneven per-rank segments.

* ``gather_v``: every rank contributes its segment, every rank receives the whole
  rank-major buffer (an all-gather with uneven sizes).
* ``reduce_v``: every rank contributes a whole rank-major buffer, rank r receives the
  element-wise sum of segment r (a reduce-scatter with uneven sizes).

Both are one ``all_to_all_single`` with split sizes, which moves exactly the payload (no
padding) and runs on gloo and NCCL alike. When every segment has the same size they use
the even collectives instead (``all_gather_single`` / ``reduce_scatter_single``, or the
pre-2.13 names), which need no extra buffer.

Every call is counted in a :class:`CommStats`: calls, payload bytes (the size of the
unsharded buffer, as FSDP2 counts its all-gather output and reduce-scatter input) and the
bytes this rank actually sends.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Calls and bytes per collective kind, since the last :meth:`reset`."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    payload_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, payload: int, sent: int) -> None:
        self.calls[kind] += 1
        self.payload_bytes[kind] += payload
        self.sent_bytes[kind] += sent

    def reset(self) -> None:
        self.calls.clear()
        self.payload_bytes.clear()
        self.sent_bytes.clear()

    def summary(self) -> dict[str, dict[str, int]]:
        return {k: {"calls": self.calls[k], "payload_bytes": self.payload_bytes[k],
                    "sent_bytes": self.sent_bytes[k]} for k in sorted(self.calls)}


class Pending:
    """An in-flight collective; :meth:`wait` finishes it and runs the local epilogue."""

    def __init__(self, work, epilogue=None):
        self._work = work
        self._epilogue = epilogue

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._epilogue is not None:
            self._epilogue()
            self._epilogue = None


def gather_v(segment: torch.Tensor, out: torch.Tensor, seg_sizes: list[int],
             group: dist.ProcessGroup, stats: CommStats | None = None,
             async_op: bool = False) -> Pending:
    """All ranks' segments into ``out`` (rank-major, ``sum(seg_sizes)`` elements).

    ``segment`` is this rank's ``seg_sizes[rank]`` elements; ``out`` is written in place.
    """
    P = len(seg_sizes)
    rank = dist.get_rank(group)
    if P == 1:
        out.copy_(segment)
        return Pending(None)
    if stats is not None:
        item = out.element_size()
        stats.add("gather_v", out.numel() * item, seg_sizes[rank] * (P - 1) * item)
    if len(set(seg_sizes)) == 1:
        work = all_gather_single(out, segment, group=group, async_op=async_op)
    else:
        send = segment.repeat(P)
        work = dist.all_to_all_single(out, send, seg_sizes, [seg_sizes[rank]] * P,
                                      group=group, async_op=async_op)
    pending = Pending(work)
    if not async_op:
        pending.wait()
    return pending


def reduce_v(full: torch.Tensor, out: torch.Tensor, seg_sizes: list[int],
             group: dist.ProcessGroup, stats: CommStats | None = None,
             async_op: bool = False) -> Pending:
    """``out`` = mean over ranks of this rank's segment of ``full`` (rank-major).

    ``full`` holds ``sum(seg_sizes)`` elements and may be overwritten; ``out`` holds
    ``seg_sizes[rank]``. The mean is a sum followed by one division by the world size, as
    in FSDP2, so two ranks with equal gradients give back exactly that gradient.
    """
    P = len(seg_sizes)
    rank = dist.get_rank(group)
    n = seg_sizes[rank]
    if P == 1:
        out.copy_(full)
        return Pending(None)
    if stats is not None:
        item = full.element_size()
        stats.add("reduce_v", full.numel() * item, (full.numel() - n) * item)
    if len(set(seg_sizes)) == 1:
        work = _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=group,
                               async_op=async_op)

        def epilogue():
            out.div_(P)
    else:
        recv = full.new_empty(P * n)
        work = dist.all_to_all_single(recv, full, [n] * P, seg_sizes, group=group,
                                      async_op=async_op)

        def epilogue():
            torch.sum(recv.view(P, n), dim=0, out=out)
            out.div_(P)
    pending = Pending(work, epilogue)
    if not async_op:
        pending.wait()
    return pending
