"""The collectives the runtime needs, and what each costs its most loaded rank.

:class:`Comm` issues them over one process group (the same public ``torch.distributed``
calls on every backend) and counts each in a :class:`CommStats`:

* ``all_gather`` / ``reduce_scatter``: equal parts of every rank (a unit's even parts, or
  whole chunks of one size), as FSDP2 (ring: every rank sends and receives ``(P-1)/P`` of
  the buffer);
* ``all_gather_v`` / ``reduce_scatter_v``: every rank's part of its own size, one call
  (``dist.all_gather`` / ``dist.reduce_scatter`` over tensor lists, which NCCL runs as one
  group of broadcasts from / reduces to each rank); only where the group has them
  (:func:`uneven_supported`: NCCL and XCCL do, gloo does not);
* ``broadcast`` / ``reduce``: one piece from / to its holder (NCCL pipelines both along a
  ring: every rank moves about the piece once, the root only sends, the last only receives);
* ``all_reduce``, ``all_to_all`` (tensor parallelism's slices); HSDP's replicate dimension
  uses the same calls under the ``replicate_`` prefix.

A collective ends when its most loaded rank is done, so the counters keep, per kind, that
rank's bytes (``critical_bytes``: the larger of what it sends and receives, summed over
calls) next to the mean over ranks and this rank's own sent and received bytes, charged by
the load model the planner predicts with (:mod:`matrixfsdp.planning.layout`). Every rank
knows every size, so this needs no communication.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..planning.layout import Load, grouped_load, pipeline_load, ring_load
from ..planning.traffic import COUNTERS
from . import arrival


def all_gather_single(*args, **kwargs):
    """torch >= 2.13's name, or the older one (looked up at each call, as FSDP2 does)."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_single(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def _object_device(group: dist.ProcessGroup | None) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_gather_object(obj: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj``, in rank order (a set-up or failure-path collective: two small
    all-gathers), as ``dist.all_gather_object`` but on the group's own device and without
    numpy (torch's needs it; only checkpoints do here, through DCP)."""
    device = _object_device(group)
    data = torch.tensor(list(pickle.dumps(obj)), dtype=torch.uint8, device=device)
    world = dist.get_world_size(group)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    every = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(every, padded, group=group)
    return [pickle.loads(bytes(t[:int(s)].tolist())) for t, s in zip(every, sizes)]


def broadcast_object(obj: object, src: int, group: dist.ProcessGroup | None = None) -> object:
    """Global rank ``src``'s ``obj`` on every rank of ``group`` (two small broadcasts),
    numpy-free like :func:`all_gather_object`."""
    device = _object_device(group)
    mine = dist.get_rank() == src
    data = torch.tensor(list(pickle.dumps(obj)) if mine else [], dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if not mine:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    return obj if mine else pickle.loads(bytes(data.tolist()))


PHASE_OF = {"all_gather": "gather", "all_gather_v": "gather", "broadcast": "gather",
            "reduce_scatter": "reduce", "reduce_scatter_v": "reduce", "reduce": "reduce",
            "all_reduce": "reduce", "replicate_allreduce": "replicate",
            "replicate_reduce": "replicate", "replicate_reduce_scatter_v": "replicate",
            "replicate_broadcast": "replicate", "replicate_all_gather_v": "replicate",
            "tp_all_to_all": "gather", "tp_grad_all_to_all": "reduce"}


@dataclass
class CommStats:
    """Per collective kind, since the last :meth:`reset`: ``calls``; ``payload_bytes`` (the
    buffer handed over, as FSDP2 counts its all-gather output); this rank's
    ``sent_bytes`` / ``received_bytes``; ``critical_bytes``, the most loaded rank's
    ``max(sent, received)`` of each call, summed; ``mean_bytes``, the mean over ranks."""

    counts: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: dict.fromkeys(COUNTERS, 0)))

    def add(self, kind: str, payload: int, load: Load) -> None:
        c = self.counts[kind]
        for key, value in (("calls", 1), ("payload_bytes", payload), ("sent_bytes", load.sent),
                           ("received_bytes", load.received), ("critical_bytes", load.critical),
                           ("mean_bytes", load.mean)):
            c[key] += value

    def reset(self) -> None:
        self.counts.clear()

    def total(self, key: str) -> int:
        return sum(c[key] for c in self.counts.values())

    @property
    def calls(self) -> dict[str, int]:
        return {k: c["calls"] for k, c in self.counts.items()}

    @property
    def payload_bytes(self) -> dict[str, int]:
        return {k: c["payload_bytes"] for k, c in self.counts.items()}

    @property
    def sent_bytes(self) -> dict[str, int]:
        return {k: c["sent_bytes"] for k, c in self.counts.items()}

    def phase(self, key: str = "payload_bytes") -> dict[str, int]:
        """``key`` summed per phase: ``gather`` (all-gathers, broadcasts, tp hop),
        ``reduce`` (reduce-scatters, reduces, the gradients' tp hop), and HSDP's
        ``replicate``."""
        out: dict[str, int] = {}
        for kind, c in self.counts.items():
            ph = PHASE_OF[kind]
            out[ph] = out.get(ph, 0) + c[key]
        return out

    def summary(self) -> dict[str, dict[str, int]]:
        return {k: dict(self.counts[k]) for k in sorted(self.counts)}


