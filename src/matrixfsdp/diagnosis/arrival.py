"""Which rank did not arrive at a collective that timed out, and where it was last seen,
said without debug mode.

Collectives pair up by order alone. When one rank never issues its part (it hangs, is
slower than the timeout, or left the training loop), the others fail at the process
group's timeout with the backend's own error, which names only their own send or receive
(gloo: ``Timed out waiting 5000ms for send operation to complete``), never the rank that
is missing. To name it, at no cost per collective beyond a counter and a clock read:

* every *point* that a group's ranks pass in the same order is numbered on that group, the
  same number on every rank: each collective the runtime issues on a gloo group (every
  :class:`~matrixfsdp.runtime.collectives.Comm` collective, the training loop's per-step
  gather, the gradient norm: :func:`issued`), each collective a checkpoint drives through
  torch's object collectives (:class:`Point`), and each stretch of local work between
  collectives that someone else issues (DCP's planning, write and read inside a save or a
  load: :class:`LocalWork`);
* a rank posts where it is to the default process group's store only where that is cheap
  or may matter: a wait longer than :data:`SLOW_S` (``waiting``, posted by a watchdog
  thread while the wait blocks, then ``done``), local work (``busy`` when entered,
  ``waiting`` for what follows when left), a checkpoint's collective; a quick runtime
  collective posts nothing;
* the ranks whose waits fail at the same point share one reading of the posts
  (:mod:`~matrixfsdp.diagnosis.collector`; before, each read every peer's: ~5e8 reads of one
  store at 16384 ranks): the first to fail reads them all once (:func:`_collect`), the
  others read its finding, three store requests whatever P. Each judges it with its own
  history: a peer waiting at the same point arrived; one waiting at an earlier point that
  this rank completed (a ring or a reduce completes on some ranks before others) is alive
  and waits for the same rank; one busy in local work, behind, or silent did not arrive.
  Its :class:`CollectiveTimeout` names those ranks, where each was last seen (its own post,
  or the last collective this rank completed with it, whichever is later, with the step
  and phase the loop set: :func:`at`) and the time this rank actually waited, measured.

Only gloo groups: an NCCL ``wait()`` does not block the host (NCCL's watchdog ends a stuck
collective), and a wait with a timeout would make it block. On NCCL the watchdog's flight
record names the rank instead (:mod:`matrixfsdp.diagnosis.flight`, read by the launcher). Debug mode
(:mod:`matrixfsdp.diagnosis.debug`) compares every collective instead.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._compat import default_store
from .collector import collect_limit_s, ranks_of, ranks_text, read_all, shared, spans
from .timeouts import group_timeout
from .waiting import watchdog

SLOW_S = 1.0  # a wait longer than this (or a quarter of the group's timeout) is posted
MAX_LISTED = 32  # ranks a timeout's finding lists with their posts; any more, as spans of ranks
_KEY = "matrixfsdp-wait/"
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> its _Group
_here = threading.local()  # this thread's training step and phase (:func:`at`)
# What a collective says when a peer's process ended: a consequence, not the hang itself.
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "remote process exited", "communicator was aborted",
             "Application timeout caused pair closure")  # gloo: the peer timed out and left


def at(step: int | None = None, phase: str | None = None) -> None:
    """Say where this thread is: the training step and its phase (``matrixfsdp train``'s
    loop says it at each phase: a local write). Every point passed afterwards records it,
    so that a timeout can say where a rank that did not arrive was last seen."""
    _here.step, _here.phase = step, phase


def current_place() -> tuple[int | None, str | None]:
    """This thread's ``(step, phase)`` as :func:`at` last set it."""
    return getattr(_here, "step", None), getattr(_here, "phase", None)


def _at_text(step: int | None, phase: str | None) -> str:
    parts = [p for p in (None if step is None else f"step {step}", phase) if p]
    return f" ({', '.join(parts)})" if parts else ""


