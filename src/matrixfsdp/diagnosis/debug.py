"""Debug mode: every rank checks that all ranks are about to issue the same collective.

Collectives pair up by order alone, so ranks that take different paths through the model
(one skips a block, one stops early) either hang until the process group's timeout or,
worse, pair a gather of one unit with a gather of another. With ``fully_shard(root,
debug=True)`` each gather and reduce is preceded by a check of the signature ``(step,
unit, phase, elements, layout)`` (the collective's size and a checksum of where each
parameter's pieces live: these differ when ranks built, shaped or froze the model
differently, since frozen parameters are planned and reduced differently). The check is
one all-reduce (MAX) of the signature and its negation, 10 int64s whatever the number of
ranks: the ranks agree exactly when every lane's maximum equals its minimum. Only when they
do not does every rank all-gather the signatures, to raise the same error, naming each
rank's position (ranks that agree as spans). Before, every check all-gathered P x 5 values
and each rank wrote a store key (P writes to one store per collective; 9.8 s per step at
16384 ranks).

On a device (NCCL) the check's all-reduce is waited for as every collective is, with no
timeout (a timed ``wait`` would block the host in the backend and may leave the
communicator unusable once it expires); the host then reads the lanes, the check's one
documented synchronisation. A rank that never arrives is named there by NCCL's watchdog and
flight recorder (:mod:`matrixfsdp.diagnosis.flight`), not by this module.

A rank that never arrives (it left the loop, or hangs outside MatrixFSDP) makes the others
raise after ``timeout`` seconds (30 s, or the group's timeout if shorter), naming that rank
and where it last was. A check's wait that lasts (the group's ``slow`` threshold of
:mod:`~matrixfsdp.diagnosis.arrival`) is posted to the store by the waiting thread of
:mod:`~matrixfsdp.diagnosis.waiting` (one key per rank, overwritten; nothing for a quick
check); at the timeout the first rank to fail reads every rank's post once and the others
read its finding (:func:`~matrixfsdp.diagnosis.collector.shared`: three store requests a
rank). A rank that did not post the failed check did not arrive; its last collective is
the check before it, which every rank passed with the same signature.
Under HSDP the check runs over every rank of the 2-D mesh (the shard groups and the
replicate groups all pair up by order), once per unit before each phase, the replicate
reduce and broadcast included. Off by default: one small all-reduce (and its host sync)
per collective.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from .._compat import all_gather_single, default_store
from .arrival import SLOW_S, CollectiveTimeout, ranks_text
from .collector import collect_limit_s, ranks_of, read_all, shared, spans
from .timeouts import group_timeout
from .waiting import watchdog

COLLECTIVE_PHASES = ("forward gather", "backward gather", "gradient reduce",
                     "replicate reduce", "replicate broadcast")
FORWARD_GATHER, BACKWARD_GATHER, REDUCE, REPLICATE_REDUCE, REPLICATE_BROADCAST = range(5)
LANES = 5  # step, unit, phase, elements, layout checksum


class CollectiveCheck:
    """Compares ``(step, unit index, phase, elements, layout checksum)`` across the ranks
    of ``group`` (the whole mesh): one all-reduce of ``2 x 5`` int64s per check."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, unit_names: list[str],
                 timeout: float | None = None):
        self.group = group
        self.device = device
        self.unit_names = unit_names
        if timeout is None:  # 30 s, or the group's timeout if shorter (torch's default if unknown)
            limit = group_timeout(group)
            timeout = min(30.0, (limit if limit is not None else default_pg_timeout).total_seconds())
        self.timeout = timeout
        self.slow = min(SLOW_S, timeout / 4)  # a check's wait posted once it lasts this long
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.step = 0  # backward passes completed
        self.count = 0  # checks issued by this rank
        self.last: list[int] | None = None  # the latest check every rank passed alike
        self.store = _store()
        self.key = f"matrixfsdp-debug/{getattr(group, 'group_name', 'world')}/"
        self.behind: list[int] = []

    def describe(self, sig: list[int]) -> str:
        step, unit, phase, numel, digest = sig
        size = f" of {numel} elements, layout {digest:08x}" if numel else ""
        return f"step {step + 1}, unit '{self.unit_names[unit]}', {COLLECTIVE_PHASES[phase]}{size}"  # 1-based

    def __call__(self, unit: int, phase: int, numel: int = 0, digest: int = 0) -> None:
        mine = [self.step, unit, phase, numel, digest]
        self.count += 1
        lanes = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=self.device)
        work = dist.all_reduce(lanes, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        if self.device.type != "cpu":  # NCCL: no timed wait (module docstring)
            work.wait()
            self.compare(mine, lanes)
            return
        count, post = self.count, self._post
        dog = None if work.is_completed() else watchdog()
        entry = dog.enter(self.slow, lambda: post(count, mine)) if dog is not None else None
        t0 = time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 - the backend's own timeout error, re-raised
            # the time actually waited: the group's own timeout may end the wait sooner
            text = self.missing(mine, time.monotonic() - t0)  # names the ranks behind (a hang)
            raise CollectiveTimeout(text, self.behind, self.rank) from e
        finally:
            if dog is not None:
                dog.leave(entry)
        self.compare(mine, lanes)

    def compare(self, mine: list[int], lanes: torch.Tensor) -> None:
        """Raise on every rank if the all-reduced ``lanes`` say the ranks' signatures differ."""
        top, bottom = lanes[:LANES].tolist(), lanes[LANES:].tolist()
        if any(hi != -lo for hi, lo in zip(top, bottom)):
            self.diverged(mine)
        self.last = mine

    def diverged(self, mine: list[int]) -> None:
        """The ranks' signatures differ (every rank learnt it from the same all-reduce): gather
        them (P x 5 values, on this failure only) and raise the same error on every rank."""
        sig = torch.tensor(mine, dtype=torch.int64, device=self.device)
        out = torch.empty(self.world_size * LANES, dtype=torch.int64, device=self.device)
        all_gather_single(out, sig, group=self.group)
        rows = [tuple(r) for r in out.view(self.world_size, LANES).tolist()]
        alike: dict[tuple, list[int]] = {}
        for r, s in enumerate(rows):
            alike.setdefault(s, []).append(r)
        where = "; ".join(f"{ranks_text(rs)}: {self.describe(list(s))}" for s, rs in alike.items())
        raise RuntimeError("matrixfsdp debug: ranks diverged, they are about to issue "
                           f"different collectives ({where}). Every rank must run the same "
                           "sharded modules in the same order each step; a different size "
                           "or layout means the ranks built, shaped or froze the model "
                           "differently (frozen parameters are planned and reduced apart)")

    def _post(self, count: int, sig: list[int]) -> bool:
        """Posted by the waiting thread when a check's wait lasts: this rank reached check
        ``count`` with ``sig``."""
        if self.store is None:
            return False
        self.store.set(self.key + str(self.rank), json.dumps([count, sig]))
        return True

    def missing(self, mine: list[int], waited: float | None = None) -> str:
        """The error after waiting in vain at ``mine`` for ``waited`` seconds (default: the
        configured timeout): the ranks that did not arrive first (where each last was: the
        check before this one, which all passed), then who waited and how long. Sets
        ``behind`` to those ranks."""
        found, _ = shared(self.store, f"{self.key}found/{self.count}", self.rank, self._collect,
                          collect_limit_s(self.world_size, self.slow)) \
            if self.store is not None else (None, None)
        self.behind = [r for r in ranks_of(found["behind"]) if r != self.rank] if found else []
        last = (f"its last collective: {self.describe(self.last)}" if self.last is not None
                else "it never reached a MatrixFSDP collective")
        who = (f"{ranks_text(self.behind)} did not arrive ({last})" if self.behind else
               "some rank never issued this collective" if found else
               "the store could not say which rank did not arrive")
        return (f"matrixfsdp debug: {who}; rank {self.rank} waited "
                f"{self.timeout if waited is None else waited:.1f} s for it at "
                f"{self.describe(mine)} (the rank left the training loop early, or hangs outside "
                "MatrixFSDP)")

    def _collect(self) -> dict:
        """The first failing rank's reading: after ``slow`` (a rank waiting at this check by
        now has posted), every rank's post once; the ranks that did not post this check."""
        time.sleep(self.slow)
        raw = read_all(self.store, [self.key + str(r) for r in range(self.world_size)])
        behind = []
        for r, value in enumerate(raw):
            if r != self.rank and (value is None or json.loads(value)[0] < self.count):
                behind.append(r)
        return {"behind": spans(behind)}


def _store():
    """The default process group's key-value store (None where torch hides it)."""
    try:
        return default_store()
    except Exception:  # noqa: BLE001
        return None
