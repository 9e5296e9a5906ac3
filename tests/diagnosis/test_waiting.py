"""The waiting thread (:mod:`matrixfsdp.diagnosis.waiting`) lets go of a wait once it is over.

A wait's ``post`` holds what it reports on (a process group and its store). A thread that
kept the last waits it looked at while asleep kept a destroyed group's store alive until its
next wake; collected then, a ``FileStore`` whose rendezvous file was gone aborted the process
(``c10::DistStoreError`` thrown from its destructor: seen as a rank dying mid-suite)."""

from __future__ import annotations

import gc
import time
import weakref

from matrixfsdp.diagnosis.waiting import Watchdog


class _Held:
    """Stands for the process group a post refers to."""


def test_a_posted_wait_is_not_kept_alive_by_the_sleeping_thread():
    dog = Watchdog()
    held = _Held()
    alive = weakref.ref(held)
    entry = dog.enter(0.01, lambda held=held: True)
    deadline = time.monotonic() + 10
    while not entry.posted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.leave(entry), "the wait was never posted"
    del entry, held
    time.sleep(0.05)  # the thread has posted and gone back to sleep, with no deadline left
    gc.collect()
    assert alive() is None, "the sleeping thread still holds the wait's post"