class Pending:
    """An in-flight collective; :meth:`wait` finishes it, then runs its epilogues in order.

    It holds the tensors the collective reads or writes (``keep``) until then, so a
    transient send buffer lives as long as the transfer (the FSDP2 rule on CUDA too).
    ``work`` is anything with ``wait()`` and ``is_completed()`` (a ``torch.distributed``
    work). ``watch`` (set by :class:`Comm` on a
    gloo group): a collective that times out names the ranks that did not arrive
    (:mod:`matrixfsdp.runtime.arrival`).
    """

    def __init__(self, work=None, epilogue=None, keep: tuple = (), watch=None):
        self._work = work
        self._epilogues = [epilogue] if epilogue is not None else []
        self._keep = keep
        self._parts: list[Pending] = []  # see :meth:`all`
        self.watch = watch

    def then(self, epilogue) -> Pending:
        """Run ``epilogue()`` after the collective and the earlier epilogues."""
        self._epilogues.append(epilogue)
        return self

    def done(self) -> bool:
        """Whether :meth:`wait` would return without waiting (never blocks)."""
        return ((self._work is None or self._work.is_completed())
                and all(p.done() for p in self._parts))

    def wait(self) -> None:
        parts, self._parts = self._parts, []
        for p in parts:
            p.wait()
        if self._work is not None:
            arrival.wait(self._work, self.watch)
            self._work = None
        epilogues, self._epilogues, self._keep = self._epilogues, [], ()
        for epilogue in epilogues:
            epilogue()

    @classmethod
    def all(cls, pendings: list[Pending], epilogue=None) -> Pending:
        """One :class:`Pending` that finishes ``pendings`` in order, then ``epilogue``."""
        pending = cls(None, epilogue)
        pending._parts = list(pendings)
        return pending


