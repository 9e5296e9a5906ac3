"""DCP's saves and loads as this library runs them: each rank's parts posted as local work
(:mod:`~matrixfsdp.runtime.arrival`), so that a hang names its rank, and a file that cannot
be read named by the load.

``torch.distributed.checkpoint`` issues its own collectives (a gather of the plans to the
coordinator and a scatter back, then a gather of the results), and when one of them times
out, the backend's error names no rank. The writer, reader and planners here are DCP's
own classes with each rank's local part of a save or load wrapped in an
:class:`~matrixfsdp.runtime.arrival.LocalWork` on the call's group (:class:`Watched`): the
planning (from the planner's set-up, or the metadata read, to the storage's local plan),
the coordinator's global planning, the write and the coordinator's metadata write, the
read. A rank whose DCP collective then fails at the timeout names the ranks still inside
their local work, or behind, and where each was last seen (:meth:`Watched.failure`). Only gloo
groups are watched (:mod:`matrixfsdp.runtime.arrival`).

The reader reads file by file, so that a file that cannot be read (missing, truncated,
another checkpoint's) is named with what went wrong, instead of a bare unpickling or zip
error from inside torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.futures import Future

from ..runtime import arrival
from ..runtime.arrival import CollectiveTimeout
from .integrity import CheckpointError, CheckpointTimeout, error_line, mark_file


class Watched:
    """The local work of one DCP call about ``what`` (a checkpoint's path) on ``group`` (None:
    the world). Where this thread was when it was made (:func:`~matrixfsdp.runtime.arrival.at`)
    goes with every part, also those that DCP runs in its background thread."""

    def __init__(self, group, what: str):
        self.on = dist.is_available() and dist.is_initialized()
        self.group = (group if group is not None else dist.group.WORLD) if self.on else None
        self.what, self.place = what, arrival.current_place()
        self.work: arrival.LocalWork | None = None

    def enter(self, kind: str, solo: bool = False) -> None:
        """Enter the local work ``kind`` (again: nothing, while inside it)."""
        if not self.on:
            return
        full = f"{kind} of {self.what}"
        if self.work is not None and self.work.kind == full and self.work.left is None:
            return
        self.work = arrival.LocalWork(self.group, full, solo, self.place).enter()

    def leave(self) -> None:
        if self.work is not None and self.work.left is None:
            self.work.leave()

    @contextlib.contextmanager
    def part(self, kind: str, solo: bool = False):
        self.enter(kind, solo)
        try:
            yield
        finally:
            self.leave()

    def done(self) -> None:
        """The DCP call returned: every collective that followed the last local work completed."""
        if self.work is not None:
            self.work.done()

    def failure(self, exc: BaseException) -> CollectiveTimeout | None:
        """The :class:`~matrixfsdp.runtime.arrival.CollectiveTimeout` of a DCP collective
        that failed with ``exc`` after this rank's last local work, or None (no timeout)."""
        return self.work.failure(exc) if self.work is not None else None


class SaveWriter(dcp.FileSystemWriter):
    """DCP's file writer; the end of this rank's planning, its write and the coordinator's
    metadata write are local work of ``watched``."""

    def __init__(self, path: Path, watched: Watched, **kwargs):
        super().__init__(str(path), **kwargs)
        self.watched = watched

    def prepare_local_plan(self, plan):
        plan = super().prepare_local_plan(plan)
        self.watched.leave()  # DCP's planning on this rank is done: the plan gather follows
        return plan

    def write_data(self, plan, planner):
        with self.watched.part("writing its part"):
            written = super().write_data(plan, planner)  # done when it returns
            for name in sorted({r.storage_data.relative_path for r in written.value()}):
                mark_file(Path(str(self.path)) / name)
            return written

    def finish(self, metadata, results) -> None:
        with self.watched.part("writing DCP's metadata (the coordinator)", solo=True):
            super().finish(metadata, results)


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner; this rank's planning starts at its set-up, and the
    coordinator's global planning is local work of ``watched``."""

    def __init__(self, watched: Watched):
        super().__init__()
        self.watched = watched

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.watched.enter("DCP's save planning")
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_global_plan(self, all_plans):
        with self.watched.part("DCP's global save planning (the coordinator)", solo=True):
            return super().create_global_plan(all_plans)