class CollectiveTimeout(RuntimeError):
    """A collective that timed out, naming the ranks that did not arrive (``missing``),
    where each was last seen, and the time this rank (``rank``) actually waited. The
    backend's own error is its ``__cause__``."""

    def __init__(self, message: str = "", missing: list[int] | tuple = (), rank: int | None = None,
                 lost: bool = False):
        super().__init__(message)
        # ``lost``: this rank's wait ended because a peer closed its connection (a rank that
        # timed out and left, or one whose process ended), before its own timeout
        self.missing, self.rank, self.lost = list(missing), rank, lost

    def __reduce__(self):
        return type(self), (str(self), self.missing, self.rank, self.lost)


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` (a backend error, or DCP's exception holding every rank's) says a
    wait timed out."""
    return "timed out" in str(exc).lower()


def error_text(exc: BaseException) -> str:
    """The backend error's last line, without gloo's source location."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    return text.split("] ", 1)[-1] if text.startswith("[") else text


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer's process ended under a collective."""
    return any(p in str(exc) for p in LOST_PEER)


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
        self.last: dict | None = None  # the latest point completed here, with every peer in it

    def key(self, rank: int) -> str:
        return f"{_KEY}{self.name}/{rank}"

    def completed(self, index: int, kind: str, place: tuple, local: bool = False) -> None:
        if self.last is None or index > self.last["index"]:
            self.last = {"index": index, "kind": kind, "step": place[0], "phase": place[1],
                         "local": local}

    def post(self, index: int, kind: str, state: str, place: tuple, since: float | None = None,
             local: bool = False) -> bool:
        """Post this rank's place: at point ``index`` (``kind``; ``local`` work or a
        collective), ``state`` one of ``waiting`` (for the collective at that point, or that
        follows the local work), ``done`` or ``busy`` (in the local work)."""
        value = {"index": index, "kind": kind, "state": state, "since": since or time.time(),
                 "step": place[0], "phase": place[1], "local": local}
        try:
            if self.store is None:
                self.store = default_store()
            self.store.set(self.key(self.me), json.dumps(value))
            return True
        except Exception:  # noqa: BLE001 (no store: the timeout will say less)
            return False


def _group(group: dist.ProcessGroup) -> _Group:
    g = _groups.get(group)
    if g is None:
        g = _groups[group] = _Group(group)
    return g


@dataclass
class Watch:
    """One issued collective: its group, its number there, its kind, when it was issued and
    where this thread was (:func:`at`)."""

    group: _Group
    index: int
    kind: str
    issued: float  # time.monotonic()
    wall: float  # time.time(), comparable with a peer's post
    place: tuple = (None, None)


def issued(group: dist.ProcessGroup, kind: str) -> Watch | None:
    """Number the collective of ``kind`` just issued on ``group`` (call it right after the
    issue, in the order the collectives are issued); None unless ``group`` is a gloo group
    of more than one rank. Hand the result to :func:`wait`."""
    g = _group(group)
    if not g.watched:
        return None
    g.count += 1
    return Watch(g, g.count, kind, time.monotonic(), time.time(), current_place())


def wait(work: Any, watch: Watch | None) -> None:
    """``work.wait()``; for a watched gloo collective not over at once, posted ``waiting``
    by the :func:`~matrixfsdp.diagnosis.waiting.watchdog` once it has lasted the group's
    ``slow`` threshold (see the module's docstring). Raises :class:`CollectiveTimeout` when
    the collective timed out."""
    if watch is None or not isinstance(work, dist.Work):
        work.wait()
        return
    g = watch.group
    # a wait not over at once is posted by the watchdog once it lasts (a failed work is over)
    dog = None if work.is_completed() else watchdog()
    entry = dog.enter(g.slow.total_seconds(),
                      lambda: g.post(watch.index, watch.kind, "waiting", watch.place, watch.wall)) \
        if dog is not None else None
    posted = False
    try:
        work.wait()
    except RuntimeError as e:
        found = failure(g, watch.index, f"the {watch.kind} #{watch.index}{_on(g)}", watch.issued,
                        watch.place, e)
        if found is None:
            raise
        raise found from e
    finally:
        if dog is not None:
            posted = dog.leave(entry)
    g.completed(watch.index, watch.kind, watch.place)
    if posted:
        g.post(watch.index, watch.kind, "done", watch.place)


def _on(g: _Group) -> str:
    r = g.ranks
    return f" on ranks {r[0]}-{r[-1]}" if r == list(range(r[0], r[-1] + 1)) else f" on {ranks_text(r)}"


def _last_seen(seen: dict | None, last: dict | None, me: int, work: str | None = None) -> str:
    """Where a rank that did not arrive was last seen: its own post, or the last point this
    rank completed with it, whichever is later. ``work``: the local work this rank left."""
    if seen is not None and (last is None or seen.get("index", 0) >= last["index"]):
        at_ = _at_text(seen.get("step"), seen.get("phase"))
        age = time.time() - float(seen.get("since", time.time()))
        state, kind = seen.get("state"), seen.get("kind")
        if state == "busy" and kind == work:
            return f"still in it after {age:.1f} s"
        if state == "busy":
            return f"last seen in {kind}{at_}, {age:.1f} s before"
        if seen.get("local"):
            return f"last seen {'after' if state == 'waiting' else 'at the end of'} {kind}{at_}"
        return f"last seen {'waiting ' if state == 'waiting' else ''}at the {kind} #{seen.get('index')}{at_}"
    if last is not None:
        what = f"the end of {last['kind']}" if last["local"] else f"the {last['kind']} #{last['index']}"
        return (f"last seen at {what}{_at_text(last['step'], last['phase'])}, the last collective "
                f"rank {me} completed with it")
    return "not seen at any collective of this group"


def _arrived(seen: dict | None, index: int) -> bool:
    """Whether a post says its rank waits or waited at point ``index``, or is past it."""
    i = (seen or {}).get("index", -1)
    return seen is not None and (i > index or (i == index and seen.get("state") in ("waiting", "done")))


def _collect(g: _Group, index: int) -> dict:
    """The collector's reading for point ``index``: after the group's ``slow`` threshold (a
    rank that waited here before this rank's timeout has posted by then), every rank's post,
    read once: the spans of ranks that arrived (this rank among them) and the posts of the
    others (at most :data:`MAX_LISTED`, the rest as spans). O(P) reads, once per point."""
    time.sleep(g.slow.total_seconds())
    raw = read_all(g.store, [g.key(r) for r in g.ranks])
    arrived, others = [], []
    for r, value in zip(g.ranks, raw):
        try:
            seen = json.loads(value) if value is not None else None
        except ValueError:
            seen = None
        if r == g.me or _arrived(seen, index):
            arrived.append(r)
        else:
            others.append([r, seen])
    return {"arrived": spans(arrived), "others": others[:MAX_LISTED],
            "unlisted": spans([r for r, _ in others[MAX_LISTED:]])}


def _finding(g: _Group, index: int, what: str) -> tuple[dict | None, int | None]:
    """:func:`_collect` on the first rank to fail at point ``index``, read by the others."""
    if g.store is None:
        try:
            g.store = default_store()
        except Exception:  # noqa: BLE001 (no store: the timeout says less)
            return None, None
    key = f"{_KEY}{g.name}/found/{index}/{zlib.crc32(what.encode()):08x}"
    return shared(g.store, key, g.me, lambda: _collect(g, index),
                  collect_limit_s(len(g.ranks), g.slow.total_seconds()))


def failure(g: _Group, index: int, what: str, started: float, place: tuple,
            exc: BaseException, work: str | None = None) -> CollectiveTimeout | None:
    """The :class:`CollectiveTimeout` of this rank's wait at point ``index`` (``what`` it
    waited at, since ``time.monotonic()`` ``started``; after leaving local ``work``) that failed
    with ``exc``, from the peers' posts as one rank read them (:func:`_finding`); None where
    ``exc`` is neither a timeout nor a lost peer, or a lost peer with every peer seen (the
    peer that ended is the story). A lost peer with a rank seen stuck in local work names
    that rank; with silent ranks only, it names them, ``lost``: each hangs, or its process
    ended."""
    if not g.watched or not (timed_out(exc) or lost_peer(exc)):
        return None
    waited = time.monotonic() - started
    limit = f"the process group's timeout is {g.timeout:g} s" if g.timeout else "at the backend's timeout"
    found, by = _finding(g, index, what)
    if found is None:
        who = (f"rank {by} was to read where every rank is and did not say in time" if by not in (None, g.me)
               else "where the other ranks are could not be read from the store")
        return CollectiveTimeout(f"{what}{_at_text(*place)} did not complete ({who}); rank {g.me} waited "
                                 f"{waited:.1f} s for it ({limit})", [], g.me)
    missing: list[tuple[int, str]] = []
    elsewhere, behind = [], []
    arrived = [r for r in ranks_of(found["arrived"]) if r != g.me]
    for r, seen in found["others"]:
        if r == g.me:
            continue
        i, state = (seen or {}).get("index", -1), (seen or {}).get("state")
        for_s = f"for {time.time() - float((seen or {}).get('since', 0)):.1f} s"
        if seen is not None and state == "waiting" and (g.last is None or i > g.last["index"]):
            its = (f"the collectives after {seen.get('kind')}" if seen.get("local")
                   else f"its {seen.get('kind')} #{i}")
            elsewhere.append(f"rank {r} waits at another collective ({its}, {for_s})")
        elif seen is not None and state == "waiting" and not seen.get("local"):
            # alive and blocked at an earlier collective this rank already completed (a ring
            # or a reduce completes on some ranks before others): it waits for the rank that
            # hangs too, and is not it
            behind.append((r, f"the {seen.get('kind')} #{i}{_at_text(seen.get('step'), seen.get('phase'))}, "
                              f"{for_s}"))
        else:
            missing.append((r, _last_seen(seen, g.last, g.me, work)))
    unlisted = [r for r in ranks_of(found["unlisted"]) if r != g.me]  # more than MAX_LISTED
    lost = False
    if not timed_out(exc):  # a lost peer: a rank seen stuck in local work is the story
        stuck = [(r, s) for r, s in missing if s.startswith(("last seen in ", "still in it"))]
        if not missing and not unlisted:
            return None
        # else the silent ones: the peer whose process ended, or the one that hangs while
        # the peers that timed out on it left (gloo closes their pairs with this rank)
        lost, missing = not stuck, stuck or missing
        unlisted = [] if stuck else unlisted
    parts = []
    if missing or unlisted:
        ranks = [r for r, _ in missing] + unlisted
        they = "they hang, are" if len(ranks) > 1 else "it hangs, is"
        inside = all(t.startswith(("last seen in ", "still in it")) for _, t in missing) and not unlisted
        why = (f"{'they hang, or their processes' if len(ranks) > 1 else 'it hangs, or its process'} "
               f"ended: this rank lost its connection to a peer ({error_text(exc)})" if lost else
               f"{'they hang, or are' if len(ranks) > 1 else 'it hangs, or is'} slower than the "
               "timeout" if inside else
               f"{they} slower than the timeout, or left the training loop; debug mode says where "
               "each rank is")
        seen_text = "; ".join([f"rank {r} {s}" if len(ranks) > 1 else s for r, s in missing]
                              + ([f"{ranks_text(unlisted)} not listed"] if unlisted else []))
        parts.append(f"{ranks_text(ranks)} did not arrive at {what}{_at_text(*place)}: {seen_text} "
                     f"({why})")
    parts += elsewhere
    if elsewhere:
        parts[-1] += " (the ranks issue different collectives; debug mode says which)"
    if behind:
        parts.append("; ".join(f"rank {r} was last seen waiting at {w}" for r, w in behind)
                     + f", which rank {g.me} completed (waiting for the same rank)")
    if not missing and not unlisted and not elsewhere:
        parts.insert(0, f"{what}{_at_text(*place)} did not complete" if behind else
                     f"every rank arrived at {what}{_at_text(*place)}, but it did not complete")
    parts.append(f"rank {g.me} waited {waited:.1f} s for it ({limit})")
    if arrived:
        parts.append(f"{ranks_text(arrived)} arrived and waited too")
    return CollectiveTimeout("; ".join(parts), [r for r, _ in missing] + unlisted, g.me, lost=lost)


class Point:
    """A collective every rank of ``group`` runs that the runtime does not issue itself
    (torch's object collectives, a checkpoint's commit): numbered, posted as ``waiting``
    when entered and ``done`` when left; a timeout inside raises the
    :class:`CollectiveTimeout` naming the ranks that did not arrive. A context manager."""

    def __init__(self, group: dist.ProcessGroup, kind: str):
        self.g = _group(group)
        self.kind, self.place = kind, current_place()
        if self.g.watched:
            self.g.count += 1
        self.index = self.g.count

    def __enter__(self) -> Point:
        self.started = time.monotonic()
        if self.g.watched:
            self.g.post(self.index, self.kind, "waiting", self.place)
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if not self.g.watched:
            return False
        if exc is None:
            self.g.completed(self.index, self.kind, self.place)
            self.g.post(self.index, self.kind, "done", self.place)
            return False
        if isinstance(exc, Exception):
            found = failure(self.g, self.index, f"the {self.kind} #{self.index}{_on(self.g)}",
                            self.started, self.place, exc)
            if found is not None:
                raise found from exc
        return False


class LocalWork:
    """A stretch of local work that runs between collectives someone else issues (a rank's
    planning, write or read inside DCP's save or load), posted ``busy`` when it starts
    (:meth:`enter`) and ``waiting`` when it ends (:meth:`leave`: the rank now waits in the
    collectives that follow), on a watched gloo group. Every rank enters its local work in
    the same order as its collectives, so each is numbered like them; a ``solo`` one is one
    rank's (DCP's coordinator) and takes the number of the point before it. A peer whose
    collective after it fails at the timeout names the ranks still inside local work, or
    behind (:meth:`failure`). (Not a pipeline stage: that is
    :class:`matrixfsdp.advisor.model_shapes.Stage`.)"""

    def __init__(self, group: dist.ProcessGroup, kind: str, solo: bool = False,
                 place: tuple | None = None):
        self.g, self.kind, self.solo = _group(group), kind, solo
        self.place = place if place is not None else current_place()
        self.index, self.left = self.g.count, None

    def enter(self) -> LocalWork:
        if self.g.watched:
            if not self.solo:
                self.g.count += 1
            self.index = self.g.count
            self.g.post(self.index, self.kind, "busy", self.place, local=True)
        return self

    def leave(self) -> None:
        self.left = time.monotonic()
        if self.g.watched:
            self.g.post(self.index, self.kind, "waiting", self.place, local=True)

    def done(self) -> None:
        """The collectives that follow the local work completed (the DCP call returned): posted,
        so that a later timeout does not take this rank for one still waiting there."""
        if self.g.watched:
            self.g.completed(self.index, self.kind, self.place, local=True)
            self.g.post(self.index, self.kind, "done", self.place, local=True)

    def __enter__(self) -> LocalWork:
        return self.enter()

    def __exit__(self, *exc) -> None:
        self.leave()

    def failure(self, exc: BaseException) -> CollectiveTimeout | None:
        """After this rank left the local work, a collective that follows it failed with
        ``exc``: the :class:`CollectiveTimeout` naming the ranks still inside local work or
        behind, and the time this rank waited since leaving; None if ``exc`` is no timeout."""
        if self.left is None:
            return None
        return failure(self.g, self.index, f"the end of {self.kind}", self.left, self.place, exc,
                       self.kind)