class Comm:
    """The collectives of one process group, counted in ``stats``. All are asynchronous:
    each returns a :class:`Pending` (``wait()`` it). Means are a sum followed by one
    division by the group size, as in FSDP2, so equal inputs come back bit-identical."""

    def __init__(self, group: dist.ProcessGroup, stats: CommStats, prefix: str = "",
                 grouped: bool = False):
        self.group = group
        self.stats = stats
        self.prefix = prefix  # "replicate_" for HSDP's replicate dimension
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # the group has uneven all-gather / reduce-scatter (uneven_supported): a unit's
        # chunks travel in one call per direction
        self.grouped = grouped

    def _issue(self, kind: str, payload: int, load: Load, work, epilogue=None,
               keep: tuple = ()) -> Pending:
        self.stats.add(self.prefix + kind, payload, load)
        pending = Pending(work, epilogue, keep)
        pending.watch = arrival.issued(self.group, self.prefix + kind)  # numbered as issued
        return pending

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Pending:
        """``out`` (``P x inp``) = every rank's ``inp``, rank-major."""
        if self.size == 1:
            out.copy_(inp)
            return Pending()
        n = out.numel() * out.element_size()
        return self._issue("all_gather", n, ring_load(n, self.size),
                           all_gather_single(out, inp, group=self.group, async_op=True),
                           keep=(out, inp))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       divisor: float | None = None) -> Pending:
        """``out`` = sum over ranks of this rank's ``1/P`` of ``inp``, divided by ``divisor``
        (default: ``P``, the mean; ``inp`` is scratch)."""
        divisor = self.size if divisor is None else divisor
        if self.size == 1:
            out.copy_(inp)
            return Pending() if divisor == 1 else Pending(epilogue=lambda: out.div_(divisor))
        n = inp.numel() * inp.element_size()
        work = reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=self.group,
                                     async_op=True)
        return self._issue("reduce_scatter", n, ring_load(n, self.size), work,
                           lambda: out.div_(divisor), keep=(out, inp))

    def all_gather_v(self, outs: list[torch.Tensor], inp: torch.Tensor) -> Pending:
        """``outs[r]`` = group rank ``r``'s ``inp`` (sizes may differ; ``inp`` may be a view
        of ``outs[rank]``): one ``dist.all_gather`` over the list."""
        if self.size == 1:
            if outs[0].data_ptr() != inp.data_ptr():
                outs[0].copy_(inp)
            return Pending()
        es = inp.element_size()
        sizes = [o.numel() * es for o in outs]
        load = grouped_load(sizes.__getitem__, sum(sizes), min(sizes), self.size, self.rank,
                            toward=False)
        work = dist.all_gather(outs, inp, group=self.group, async_op=True)
        return self._issue("all_gather_v", sum(sizes), load, work, keep=(outs, inp))

    def reduce_scatter_v(self, out: torch.Tensor, inps: list[torch.Tensor],
                         divisor: float | None = None) -> Pending:
        """``out`` = sum over ranks of their ``inps[rank]`` (sizes may differ), divided by
        ``divisor`` (default: the mean): one ``dist.reduce_scatter`` over the list."""
        divisor = self.size if divisor is None else divisor
        if self.size == 1:
            out.copy_(inps[0])
            return Pending() if divisor == 1 else Pending(epilogue=lambda: out.div_(divisor))
        es = out.element_size()
        sizes = [t.numel() * es for t in inps]
        load = grouped_load(sizes.__getitem__, sum(sizes), min(sizes), self.size, self.rank,
                            toward=True)
        work = dist.reduce_scatter(out, inps, op=dist.ReduceOp.SUM, group=self.group,
                                   async_op=True)
        return self._issue("reduce_scatter_v", sum(sizes), load, work,
                           (lambda: out.div_(divisor)) if divisor != 1 else None, (out, inps))

    def all_reduce(self, t: torch.Tensor, divisor: float | None = None) -> Pending:
        """``t`` = sum of ``t`` over the ranks divided by ``divisor`` (default: the mean;
        in place)."""
        divisor = self.size if divisor is None else divisor
        n = t.numel() * t.element_size()
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return self._issue("allreduce" if self.prefix else "all_reduce", n,
                           ring_load(n, self.size, 2), work,
                           (lambda: t.div_(divisor)) if divisor != 1 else None, (t,))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_sizes: list[int],
                   in_sizes: list[int], loads: list[tuple[int, int]]) -> Pending:
        """Send ``in_sizes[s]`` elements of ``inp`` (in rank order) to group rank ``s`` and
        receive ``out_sizes[s]`` from it into ``out``. ``loads``: every rank's (sent,
        received) elements, known to all from the layout (tensor parallelism's slices)."""
        es = out.element_size()
        critical = max(max(s, r) for s, r in loads) * es
        mean = sum(s for s, _ in loads) * es // len(loads)
        me = loads[self.rank]
        work = dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=self.group,
                                      async_op=True)
        return self._issue("all_to_all", out.numel() * es, Load(me[0] * es, me[1] * es, critical,
                                                               mean), work, keep=(out, inp))

    def broadcast(self, t: torch.Tensor, root: int) -> Pending:
        """``t`` = group rank ``root``'s ``t`` on every rank (in place)."""
        if self.size == 1:
            return Pending()
        n = t.numel() * t.element_size()
        work = dist.broadcast(t, group_src=root, group=self.group, async_op=True)
        return self._issue("broadcast", n, pipeline_load(n, self.size, self.rank, root, False),
                           work, keep=(t,))

    def reduce(self, t: torch.Tensor, root: int, divisor: float | None = None) -> Pending:
        """On group rank ``root``: ``t`` = sum of ``t`` over the ranks divided by ``divisor``
        (default: the mean). Elsewhere ``t`` is left undefined (the backend may use it as
        scratch)."""
        divisor = self.size if divisor is None else divisor
        if self.size == 1:
            return Pending() if divisor == 1 else Pending(epilogue=lambda: t.div_(divisor))
        n = t.numel() * t.element_size()
        work = dist.reduce(t, group_dst=root, op=dist.ReduceOp.SUM, group=self.group,
                           async_op=True)
        mean = (lambda: t.div_(divisor)) if self.rank == root and divisor != 1 else None
        return self._issue("reduce", n, pipeline_load(n, self.size, self.rank, root, True),
                           work, mean, (t,))


def uneven_supported(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` gathers and reduce-scatters parts of different sizes (asked once,
    at set-up, of the group itself: a tiny uneven ``all_gather`` and ``reduce_scatter``
    that either work, exactly, or raise on every rank; never by the backend's name). NCCL
    and XCCL run them as one group of broadcasts / reduces; gloo refuses the all-gather."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    if P == 1:
        return True
    sizes = [1 + r % 2 for r in range(P)]
    try:
        outs = [torch.empty(n, device=device) for n in sizes]
        dist.all_gather(outs, torch.full((sizes[me],), float(me), device=device), group=group)
        out = torch.empty(sizes[me], device=device)
        dist.reduce_scatter(out, [torch.ones(n, device=device) for n in sizes], group=group)
        works = all(bool((o == r).all()) for r, o in enumerate(outs)) and bool((out == P).all())
    except (RuntimeError, ValueError, NotImplementedError):
        works = False
    verdict = torch.tensor([int(works)], device=device)  # one answer on every rank
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
    return bool(verdict.item())
