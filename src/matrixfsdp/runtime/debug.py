"""Debug mode: every rank checks that all ranks are about to issue the same collective.

Collectives pair up by order alone, so ranks that take different paths through the model
(one skips a block, one stops early) either hang until the process group's timeout or,
worse, pair a gather of one unit with a gather of another. With ``fully_shard(root,
debug=True)`` each gather and reduce is preceded by a tiny all-gather of the signature
``(step, unit, phase, elements, layout)`` (the collective's size and a checksum of where
each parameter's pieces live: these differ when ranks built, shaped or froze the model
differently, since frozen parameters are planned and reduced differently); every rank
compares all signatures and raises the same error, naming each rank's position, when they
differ, and raises after ``timeout`` seconds (30 s, or the group's timeout if shorter) when
some rank never arrives, naming that rank and where it last was: each rank also posts its
latest signature to the process group's store, which the waiting rank reads. Off by
default: it adds one small collective (and one store write) per collective.
Under HSDP the check runs over every rank of the 2-D mesh (the shard groups and the
replicate groups all pair up by order), once per unit before each phase, the replicate
reduce and broadcast included.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from .._compat import default_store
from .arrival import CollectiveTimeout
from .collectives import all_gather_single
from .process_groups import group_timeout

COLLECTIVE_PHASES = ("forward gather", "backward gather", "gradient reduce",
                     "replicate reduce", "replicate broadcast")
FORWARD_GATHER, BACKWARD_GATHER, REDUCE, REPLICATE_REDUCE, REPLICATE_BROADCAST = range(5)


class CollectiveCheck:
    """Compares ``(step, unit index, phase, elements, layout checksum)`` across the ranks
    of ``group`` (the whole mesh)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, unit_names: list[str],
                 timeout: float | None = None):
        self.group = group
        self.device = device
        self.unit_names = unit_names
        if timeout is None:  # 30 s, or the group's timeout if shorter (torch's default if unknown)
            limit = group_timeout(group)
            timeout = min(30.0, (limit if limit is not None else default_pg_timeout).total_seconds())
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.step = 0  # backward passes completed
        self.count = 0  # checks issued by this rank
        self.store = _store()
        self.key = f"matrixfsdp-debug/{getattr(group, 'group_name', 'world')}/"

    def describe(self, sig: list[int]) -> str:
        step, unit, phase, numel, digest = sig
        size = f" of {numel} elements, layout {digest:08x}" if numel else ""
        return f"step {step + 1}, unit '{self.unit_names[unit]}', {COLLECTIVE_PHASES[phase]}{size}"  # 1-based

    def __call__(self, unit: int, phase: int, numel: int = 0, digest: int = 0) -> None:
        mine = [self.step, unit, phase, numel, digest]
        self.count += 1
        if self.store is not None:
            self.store.set(self.key + str(self.rank), json.dumps([self.count, mine]))
        sig = torch.tensor(mine, dtype=torch.int64, device=self.device)
        out = torch.empty(self.world_size * len(mine), dtype=torch.int64, device=self.device)
        work = all_gather_single(out, sig, group=self.group, async_op=True)
        t0 = time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 - the backend's own timeout error, re-raised
            # the time actually waited: the group's own timeout may end the wait sooner
            text = self.missing(mine, time.monotonic() - t0)  # names the ranks behind (a hang)
            raise CollectiveTimeout(text, self.behind, self.rank) from e
        rows = out.view(self.world_size, len(mine)).tolist()
        if any(r != rows[0] for r in rows):
            where = "; ".join(f"rank {r}: {self.describe(s)}" for r, s in enumerate(rows))
            raise RuntimeError("matrixfsdp debug: ranks diverged, they are about to issue "
                               f"different collectives ({where}). Every rank must run the same "
                               "sharded modules in the same order each step; a different size "
                               "or layout means the ranks built, shaped or froze the model "
                               "differently (frozen parameters are planned and reduced apart)")

    def missing(self, mine: list[int], waited: float | None = None) -> str:
        """The error after waiting in vain at ``mine`` for ``waited`` seconds (default: the
        configured timeout): the ranks that did not arrive first (where each last was, from
        the store), then who waited and how long."""
        behind, self.behind = [], []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            seen = self._posted(r)
            if seen is None:
                behind.append(f"rank {r} never reached a MatrixFSDP collective")
            elif seen[0] < self.count:
                behind.append(f"rank {r} did not arrive (its last collective: {self.describe(seen[1])})")
            self.behind += [r] if seen is None or seen[0] < self.count else []
        who = "; ".join(behind) or "some rank never issued this collective"
        return (f"matrixfsdp debug: {who}; rank {self.rank} waited "
                f"{self.timeout if waited is None else waited:.1f} s for it at "
                f"{self.describe(mine)} (the rank left the training loop early, or hangs outside "
                "MatrixFSDP)")

    def _posted(self, rank: int) -> tuple[int, list[int]] | None:
        key = self.key + str(rank)
        try:
            if self.store is None or not self.store.check([key]):
                return None
            count, sig = json.loads(self.store.get(key))
            return int(count), sig
        except Exception:  # noqa: BLE001 (a store that cannot answer: say what we know)
            return None


def _store():
    """The default process group's key-value store (None where torch hides it)."""
    try:
        return default_store()
    except Exception:  # noqa: BLE001
        return None
