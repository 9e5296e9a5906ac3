"""Ending a rank process without racing torch's gloo worker threads.

Every ``backward()`` stashes a Python object (a ``contextvars`` context) in torch's
thread-local state, and each collective issued during backward copies that state into its
gloo work. The last reference to a finished work is often dropped by a gloo worker thread,
which then takes the GIL to release the Python object. If the main thread is finalizing the
interpreter at that moment, CPython ends the worker thread inside a ``noexcept`` destructor
and the process aborts with "terminate called without an active exception", after all of
its work is done (core dump: ``ProcessGroupGloo::runLoop`` -> ``~AsyncWork`` ->
``~ThreadLocalState`` -> ``take_gil`` -> ``pthread_exit``; seen with torch 2.13). A work's
output tensors do the same when their Python objects outlive it (``~AsyncWork`` ->
``TensorImpl::decref_pyobject`` -> ``take_gil``: a ``dcp.save``'s broadcast). Any gloo
job whose group outlives ``dist.destroy_process_group()`` into finalization (a mesh holds
it) is exposed, FSDP2's included (docs/troubleshooting.md, "A rank aborts at exit"). A rank
that has finished and flushed its output leaves through :func:`exit_rank`, which skips
finalization, so the race cannot happen.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from .._compat import run_exit_handlers


def exit_rank(code: int = 0) -> NoReturn:
    """End this process now with ``code``: run the ``atexit`` handlers (multiprocessing's
    semaphore cleanup, logging's flush, ...), flush stdout/stderr, then ``os._exit``.
    The handlers run before finalization starts, as in a normal exit, so the race above
    cannot occur in them."""
    run_exit_handlers()  # CPython's own exit path, minus the finalization
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to keep
            pass
    os._exit(code)
