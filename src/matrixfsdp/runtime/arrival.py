"""Which rank did not arrive at a collective that timed out, said without debug mode.

Collectives pair up by order alone. When one rank never issues its part (it hangs, is
slower than the timeout, or left the training loop), the others fail at the process
group's timeout with the backend's own error, which names only their own send or receive
(gloo: ``Timed out waiting 5000ms for send operation to complete``), never the rank that
is missing. To name it, at no cost per collective beyond a counter and a clock read:

* each collective the runtime issues on a gloo group (every
  :class:`~matrixfsdp.runtime.collectives.Comm` collective, and the training loop's
  per-step gather) is numbered when issued: the n-th on its group is the same collective
  on every rank, since collectives pair by order;
* its wait runs in two parts: a wait that lasts longer than :data:`SLOW_S` posts
  ``(n, kind, when it was issued)`` under this rank to the default process group's store
  (one write, only for a slow wait; one more when it ends);
* a rank whose wait fails at the timeout reads every peer's post: a peer waiting at the
  same collective arrived; one not waiting, or waiting at another collective, did not.
  Its :class:`CollectiveTimeout` names those ranks and the time it actually waited,
  measured from the issue (not the configured timeout).

Only gloo groups: an NCCL ``wait()`` does not block the host (NCCL's watchdog ends a stuck
collective), and a wait with a timeout would make it block. Debug mode
(:mod:`matrixfsdp.runtime.debug`) compares every collective instead.
"""

from __future__ import annotations

import json
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .process_groups import group_timeout

SLOW_S = 1.0  # a wait longer than this (or a quarter of the group's timeout) is posted
_KEY = "matrixfsdp-wait/"
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> its _Group


class CollectiveTimeout(RuntimeError):
    """A collective that timed out, naming the ranks that did not arrive at it and the time
    this rank actually waited. The backend's own error is its ``__cause__``."""


class _Group:
    """One gloo group's numbering and facts, made once per group."""

    def __init__(self, group: dist.ProcessGroup):
        self.count = 0
        self.ranks = dist.get_process_group_ranks(group)
        self.watched = len(self.ranks) > 1 and dist.get_backend(group) == "gloo"
        self.name = str(getattr(group, "group_name", "") or "world")
        self.me = dist.get_rank()
        limit = group_timeout(group)
        self.timeout = limit.total_seconds() if limit is not None else None
        self.slow = timedelta(seconds=min(SLOW_S, self.timeout / 4) if self.timeout else SLOW_S)
        self.store: Any = None

    def key(self, rank: int) -> str:
        return f"{_KEY}{self.name}/{rank}"

    def post(self, value: dict) -> bool:
        try:
            if self.store is None:
                self.store = dist.distributed_c10d._get_default_store()
            self.store.set(self.key(self.me), json.dumps(value))
            return True
        except Exception:  # noqa: BLE001 (no store: the timeout will say less)
            return False

    def read(self, rank: int) -> dict | None:
        try:
            if self.store is None or not self.store.check([self.key(rank)]):
                return None
            return json.loads(self.store.get(self.key(rank)))
        except Exception:  # noqa: BLE001 (a store that cannot answer: say what we know)
            return None


@dataclass
class Watch:
    """One issued collective: its group, its number there, its kind, when it was issued."""

    group: _Group
    index: int
    kind: str
    issued: float  # time.monotonic()
    wall: float  # time.time(), comparable with a peer's post


def _group(group: dist.ProcessGroup) -> _Group:
    g = _groups.get(group)
    if g is None:
        g = _groups[group] = _Group(group)
    return g


def issued(group: dist.ProcessGroup, kind: str) -> Watch | None:
    """Number the collective of ``kind`` just issued on ``group`` (call it right after the
    issue, in the order the collectives are issued); None unless ``group`` is a gloo group
    of more than one rank. Hand the result to :func:`wait`."""
    g = _group(group)
    if not g.watched:
        return None
    g.count += 1
    return Watch(g, g.count, kind, time.monotonic(), time.time())


