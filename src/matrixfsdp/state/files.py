"""Checkpoint directories that are complete or ignored, written with
``torch.distributed.checkpoint`` (DCP).

* :func:`save_checkpoint`: every rank writes into a temporary directory; rank 0 adds the
  ``COMPLETE`` marker and renames it once every rank is done; ``async_save=True`` stages to
  CPU and writes and commits in the background.
* :func:`latest_checkpoint` / :func:`is_complete`: find the newest complete one.
* :func:`load_checkpoint`: a damaged checkpoint refused naming the file, before anything
  is loaded; each rank checks and opens the files it reads, one rank reads the index.

Every collective of a save and a load is an arrival point (:mod:`matrixfsdp.diagnosis.arrival`,
DCP's own through :mod:`.dcp_io`): a rank that hangs in one is named by the others, with
where it was last seen.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..diagnosis import arrival
from ..diagnosis.agree import broadcast_object
from ..diagnosis.timeouts import twin_group
from . import dcp_io
from .dcp_io import SavePlanner, SaveWriter, Watched
from .integrity import (
    CHECKSUMS,
    COMPLETE,
    METADATA,
    CheckpointError,
    gather_digests,
    write_checksums,
    write_failure,
)
from .staging import RowShardStager
from .state_dict import get_state_dict, set_state_dict

# ---- complete-or-ignored checkpoint directories ---------------------------------------------
_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    """``root/step_00000042``: where :func:`save_checkpoint` puts step 42 by convention."""
    return Path(root) / f"step_{step:08d}"


@dataclass
class SavedCheckpoint:
    path: Path
    seconds: float  # wall time of the save on this rank, from the call to the commit
    bytes: int  # bytes written by all ranks (files in the directory)
    blocking_seconds: float | None = None  # of which the call held the caller (all of it if sync)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _on_rank0(fn: Callable[[], Any], group, what: str) -> Any:
    """``fn()`` on rank 0 of ``group``, its result (or its error) handed to every rank: one
    rank's failure (an unwritable directory, a full disk) raises the same error on every
    rank instead of leaving the others in the next collective. Also a barrier. A
    :class:`CheckpointError` of ``fn`` is raised as it is (its message is for the user)."""
    if not dist.is_initialized():
        return fn()
    group = group if group is not None else dist.group.WORLD
    told = arrival.Point(group, f"broadcast of {what}")  # numbered on every rank
    info: list[Any] = [None, None, False]
    if dist.get_rank(group) == 0:
        try:
            with arrival.LocalWork(group, f"rank 0's part of {what}", solo=True):
                info[0] = fn()
        except Exception as e:  # noqa: BLE001 (told to every rank, then raised)
            info[1], info[2] = (str(e), True) if isinstance(e, CheckpointError) \
                else (f"{type(e).__name__}: {e}", False)
    with told:
        info = broadcast_object(info, dist.get_global_rank(group, 0), group)
    if info[1] is not None:
        if info[2]:
            raise CheckpointError(info[1])
        raise RuntimeError(f"matrixfsdp.save_checkpoint: {what} failed on its rank 0: {info[1]}")
    return info[0]


def _commit(tmp: Path, path: Path, group, t0: float, keep_last: int | None) -> int:
    """After every rank of ``group`` wrote into ``tmp``: each rank hashes its files, rank 0
    the rest, writes ``CHECKSUMS.json``, then the marker, fsyncs, renames ``tmp`` to
    ``path``, and (``keep_last``) deletes the older complete checkpoints beyond the newest
    ``keep_last``. Returns the bytes written, on every rank."""
    digests = gather_digests(tmp, group, str(path))  # also the barrier: every rank has written

    def commit() -> int:
        try:
            nbytes = write_checksums(tmp, digests, skip=(COMPLETE,))
            world = dist.get_world_size(group) if dist.is_initialized() else 1
            with open(tmp / COMPLETE, "w") as f:
                json.dump({"world_size": world, "bytes": nbytes, "seconds": time.perf_counter() - t0,
                           "checksums": CHECKSUMS, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            old = path.with_name(f".{path.name}.old")
            if path.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.rename(path, old)
            os.rename(tmp, path)
            _fsync_dir(path.parent)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)  # free what it took; ``path`` is as it was
            raise write_failure(e, path, latest_checkpoint(path.parent, warn=False)) from e
        if keep_last:
            prune_checkpoints(path.parent, keep_last, newest=path)
        return nbytes

    return int(_on_rank0(commit, group, f"the commit of {path}"))


def prune_checkpoints(root: str | os.PathLike, keep_last: int, *, newest: Path | None = None
                      ) -> list[Path]:
    """Delete the complete ``root/step_N`` checkpoints older than the newest ``keep_last``
    ones; returns those deleted. Only checkpoints older than ``newest`` (the one just
    committed) go, so a failed save never costs a kept one. Not a collective: one process
    (rank 0) calls it."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    found = sorted(_step_dirs(Path(root)), reverse=True)
    complete = [(n, d) for n, d in found if is_complete(d)]
    limit = _step_of(newest) if newest is not None else None
    gone = []
    for n, d in complete[keep_last:]:
        if limit is None or n < limit:
            shutil.rmtree(d)
            gone.append(d)
    return gone