class LoadReader(dcp.FileSystemReader):
    """DCP's file reader; this rank's planning starts at the metadata read, and its read is
    local work of ``watched``. It reads file by file: a file that cannot be read raises a
    :class:`~matrixfsdp.state.integrity.CheckpointError` naming it and what went wrong."""

    def __init__(self, path: Path, watched: Watched):
        super().__init__(str(path))
        self.watched = watched

    def read_metadata(self, *args, **kwargs):
        self.watched.enter("DCP's load planning")
        return super().read_metadata(*args, **kwargs)

    def prepare_local_plan(self, plan):
        plan = super().prepare_local_plan(plan)
        self.watched.leave()
        return plan

    def read_data(self, plan, planner) -> Future:
        with self.watched.part("reading its part"):
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, items in per_file.items():
                try:
                    super().read_data(dataclasses.replace(plan, items=items), planner)
                except FileNotFoundError as e:
                    raise CheckpointError(f"checkpoint {self.path}: {name} is missing (DCP's "
                                          ".metadata lists it)") from e
                except Exception as e:  # noqa: BLE001 (named, then raised on every rank by DCP)
                    # torch.load's refusal of bytes that are no tensor data advises loading
                    # them with weights_only=False: never repeated for a damaged file
                    why = (f"{type(e).__name__}: its bytes are not tensor data torch.load can read"
                           if isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e)
                           else error_line(e))
                    raise CheckpointError(
                        f"checkpoint {self.path}: {name} is damaged: reading it failed "
                        f"({why}); it was truncated, overwritten or swapped with "
                        "another file after the save") from e
        done: Future = Future()
        done.set_result(None)
        return done


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; the coordinator's global planning is local work of
    ``watched``."""

    def __init__(self, watched: Watched):
        super().__init__()
        self.watched = watched

    def create_global_plan(self, global_plan):
        with self.watched.part("DCP's global load planning (the coordinator)", solo=True):
            return super().create_global_plan(global_plan)


def read_error(exc: BaseException) -> CheckpointError | None:
    """The :class:`~matrixfsdp.state.integrity.CheckpointError` a rank's read raised, out of
    DCP's exception that carries every rank's failure (the same one on every rank)."""
    failures = getattr(exc, "failures", None) or {}
    for rank in sorted(failures):
        pair = failures[rank]
        e = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(e, CheckpointError):
            return e
    return exc if isinstance(exc, CheckpointError) else None


def load(state: dict, path: Path, process_group=None) -> None:
    """``dcp.load(state)`` from directory ``path`` with the reader and planner above: a rank
    that hangs is named (a :class:`~matrixfsdp.state.integrity.CheckpointTimeout` saying
    where it was last seen), a file that cannot be read is named (a
    :class:`~matrixfsdp.state.integrity.CheckpointError`, the same on every rank)."""
    watched = Watched(process_group, str(path))
    try:
        dcp.load(state, storage_reader=LoadReader(path, watched), planner=LoadPlanner(watched),
                 process_group=process_group)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
            raise  # KeyboardInterrupt, SystemExit
        named = read_error(e)
        if named is not None:
            raise CheckpointError(str(named)) from e
        hung = watched.failure(e)
        if hung is not None:
            raise CheckpointTimeout(f"matrixfsdp.load_checkpoint: loading {path} timed out: {hung}",
                                    hung.missing, hung.rank) from e
        raise
    watched.done()


def load_alone(state: dict, path: Path) -> None:
    """``dcp.load(state)`` from ``path`` in this process alone (no process group: the
    launcher reading a checkpoint's own entries), a file that cannot be read named, and any
    other failure said as a :class:`~matrixfsdp.state.integrity.CheckpointError` naming the
    checkpoint."""
    try:
        dcp.load(state, storage_reader=LoadReader(path, Watched(None, str(path))), no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
            raise
        named = read_error(e)
        raise CheckpointError(str(named) if named is not None else
                              f"checkpoint {path} cannot be read: {error_line(e)}") from e
