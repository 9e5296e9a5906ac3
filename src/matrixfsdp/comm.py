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

HSDP adds three collectives across the replicate dimension (``R`` replicas), each over a
contiguous run of a shard segment, counted as ``replicate_allreduce`` (mean of the
replicated pieces), ``replicate_reduce`` (mean of a replica's matrices, to that replica
only) and ``replicate_broadcast`` (those matrices back from it after the step). Their
payload is the tensor passed; their ``sent_bytes`` are what a bandwidth-optimal algorithm
moves per rank (ring all-reduce ``2 (R-1)/R n``, reduce and broadcast ``(R-1)/R n`` each),
so a reduce plus a broadcast sends what an all-reduce of the same tensor sends.
"""

from __future__ import annotations

import time
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


@dataclass
class LinkDelay:
    """A model of a slower network, for tests and ``matrixfsdp bench --link``: a collective
    this rank issues at time t is not complete before ``t + latency_s + sent / bytes_per_s``.
    Waiting later hides the delay, waiting at once pays it, which is what overlap is about.
    ``serial``: one link per rank, so a transfer starts only when the previous one ended.
    """

    latency_s: float = 0.0
    bytes_per_s: float | None = None
    serial: bool = False
    _link_free: float = 0.0

    def ready_at(self, sent_bytes: int) -> float:
        start = time.perf_counter()
        if self.serial:
            start = max(start, self._link_free)
        end = start + self.latency_s + (sent_bytes / self.bytes_per_s if self.bytes_per_s else 0.0)
        self._link_free = end
        return end


class Pending:
    """An in-flight collective; :meth:`wait` finishes it, then runs its epilogues in order.

    It holds the tensors the collective reads or writes (``keep``) until then, so a
    transient send buffer lives as long as the transfer (the FSDP2 rule on CUDA too).
    """

    def __init__(self, work, epilogue=None, keep: tuple = (), ready_at: float = 0.0):
        self._work = work
        self._epilogues = [epilogue] if epilogue is not None else []
        self._keep = keep
        self._ready_at = ready_at
        self._parts: list[Pending] = []  # see :meth:`all`

    def then(self, epilogue) -> Pending:
        """Run ``epilogue()`` after the collective and the earlier epilogues."""
        self._epilogues.append(epilogue)
        return self

    def done(self) -> bool:
        """Whether :meth:`wait` would return without waiting (never blocks)."""
        return ((self._work is None or self._work.is_completed())
                and time.perf_counter() >= self._ready_at and all(p.done() for p in self._parts))

    def wait(self) -> None:
        parts, self._parts = self._parts, []
        for p in parts:
            p.wait()
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._ready_at:  # a modelled slower link (tests, bench) only
            delay = self._ready_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            self._ready_at = 0.0
        epilogues, self._epilogues, self._keep = self._epilogues, [], ()
        for epilogue in epilogues:
            epilogue()

    @classmethod
    def all(cls, pendings: list[Pending]) -> Pending:
        """One :class:`Pending` that finishes ``pendings`` in order."""
        pending = cls(None)
        pending._parts = list(pendings)
        return pending


def gather_v(segment: torch.Tensor, out: torch.Tensor, seg_sizes: list[int],
             group: dist.ProcessGroup, stats: CommStats | None = None,
             async_op: bool = False, delay: LinkDelay | None = None) -> Pending:
    """All ranks' segments into ``out`` (rank-major, ``sum(seg_sizes)`` elements).

    ``segment`` is this rank's ``seg_sizes[rank]`` elements; ``out`` is written in place.
    """
    P = len(seg_sizes)
    rank = dist.get_rank(group)
    if P == 1:
        out.copy_(segment)
        return Pending(None)
    sent = seg_sizes[rank] * (P - 1) * out.element_size()
    if stats is not None:
        stats.add("gather_v", out.numel() * out.element_size(), sent)
    send = segment
    if len(set(seg_sizes)) == 1:
        work = all_gather_single(out, segment, group=group, async_op=async_op)
    else:
        send = segment.repeat(P)
        work = dist.all_to_all_single(out, send, seg_sizes, [seg_sizes[rank]] * P,
                                      group=group, async_op=async_op)
    pending = Pending(work, keep=(segment, send, out),
                      ready_at=delay.ready_at(sent) if delay else 0.0)
    if not async_op:
        pending.wait()
    return pending


def reduce_v(full: torch.Tensor, out: torch.Tensor, seg_sizes: list[int],
             group: dist.ProcessGroup, stats: CommStats | None = None,
             async_op: bool = False, delay: LinkDelay | None = None) -> Pending:
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
    sent = (full.numel() - n) * full.element_size()
    if stats is not None:
        stats.add("reduce_v", full.numel() * full.element_size(), sent)
    recv = out
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
    pending = Pending(work, epilogue, keep=(full, recv, out),
                      ready_at=delay.ready_at(sent) if delay else 0.0)
    if not async_op:
        pending.wait()
    return pending


def _bus(n: int, R: int, factor: int) -> int:
    return factor * n * (R - 1) // R


def _replicate_op(kind: str, t: torch.Tensor, group: dist.ProcessGroup, factor: int, issue,
                  mean: bool, stats: CommStats | None, async_op: bool,
                  delay: LinkDelay | None) -> Pending:
    """Count, issue (``issue(async_op)`` returns the work) and wrap one replicate-dim
    collective on ``t`` in place; ``mean``: divide by the group size once it is done.
    ``factor``: a ring sends ``factor * n (R-1)/R`` bytes per rank (2 for an all-reduce)."""
    R = dist.get_world_size(group)
    sent = _bus(t.numel() * t.element_size(), R, factor)
    if stats is not None:
        stats.add(kind, t.numel() * t.element_size(), sent)
    pending = Pending(issue(async_op), (lambda: t.div_(R)) if mean else None, keep=(t,),
                      ready_at=delay.ready_at(sent) if delay else 0.0)
    if not async_op:
        pending.wait()
    return pending


def replicate_allreduce(t: torch.Tensor, group: dist.ProcessGroup,
                        stats: CommStats | None = None, async_op: bool = False,
                        delay: LinkDelay | None = None) -> Pending:
    """``t`` = mean of ``t`` over the ranks of ``group`` (in place; one division after the
    sum, so equal tensors on every replica come back bit-identical)."""
    return _replicate_op(
        "replicate_allreduce", t, group, 2,
        lambda a: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=a),
        True, stats, async_op, delay)


def replicate_reduce(t: torch.Tensor, dst: int, group: dist.ProcessGroup,
                     stats: CommStats | None = None, async_op: bool = False,
                     delay: LinkDelay | None = None) -> Pending:
    """On global rank ``dst``: ``t`` = mean of ``t`` over the ranks of ``group``. Elsewhere
    ``t`` is left undefined (the backend may use it as scratch)."""
    return _replicate_op(
        "replicate_reduce", t, group, 1,
        lambda a: dist.reduce(t, dst, op=dist.ReduceOp.SUM, group=group, async_op=a),
        dist.get_rank() == dst, stats, async_op, delay)


def replicate_broadcast(t: torch.Tensor, src: int, group: dist.ProcessGroup,
                        stats: CommStats | None = None, async_op: bool = False,
                        delay: LinkDelay | None = None) -> Pending:
    """``t`` = global rank ``src``'s ``t`` on every rank of ``group`` (in place)."""
    return _replicate_op(
        "replicate_broadcast", t, group, 1,
        lambda a: dist.broadcast(t, src, group=group, async_op=a),
        False, stats, async_op, delay)