# ---- asynchronous saves ----------------------------------------------------------------------
class AsyncCheckpoint:
    """What ``save_checkpoint(..., async_save=True)`` returns: a save whose state is staged
    (copied to CPU) and which writes and commits in the background.

    ``result()`` waits for it and returns its :class:`SavedCheckpoint` (or raises its error);
    once it returns on a rank, ``path`` is complete on every rank's file system view (the
    commit is rank 0's rename after every rank's write). ``done()`` does not wait.
    ``blocking_seconds`` is how long the call held the caller (waiting for the previous save,
    the directory set-up, staging).
    """

    def __init__(self, path: Path, future: Future, blocking_seconds: float):
        self.path = path
        self.blocking_seconds = blocking_seconds
        self._future = future
        self._observed = False

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SavedCheckpoint:
        try:
            return self._future.result(timeout)
        finally:
            self._observed = self._observed or self._future.done()  # its outcome is the caller's now

    wait = result

    def __repr__(self) -> str:
        return f"AsyncCheckpoint({str(self.path)!r}, {'done' if self.done() else 'in flight'})"


_in_flight: AsyncCheckpoint | None = None  # this process's latest asynchronous save


def wait_for_checkpoint() -> SavedCheckpoint | None:
    """Wait for this process's asynchronous save in flight, if any; return what it saved
    (None if none was in flight). Raises the save's error if the caller has not seen it yet
    through ``result()``. Every save calls it first, so saves never overlap."""
    global _in_flight
    pending, _in_flight = _in_flight, None
    if pending is None:
        return None
    try:
        return pending._future.result()
    except Exception as e:
        if pending._observed:  # the caller has had this error already
            return None
        raise RuntimeError(f"matrixfsdp.save_checkpoint: the asynchronous save of {pending.path} "
                           f"failed: {type(e).__name__}: {e}") from e


def _arrive(process_group) -> None:
    """Every rank at the save, or a :class:`~matrixfsdp.diagnosis.arrival.CollectiveTimeout`
    naming the ranks that did not come (and the time waited): a watched barrier, before
    DCP's own collectives, whose timeouts name no rank."""
    if dist.is_initialized():
        group = process_group if process_group is not None else dist.group.WORLD
        work = dist.barrier(group=group, async_op=True)
        arrival.wait(work, arrival.issued(group, "checkpoint save barrier"))