def wait(work: Any, watch: Watch | None) -> None:
    """``work.wait()``; for a watched gloo collective, in two parts (see the module's
    docstring). Raises :class:`CollectiveTimeout` when the collective timed out."""
    if watch is None or not isinstance(work, dist.Work):
        work.wait()
        return
    try:
        work.wait(timeout=watch.group.slow)
        return
    except RuntimeError:
        pass  # still running ("Operation timed out!"), or failed: the full wait says which
    posted = not work.is_completed() and watch.group.post(
        {"index": watch.index, "kind": watch.kind, "since": watch.wall, "waiting": True})
    try:
        work.wait()
    except RuntimeError as e:
        if "timed out" not in str(e).lower():
            raise
        raise CollectiveTimeout(explain(watch)) from e
    if posted:
        watch.group.post({"index": watch.index, "kind": watch.kind, "since": watch.wall,
                          "waiting": False})


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def explain(watch: Watch) -> str:
    """Why ``watch``'s collective timed out, from the peers' posts: who did not arrive,
    who waits elsewhere, who arrived; and how long this rank waited."""
    g = watch.group
    waited = time.monotonic() - watch.issued
    missing, elsewhere, arrived = [], [], []
    for r in g.ranks:
        if r == g.me:
            continue
        seen = g.read(r)
        if seen is None or not seen.get("waiting"):
            missing.append(r)
        elif seen.get("index") == watch.index:
            arrived.append(r)
        else:
            elsewhere.append(f"rank {r} waits at another collective (its {seen.get('kind')} "
                             f"#{seen.get('index')}, for {time.time() - seen.get('since', 0):.1f} s)")
    limit = f"the process group's timeout is {g.timeout:g} s" if g.timeout else "at the backend's timeout"
    what = f"the {watch.kind} #{watch.index} on ranks {g.ranks[0]}-{g.ranks[-1]}" \
        if g.ranks == list(range(g.ranks[0], g.ranks[-1] + 1)) else \
        f"the {watch.kind} #{watch.index} on {_ranks(g.ranks)}"
    parts = []
    if missing:
        they = "they hang, are" if len(missing) > 1 else "it hangs, is"
        parts.append(f"{_ranks(missing)} did not arrive at {what} ({they} slower than the "
                     "timeout, or left the training loop; debug mode says where each rank is)")
    parts += elsewhere
    if elsewhere:
        parts[-1] += " (the ranks issue different collectives; debug mode says which)"
    if not parts:
        parts.append(f"every rank arrived at {what}, but it did not complete")
    parts.append(f"rank {g.me} waited {waited:.1f} s for it ({limit})")
    if arrived:
        parts.append(f"{_ranks(arrived)} arrived and waited too")
    return "; ".join(parts)


class Stage:
    """A stretch of local work that runs between collectives someone else issues (each
    rank's write of its files inside DCP's save, between DCP's planning and its gather of
    the results), posted when it starts and when it ends on a watched gloo group. A peer
    whose next collective times out then names the ranks still inside the stage
    (:meth:`explain`), where the backend's error names none."""

    def __init__(self, group: dist.ProcessGroup, kind: str):
        g = _group(group)
        self.group, self.kind, self.left = g, kind, None
        if g.watched:
            g.count += 1  # every rank enters its stages in the same order as its collectives
        self.index = g.count

    def __enter__(self) -> Stage:
        self._post(busy=True)
        return self

    def __exit__(self, *exc) -> None:
        self.left = time.monotonic()
        self._post(busy=False)

    def _post(self, busy: bool) -> None:
        if self.group.watched:
            self.group.post({"index": self.index, "kind": self.kind, "since": time.time(),
                             "waiting": False, "busy": busy})

    def explain(self) -> str | None:
        """After this rank left the stage and a later collective timed out: the ranks still
        inside it and the time this rank waited since leaving it; None if no rank is."""
        g = self.group
        if not g.watched or self.left is None:
            return None
        inside = [r for r in g.ranks if r != g.me and (seen := g.read(r)) is not None
                  and seen.get("index") == self.index and seen.get("busy")]
        if not inside:
            return None
        limit = f"the process group's timeout of {g.timeout:g} s" if g.timeout else "the timeout"
        they = "their" if len(inside) > 1 else "its"
        return (f"{_ranks(inside)} did not finish {self.kind} ({they} storage hangs, or is "
                f"slower than {limit}); rank {g.me} waited {time.monotonic() - self.left:.1f} s "
                "for it after finishing its own")
