"""A thread that says a wait is still waiting, while the waiting thread blocks.

:func:`matrixfsdp.diagnosis.arrival.wait` posts ``waiting`` for a gloo collective that has
lasted longer than its group's ``slow`` threshold, so that a peer that times out can tell
a rank waiting with it from one that never arrived. It cannot do so itself with
``work.wait(timeout)``: some gloo works ignore that timeout and block to the group's own
(``reduce_scatter_tensor``'s: a 1 s wait returned after the group's 6 s, here), and the
rank would post nothing before it failed. So the waiting thread registers its wait here
(a lock and a set insert), blocks in ``work.wait()``, and leaves; one daemon thread per
process, started at the first wait that is not over at once, posts for each wait past its
deadline. The post runs under the same lock as :meth:`Watchdog.leave`, so a ``waiting``
post never lands after the ``done`` that the waiting thread posts when its wait is over.
Debug mode's check (:mod:`matrixfsdp.diagnosis.debug`) posts a lasting wait the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Waiting:
    """One wait in progress: ``post()`` is called once it is past ``deadline``
    (``time.monotonic()``); ``posted``: what it returned."""

    __slots__ = ("deadline", "post", "posted")

    def __init__(self, deadline: float, post: Callable[[], bool]):
        self.deadline, self.post, self.posted = deadline, post, False


class Watchdog:
    """The thread that posts each :class:`Waiting` once past its deadline."""

    def __init__(self):
        self.cond = threading.Condition()
        self.waits: set[Waiting] = set()
        self.wakes_at: float | None = None  # the thread's next deadline; None: asleep for good
        threading.Thread(target=self._run, name="matrixfsdp-waiting", daemon=True).start()

    def enter(self, seconds: float, post: Callable[[], bool]) -> Waiting:
        """A wait starts: ``post()`` if it lasts ``seconds``. The thread is woken only if it
        would otherwise wake too late (about once per ``seconds`` while waits keep coming)."""
        entry = Waiting(time.monotonic() + seconds, post)
        with self.cond:
            self.waits.add(entry)
            if self.wakes_at is None or entry.deadline < self.wakes_at:
                self.wakes_at = entry.deadline
                self.cond.notify()
        return entry

    def leave(self, entry: Waiting) -> bool:
        """The wait is over; whether it was posted."""
        with self.cond:
            self.waits.discard(entry)
            return entry.posted

    def _run(self) -> None:
        with self.cond:
            while True:
                now = time.monotonic()
                self.wakes_at = self._post_due(now)
                self.cond.wait(timeout=None if self.wakes_at is None else self.wakes_at - now)

    def _post_due(self, now: float) -> float | None:
        """Post the waits past their deadline; the next deadline. Apart from :meth:`_run` so
        that the sleeping thread holds no wait: a wait's ``post`` may hold a process group
        (and its store), which must go when the caller lets it go, not at the next wake."""
        pending = [w for w in self.waits if not w.posted]
        for w in pending:
            if w.deadline <= now:
                try:
                    w.posted = w.post()
                except Exception:  # noqa: BLE001 (a post that fails says less; the thread goes on)
                    w.posted = True  # not retried
        later = [w.deadline for w in pending if w.deadline > now]
        return min(later) if later else None


_watchdog: Watchdog | None = None


def watchdog() -> Watchdog:
    """This process's :class:`Watchdog`, started at the first call."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog()
    return _watchdog