def _save_group(process_group):
    """The gloo twin of ``process_group`` (default: the world): a group of the same ranks,
    created on the first asynchronous save (a collective of those ranks) and kept
    (:func:`~matrixfsdp.diagnosis.timeouts.twin_group`). The background thread of an
    asynchronous save runs its collectives there, never on a group that training uses at
    the same time (two threads issuing collectives on one group can pair them up differently
    on different ranks), and on CPU, as ``dcp.async_save`` requires (NCCL has no CPU
    collectives). It has ``process_group``'s timeout. For the world, every rank creates it,
    as any new group; for a smaller group only its ranks do (torch's
    ``use_local_synchronization``)."""
    return twin_group(process_group if process_group is not None else dist.group.WORLD,
                      backend="gloo")


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike, *, process_group=None,
                    async_save: bool = False, keep_last: int | None = None
                    ) -> SavedCheckpoint | AsyncCheckpoint:
    """``dcp.save(state)`` into directory ``path`` so that ``path`` is complete or absent.

    Every rank writes into ``.<name>.partial`` next to ``path``; after every rank is done
    (DCP's metadata written by the coordinator), each rank hashes the files it wrote and
    rank 0 writes ``CHECKSUMS.json`` (SHA-256 per file), then the ``COMPLETE`` marker, renames
    the directory to ``path`` (replacing an older one of that name) and syncs. A crash at
    any point leaves ``path`` as it was and a ``.partial`` directory that
    :func:`latest_checkpoint` ignores and the next save of that name removes. A collective:
    every rank of ``process_group`` (default: the world) calls it.

    ``keep_last=N``: once this checkpoint is committed, the complete ``step_*`` siblings
    older than the newest N are deleted (:func:`prune_checkpoints`); a save that fails
    deletes nothing. A write that fails (a full disk, a read-only directory) raises the
    same one-line :class:`~matrixfsdp.state.integrity.CheckpointError` on every rank, naming the
    directory and the previous checkpoint (left intact), and removes the partial directory.

    ``async_save=True``: stage the state (a CPU copy of this rank's rows, see
    :func:`matrixfsdp.state.staging.stage_state`), hand it to ``torch.distributed.checkpoint.async_save``
    and return an :class:`AsyncCheckpoint` at once; the write, the barrier and the commit run
    in a background thread, on a gloo group of the same ranks that this function creates on
    the first asynchronous save (so it works unchanged under NCCL). Training may change the
    parameters and the optimizer state as soon as the call returns: the checkpoint holds the
    values at the time of the call. A save (either kind) first waits for the asynchronous one
    in flight. Call ``.result()`` (or :func:`wait_for_checkpoint`) before the process group is
    destroyed or the process exits.
    """
    global _in_flight
    t0 = time.perf_counter()
    wait_for_checkpoint()
    _arrive(process_group)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")

    def make_dir() -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this name that died before its commit
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            raise write_failure(e, tmp, latest_checkpoint(path.parent, warn=False)) from e
    _on_rank0(make_dir, process_group, f"creating {tmp}")
    if not async_save:
        watched = Watched(process_group, str(path))
        _write(lambda: dcp.save(state, storage_writer=SaveWriter(tmp, watched),
                                planner=SavePlanner(watched), process_group=process_group),
               tmp, path, process_group, watched)
        nbytes = _commit(tmp, path, process_group, t0, keep_last)
        seconds = time.perf_counter() - t0
        return SavedCheckpoint(path, seconds, nbytes, seconds)

    _in_flight = _save_async(state, tmp, path, process_group, keep_last, t0)
    return _in_flight


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # save group -> staging pool
_POOL: dict = {}  # without a process group


def _staging_pool(group) -> dict:
    """The host buffers an asynchronous save on ``group`` stages into, kept for the next one
    (pinned once, not at every save); each save waits for the one in flight first."""
    return _POOL if group is None else _POOLS.setdefault(group, {})


def _save_async(state: dict[str, Any], tmp: Path, path: Path, process_group,
                keep_last: int | None, t0: float) -> AsyncCheckpoint:
    """Stage ``state`` and start DCP's asynchronous write into ``tmp``; the write's end and
    the commit run in a background thread, on the gloo twin of ``process_group``."""
    group = _save_group(process_group) if dist.is_initialized() else None
    # per_thread_copy_ahead=0: the staged tensors are on CPU already, and DCP's writer then
    # reads them directly instead of through an accelerator stream of the background thread.
    watched = Watched(group, str(path))
    written = dcp.async_save(state, storage_writer=SaveWriter(tmp, watched, per_thread_copy_ahead=0),
                             planner=SavePlanner(watched), process_group=group,
                             async_stager=RowShardStager(_staging_pool(group)),
                             no_dist=not dist.is_initialized())
    blocking = time.perf_counter() - t0

    def finish() -> SavedCheckpoint:
        arrival.at(*watched.place)  # this thread's points say the step of the call
        _write(written.result, tmp, path, group, watched)
        nbytes = _commit(tmp, path, group, t0, keep_last)
        return SavedCheckpoint(path, time.perf_counter() - t0, nbytes, blocking)

    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="matrixfsdp-checkpoint")
    pending = AsyncCheckpoint(path, worker.submit(finish), blocking)
    worker.shutdown(wait=False)  # the thread ends with the commit
    return pending


def _write(write: Callable[[], Any], tmp: Path, path: Path, group, watched: Watched) -> None:
    """Run DCP's save; a failure on any rank (DCP raises it on every rank) becomes one
    :class:`CheckpointError` line on every rank, the partial directory removed by rank 0;
    a timeout names the ranks that did not arrive and where each was last seen (its
    planning, its write, the coordinator's parts: :mod:`.dcp_io`)."""
    try:
        write()
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
            raise  # KeyboardInterrupt, SystemExit
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(e, path, latest_checkpoint(path.parent, warn=False), watched.failure(e)) from e
    watched.done()


# ---- finding checkpoints -------------------------------------------------------------------
def _step_of(path: Path) -> int | None:
    m = _STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return [(n, d) for d in root.iterdir() if d.is_dir() and (n := _step_of(d)) is not None]


