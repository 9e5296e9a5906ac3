"""Counting the collectives a stretch of code issues, with torch's profiler.

Every process-group collective is a profiler event on whichever thread runs it ("gloo:..."
or "nccl:..." from the backend, ``record_param_comms`` from c10d, ``c10d::`` ops from
functional collectives and DTensor). The profiler runs only around what is counted: the
optimizer steps, and a stretch where the model does communicate (a forward), which shows
the count sees this setting's collectives. Profiling a whole run instead was most of the
suite's CPU: turning each recorded op into a Python event costs about 45 us, more than the
small models' training itself (a run of 10 steps records tens of thousands of ops). For the
same reason the names are read from the profiler's own records (``kineto_results``), never
through ``prof.events()``, which builds a ``FunctionEvent`` and its tree for every op: 21x
less CPU for the same names (4504 events: 0.50 s against 0.024 s), and what had been 8% of
the suite's samples.

    counted = Collectives()
    with counted.during("forward", step == 0):  # one forward shows the count works
        loss = model(x)
    loss.backward()
    with counted.during("step"):
        opt.step()
    assert counted["step"] == 0 and counted["forward"] > 0

A window does not close while the library's collectives issued in it are still in flight
(:func:`_settled`): it waits for them to complete, or fails naming them.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter

from torch.profiler import ProfilerActivity, profile

from matrixfsdp.runtime.collectives import in_flight

PREFIXES = ("gloo:", "nccl:", "c10d::", "record_param_comms")


def count(prof) -> int:
    """The collectives a finished ``torch.profiler.profile`` recorded."""
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:  # a torch without it: the same names, slower
        return sum(e.name.startswith(PREFIXES) for e in prof.events())
    return sum(e.name().startswith(PREFIXES) for e in results.events())


class Collectives(Counter):
    """Collectives counted per named stretch of code (0 for a name never counted)."""

    @contextlib.contextmanager
    def during(self, name: str, counting: bool = True, settle_s: float = 10.0):
        """Count the collectives of the ``with`` body under ``name`` (when ``counting``);
        the library's collectives issued in it must complete within ``settle_s`` after it."""
        if not counting:
            yield
            return
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
            _settled(name, settle_s)
        self[name] += count(prof)


def _settled(name: str, limit_s: float = 10.0) -> None:
    """Before a window closes: the library's collectives issued in it have completed (they
    are given ``limit_s``), or this fails naming them. torch's profiler stopped while one
    was in flight (QK-clip's gloo all-reduce) corrupted a rank's heap: gloo's worker thread
    wrote the op's profiler record after the profiler had stopped (docs/design.md)."""
    deadline = time.monotonic() + limit_s
    while (left := in_flight()) and time.monotonic() < deadline:
        time.sleep(0.005)
    if left:
        raise AssertionError(
            f"the profiler window {name!r} closes while the library's collectives {left} are "
            "still in flight: end it after they are waited for (torch's profiler stopping "
            "while gloo's worker thread records them corrupts the process)")
