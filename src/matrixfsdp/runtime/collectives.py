"""The collectives the runtime needs, and what each costs its most loaded rank.

:class:`Comm` issues them over one process group (the same public ``torch.distributed``
calls on every backend) and counts each in a :class:`CommStats`:

* ``all_gather`` / ``reduce_scatter``: equal parts of every rank (a unit's even parts, or
  whole chunks of one size), as FSDP2 (ring: every rank sends and receives ``(P-1)/P`` of
  the buffer);
* ``broadcast`` / ``reduce``: one holder's pieces from / to it (NCCL pipelines both along
  a ring or tree: every rank moves about the piece once, the root only sends, the last
  only receives);
* ``all_reduce``, ``all_to_all`` (tensor parallelism's slices); HSDP's replicate dimension
  uses the same calls under the ``replicate_`` prefix.

A unit's gather or reduce is one even collective plus one broadcast / reduce per rank that
holds pieces of it: its NCCL ops grow with the unit's owners, never with the group's size.
:meth:`Comm.batch` issues them as **one launch** where the group coalesces (NCCL: one
``ncclGroupStart`` / ``ncclGroupEnd``, asked of the group once at set-up by
:func:`coalescing_supported`, never by the backend's name), else one launch each (gloo).

A collective ends when its most loaded rank is done, so the counters keep, per kind, that
rank's bytes (``critical_bytes``: the larger of what it sends and receives, summed over
calls) next to the mean over ranks and this rank's own sent and received bytes. They are
charged here from the tensors handed to each call, by NCCL's algorithms
(:func:`~matrixfsdp.layout.loads.op_load`, the one arithmetic the planner predicts with);
a test holds the planner's predictions, made from the layout alone, against these counts.
Every rank knows every size, so this needs no communication.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import _compat
from .._compat import all_gather_single, reduce_scatter_single
from ..diagnosis import arrival
from ..diagnosis.arrival import error_text
from ..layout.loads import Load, op_load
from ..layout.traffic import COUNTERS

_log = logging.getLogger(__name__)


PHASE_OF = {"all_gather": "gather", "broadcast": "gather", "reduce_scatter": "reduce",
            "reduce": "reduce", "all_reduce": "reduce", "replicate_allreduce": "replicate",
            "replicate_reduce": "replicate", "replicate_broadcast": "replicate",
            "tp_all_to_all": "gather", "tp_grad_all_to_all": "reduce",
            "tp_step_allreduce": "step"}


@dataclass
class CommStats:
    """Per collective kind, since the last :meth:`reset`: ``calls`` (NCCL ops: a coalesced
    launch counts each op it holds); ``payload_bytes`` (the buffer handed over, as FSDP2
    counts its all-gather output); this rank's ``sent_bytes`` / ``received_bytes``;
    ``critical_bytes``, the most loaded rank's ``max(sent, received)`` of each call, summed;
    ``mean_bytes``, the mean over ranks. ``launches``: per phase (``gather``, ``reduce``,
    ``replicate``), the launches those ops took (one per unit and direction where the group
    coalesces, else one per op)."""

    counts: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: dict.fromkeys(COUNTERS, 0)))
    launches: Counter = field(default_factory=Counter)

    def add(self, kind: str, payload: int, load: Load) -> None:
        c = self.counts[kind]
        for key, value in (("calls", 1), ("payload_bytes", payload), ("sent_bytes", load.sent),
                           ("received_bytes", load.received), ("critical_bytes", load.critical),
                           ("mean_bytes", load.mean)):
            c[key] += value

    def reset(self) -> None:
        self.counts.clear()
        self.launches.clear()

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


_IN_FLIGHT: weakref.WeakSet = weakref.WeakSet()  # Pendings whose launch is not waited for


def in_flight() -> list[str]:
    """The collectives this process's library issued that have not completed yet, by kind
    or phase (a diagnostic: the tests' profiler windows refuse to close over them, as
    torch's profiler stopped while gloo's worker thread still recorded one corrupted a
    rank's heap: docs/design.md, "QK-clip's all-reduce"). Never blocks."""
    return sorted(p.label for p in list(_IN_FLIGHT)
                  if p._work is not None and not p._work.is_completed())


class Pending:
    """An in-flight collective; :meth:`wait` finishes it, then runs its epilogues in order.

    It holds the tensors the collective reads or writes (``keep``) until then, so a
    transient send buffer lives as long as the transfer (the FSDP2 rule on CUDA too).
    ``work`` is anything with ``wait()`` and ``is_completed()`` (a ``torch.distributed``
    work). ``watch`` (set by :class:`Comm` on a
    gloo group): a collective that times out names the ranks that did not arrive
    (:mod:`matrixfsdp.diagnosis.arrival`).
    """

    def __init__(self, work=None, epilogue=None, keep: tuple = (), watch=None, label: str = ""):
        self._work = work
        self._epilogues = [epilogue] if epilogue is not None else []
        self._keep = keep
        self._parts: list[Pending] = []  # see :meth:`all`
        self.watch = watch
        self.label = label  # what it is (its kind or phase), for :func:`in_flight`
        if work is not None:
            _IN_FLIGHT.add(self)

    def holding(self) -> tuple:
        """The tensors this collective and the ones it holds read or write."""
        return self._keep + tuple(t for p in self._parts for t in p.holding())

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
        if self._work is not None:  # a launch holding ``parts`` (a coalesced batch) first
            arrival.wait(self._work, self.watch)
            self._work = None
            _IN_FLIGHT.discard(self)
        for p in parts:
            p.wait()
        epilogues, self._epilogues, self._keep = self._epilogues, [], ()
        for epilogue in epilogues:
            epilogue()

    @classmethod
    def all(cls, pendings: list[Pending], epilogue=None, work=None, watch=None,
            label: str = "") -> Pending:
        """One :class:`Pending` that finishes ``work`` (a launch holding them all, if any),
        then ``pendings`` in order, then ``epilogue``."""
        pending = cls(work, epilogue, watch=watch, label=label)
        pending._parts = list(pendings)
        return pending


class Comm:
    """The collectives of one process group, counted in ``stats``. All are asynchronous:
    each returns a :class:`Pending` (``wait()`` it). Means are the collective's own
    average where the group has one (``average``: ``ReduceOp.AVG``, as FSDP2 uses on NCCL),
    else a sum followed by one division.
    ``coalesce``: the group runs several ops as one launch (:func:`coalescing_supported`),
    which :meth:`batch` uses; ``device``: the one its collectives run on."""

    def __init__(self, group: dist.ProcessGroup, stats: CommStats, prefix: str = "",
                 coalesce: bool = False, device: torch.device | None = None,
                 average: bool = False):
        self.group = group
        self.average = average  # the group averages in the collective (ReduceOp.AVG)
        self.stats = stats
        self.prefix = prefix  # "replicate_" for HSDP's replicate dimension
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.coalesce = coalesce
        self.device = device
        self._batching = False  # inside :meth:`batch` on a coalescing group
        self._issued = 0  # ops issued so far (what :meth:`batch` counts launches by)

    def batch(self, phase: str, ops: list[Callable[[], Pending]]) -> Pending:
        """The collectives the calls ``ops`` issue (through this Comm), as one launch where
        the group coalesces (NCCL: one group of ops, one kernel launch, one work to wait
        for), else one launch each. The ops and their order are the same either way;
        ``phase`` (``gather``, ``reduce``, ``replicate``) counts the launches."""
        if not self.coalesce or self.size == 1 or len(ops) < 2:
            before = self._issued
            parts = [op() for op in ops]
            self.stats.launches[phase] += self._issued - before
            return Pending.all(parts)
        self._batching = True
        try:
            with _compat.coalescing(self.group, self.device) as works:
                parts = [op() for op in ops]
        finally:
            self._batching = False
        self.stats.launches[phase] += 1
        return Pending.all(parts, work=works[0],
                           watch=arrival.issued(self.group, f"{self.prefix}{phase}"),
                           label=f"{self.prefix}{phase}")

    def _mean(self, divisor: float | None, t: torch.Tensor) -> tuple[dist.ReduceOp, Callable | None]:
        """The reduce op and the epilogue that divide a sum into ``t`` by ``divisor``
        (default: the group's size, the mean): AVG where the group averages and the
        divisor is its size (no division kernel), else SUM and one ``div_`` after it."""
        divisor = self.size if divisor is None else divisor
        if self.average and divisor == self.size:
            return dist.ReduceOp.AVG, None
        return dist.ReduceOp.SUM, (lambda: t.div_(divisor)) if divisor != 1 else None

    def _issue(self, kind: str, nbytes: int, work, epilogue=None, keep: tuple = (),
               root: int | None = None) -> Pending:
        # HSDP's replicate-dim all-reduce keeps its historical name
        name = self.prefix + ("allreduce" if self.prefix and kind == "all_reduce" else kind)
        self.stats.add(name, nbytes, op_load(kind, nbytes, self.size, self.rank, root))
        self._issued += 1
        if self._batching:  # the batch's launch is waited for; this op's own work is not
            return Pending(None, epilogue, keep)
        return Pending(work, epilogue, keep, watch=arrival.issued(self.group, name), label=name)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Pending:
        """``out`` (``P x inp``) = every rank's ``inp``, rank-major."""
        if self.size == 1:
            out.copy_(inp)
            return Pending()
        return self._issue("all_gather", _nbytes(out),
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
        op, epilogue = self._mean(divisor, out)
        work = reduce_scatter_single(out, inp, op=op, group=self.group, async_op=True)
        return self._issue("reduce_scatter", _nbytes(inp), work, epilogue, (out, inp))

    def all_reduce(self, t: torch.Tensor, divisor: float | None = None) -> Pending:
        """``t`` = sum of ``t`` over the ranks divided by ``divisor`` (default: the mean;
        in place)."""
        op, epilogue = self._mean(divisor, t)
        work = dist.all_reduce(t, op=op, group=self.group, async_op=True)
        return self._issue("all_reduce", _nbytes(t), work, epilogue, (t,))

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
        kind = self.prefix + "all_to_all"
        self.stats.add(kind, _nbytes(out), Load(me[0] * es, me[1] * es, critical, mean))
        self.stats.launches[PHASE_OF[kind]] += 1
        return Pending(work, keep=(out, inp), watch=arrival.issued(self.group, kind), label=kind)

    def broadcast(self, t: torch.Tensor, root: int) -> Pending:
        """``t`` = group rank ``root``'s ``t`` on every rank (in place)."""
        if self.size == 1:
            return Pending()
        work = dist.broadcast(t, group_src=root, group=self.group, async_op=True)
        return self._issue("broadcast", _nbytes(t), work, keep=(t,), root=root)

    def reduce(self, t: torch.Tensor, root: int, divisor: float | None = None) -> Pending:
        """On group rank ``root``: ``t`` = sum of ``t`` over the ranks divided by ``divisor``
        (default: the mean). Elsewhere ``t`` is left undefined (the backend may use it as
        scratch)."""
        divisor = self.size if divisor is None else divisor
        if self.size == 1:
            return Pending() if divisor == 1 else Pending(epilogue=lambda: t.div_(divisor))
        op, mean = self._mean(divisor, t)
        work = dist.reduce(t, group_dst=root, op=op, group=self.group, async_op=True)
        return self._issue("reduce", _nbytes(t), work, mean if self.rank == root else None,
                           (t,), root=root)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def coalescing_supported(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` runs several ops as one launch (asked once, at set-up, of the group
    itself: a tiny coalesced broadcast plus even all-gather that either completes, filling
    its output, or raises on every rank; never by the backend's name). NCCL does (one NCCL
    group); gloo raises ("does not implement startCoalescing"). A capability, not a
    correctness check: the parity tests check the path's results."""
    return group_capabilities(group, device).coalesce


def _coalesces_here(group: dist.ProcessGroup, device: torch.device) -> bool:
    """This rank's half of :func:`coalescing_supported`: the probe, not yet agreed."""
    try:
        P = dist.get_world_size(group)
        one, every = torch.ones(1, device=device), torch.zeros(P, device=device)
        with _compat.coalescing(group, device) as works:
            dist.broadcast(one, group_src=0, group=group, async_op=True)
            all_gather_single(every, torch.ones(1, device=device), group=group, async_op=True)
        works[0].wait()
        return bool((every == 1).all()) and bool(one.item() == 1)
    except (RuntimeError, ValueError, NotImplementedError, AttributeError) as e:
        if "does not implement" not in str(e):  # a backend that should coalesce and failed
            _log.warning("matrixfsdp: process group %s (%s) failed to coalesce (%s): its units "
                        "take one launch per op", getattr(group, "group_name", "?"),
                        dist.get_backend(group), error_text(e))
        return False


@dataclass(frozen=True)
class Capabilities:
    """What a process group does, as every rank of it agreed at set-up: ``coalesce``
    several ops into one launch; ``average`` in the collective (``ReduceOp.AVG``: NCCL, and
    gloo in torch >= 2.13), so a mean needs no division kernel after it."""

    coalesce: bool
    average: bool


def group_capabilities(group: dist.ProcessGroup, device: torch.device,
                       coalesces: bool | None = None) -> Capabilities:
    """The group's :class:`Capabilities`: whether it coalesces (``coalesces``: this rank's
    finding, :func:`coalescing_supported`'s probe by default), agreed by one all-reduce
    that is itself the probe of ``ReduceOp.AVG`` (every rank's 1 or 0 averaged is 1 only
    where all are 1; a backend without AVG refuses it on every rank before anything moves,
    and a MIN agrees instead)."""
    if dist.get_world_size(group) == 1:
        return Capabilities(True, True)
    if coalesces is None:
        return group_capabilities(group, device, _coalesces_here(group, device))
    verdict = torch.tensor([float(coalesces)], device=device)
    try:
        dist.all_reduce(verdict, op=dist.ReduceOp.AVG, group=group)
        average = True
    except (RuntimeError, ValueError, NotImplementedError):
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
        average = False
    return Capabilities(bool(verdict.item() == 1.0), average)