def is_plain_dcp(path: str | os.PathLike) -> bool:
    """Whether ``path`` is what a plain ``dcp.save`` writes (DCP's ``.metadata``, neither the
    ``COMPLETE`` marker nor ``CHECKSUMS.json`` of :func:`save_checkpoint`): a save that
    finished, not a damaged one."""
    path = Path(path)
    return ((path / METADATA).is_file() and not (path / COMPLETE).exists()
            and not (path / CHECKSUMS).exists())


def why_incomplete(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete checkpoint (None if it is)."""
    path = Path(path)
    if not path.is_dir():
        return "it is not a directory"
    if is_plain_dcp(path):
        return ("it is a plain torch.distributed.checkpoint save (DCP's .metadata, without the "
                "COMPLETE marker and CHECKSUMS.json that matrixfsdp.save_checkpoint writes)")
    missing = [name for name in (COMPLETE, METADATA) if not (path / name).is_file()]
    if missing:
        return (f"it has no {' and no '.join(missing)} file (a save that did not finish, or a "
                "damaged directory)")
    return None


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint :func:`save_checkpoint` finished (marker and DCP
    metadata present). Its files' integrity is checked by the load, or by
    :func:`~matrixfsdp.state.integrity.verify_checkpoint`."""
    return why_incomplete(path) is None


def find_checkpoints(root: str | os.PathLike) -> tuple[list[Path], list[tuple[Path, str]]]:
    """``(complete, skipped)`` under ``root``: the complete ``root/step_N``, newest first
    (``[root]`` if ``root`` itself is one), and the ``step_N`` newer than the newest complete
    one that are not complete, each with the reason."""
    root = Path(root)
    if is_complete(root):
        return [root], []
    found = sorted(_step_dirs(root), reverse=True)
    complete = [d for _, d in found if is_complete(d)]
    newest = _step_of(complete[0]) if complete else -1
    skipped = [(d, str(why_incomplete(d))) for n, d in found if n > newest and not is_complete(d)]
    return complete, skipped


def latest_checkpoint(root: str | os.PathLike, *, warn: bool = True) -> Path | None:
    """The complete ``root/step_N`` with the largest N (``root`` itself if it is a complete
    checkpoint), or None. Directories without the marker (a save that died) are ignored;
    with ``warn``, a newer one that is skipped is reported (``warnings.warn``: which, why)."""
    complete, skipped = find_checkpoints(root)
    if warn:
        for d, why in skipped:
            warnings.warn(f"matrixfsdp: skipping checkpoint {d}: {why}", stacklevel=2)
    return complete[0] if complete else None


# ---- loading ---------------------------------------------------------------------------------
def load_checkpoint(model: nn.Module, optimizer=None, path: str | os.PathLike = "", *,
                    extra: dict[str, Any] | None = None, verify: bool = True,
                    process_group=None) -> dict[str, Any]:
    """Load the checkpoint directory ``path`` (one :func:`save_checkpoint` wrote) into the
    sharded ``model`` and ``optimizer`` (None: the model only), at any world size.

    In order: the directory must be complete; rank 0 reads the index (the marker,
    ``CHECKSUMS.json``, DCP's ``.metadata``, checked) and plans every rank's reads; the saved
    model names must equal the model's, both ways; each rank checks the files it reads
    (present, the name at their end, their sizes; with ``verify`` their checksums), and the
    ranks agree on the verdict; then each rank reads its pieces (a file that cannot be read
    is named) and :func:`~matrixfsdp.set_state_dict` (:func:`~matrixfsdp.state.dcp_io.load`).
    At the same world size each rank opens only the files it wrote. ``extra``: more entries
    to load along (e.g. an lr scheduler's ``state_dict()``), filled in place. Returns the
    loaded state dict. A collective. Raises
    :class:`~matrixfsdp.state.integrity.CheckpointError` (incomplete or damaged, naming the
    file and how) or ``ValueError`` (names that differ), the same on every rank, before
    anything is loaded; a rank that hangs in the load is named by the others
    (:class:`~matrixfsdp.state.integrity.CheckpointTimeout`).
    """

    path = Path(path)
    why = why_incomplete(path)
    if why is not None and is_plain_dcp(path):
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded by matrixfsdp.load_checkpoint: {why}, so there "
            "is nothing to check it against. Load it as it was saved: state = "
            f"mf.get_state_dict(model, optimizer); dcp.load(state, checkpoint_id={str(path)!r}); "
            "mf.set_state_dict(model, optimizer, state). Save with mf.save_checkpoint(state, "
            "path) for checkpoints that load_checkpoint checks (docs/checkpoint.md)")
    if why is not None:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {why}")
    state = get_state_dict(model, optimizer)
    state.update(extra or {})
    dcp_io.load(state, path, process_group, verify=verify, names="model")
    set_state_dict(model, optimizer, state)
    return state
