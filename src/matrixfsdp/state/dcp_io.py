"""DCP's saves and loads as this library runs them: each rank's parts posted as local work
(:mod:`~matrixfsdp.diagnosis.arrival`), so that a hang names its rank; a load in which one
rank reads the index and each rank checks and opens only the files it reads; a file that
cannot be read named.

``torch.distributed.checkpoint`` issues its own collectives (a gather of the plans to the
coordinator and a scatter back, then a gather of the results), and when one of them times
out, the backend's error names no rank. The writer, reader and planners here are DCP's
own classes with each rank's local part of a save or load wrapped in an
:class:`~matrixfsdp.diagnosis.arrival.LocalWork` on the call's group (:class:`Watched`): the
planning (from the planner's set-up, or the metadata read, to the storage's local plan),
the coordinator's global planning, the write and the coordinator's metadata write, the
read. A rank whose DCP collective then fails at the timeout names the ranks still inside
their local work, or behind, and where each was last seen (:meth:`Watched.failure`). Only gloo
groups are watched (:mod:`matrixfsdp.diagnosis.arrival`).

A load (:func:`load`) runs DCP's load protocol with DCP's own planner and file reader, but
no rank other than rank 0 reads DCP's index (:mod:`.load_plan`): resuming as saved each rank
finds its pieces in its own files; otherwise rank 0 broadcasts the index. Each rank checks
the files it reads (:func:`~matrixfsdp.state.integrity.check_file`) and the ranks agree on
the verdict (:func:`~matrixfsdp.state.exchange.agree`) before anything is read; the values
every rank loads alike come from rank 0 in one broadcast. The reader reads file by file, so
that a file that cannot be read (missing, truncated, another checkpoint's) is named with
what went wrong, instead of a bare unpickling or zip error from inside torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, WriteItemType

from ..diagnosis import arrival
from ..diagnosis.arrival import CollectiveTimeout
from . import exchange
from .entries import check_names
from .integrity import (
    CheckpointError,
    CheckpointTimeout,
    check_file,
    damaged,
    error_line,
    mark_file,
    read_index,
)
from .load_plan import (
    RankPlan,
    apply_shared,
    fetch_shared,
    own_files,
    own_reads,
    plan_reads,
    read_failure,
    requests,
    shared_key,
)


class Watched:
    """The local work of one DCP call about ``what`` (a checkpoint's path) on ``group`` (None:
    the world). Where this thread was when it was made (:func:`~matrixfsdp.diagnosis.arrival.at`)
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
        """The :class:`~matrixfsdp.diagnosis.arrival.CollectiveTimeout` of a DCP collective
        that failed with ``exc`` after this rank's last local work, or None (no timeout)."""
        return self.work.failure(exc) if self.work is not None else None


def _items_by_file(plan, results) -> dict[str, list | None]:
    """Per file written, the records of the tensor pieces in it (fqn, the tensor's size, the
    piece's offsets and sizes, where its bytes lie: what a rank needs to load its own pieces
    without DCP's index); None for a file whose bytes are transformed on the way."""
    pieces = {item.index: item.tensor_data for item in plan.items if item.tensor_data is not None}
    out: dict[str, list | None] = {}
    for r in results:
        info, data = r.storage_data, pieces.get(r.index)
        items = out.setdefault(info.relative_path, [])
        if getattr(info, "transform_descriptors", None) or items is None:
            out[info.relative_path] = None
        elif data is not None:
            items.append([r.index.fqn, list(data.size), list(data.chunk.offsets),
                          list(data.chunk.sizes), info.offset, info.length])
    return out


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
            for name, items in sorted(_items_by_file(plan, written.value()).items()):
                mark_file(Path(str(self.path)) / name, items)
            return written

    def finish(self, metadata, results) -> None:
        with self.watched.part("writing DCP's metadata (the coordinator)", solo=True):
            super().finish(metadata, results)


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner; this rank's planning starts at its set-up, and the
    coordinator's global planning is local work of ``watched``. A value that DCP treats as
    replicated (bytes, plain tensors: buffers, AdamW's ``step``, the parameter groups) is
    written by the lowest rank proposing it, rank 0 in MatrixFSDP's state dicts (DCP's
    default spreads them over the ranks that write least), so that a load at the same world
    size reads them from rank 0's file alone and every other rank opens only its own
    (:mod:`.load_plan`). Pieces several ranks propose (HSDP's replicas) stay spread, as DCP
    spreads them."""

    def __init__(self, watched: Watched):
        super().__init__()
        self.watched = watched

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.watched.enter("DCP's save planning")
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_global_plan(self, all_plans):
        with self.watched.part("DCP's global save planning (the coordinator)", solo=True):
            kept: set = set()
            lowest = []
            for plan in all_plans:
                items = []
                for item in plan.items:
                    if item.type in (WriteItemType.BYTE_IO, WriteItemType.TENSOR):
                        if item.index in kept:
                            continue
                        kept.add(item.index)
                    items.append(item)
                lowest.append(dataclasses.replace(plan, items=items))
            return super().create_global_plan(lowest)


class LoadReader(dcp.FileSystemReader):
    """DCP's file reader for one rank's :class:`~matrixfsdp.state.load_plan.RankPlan`; it
    reads file by file: a file that cannot be read raises a
    :class:`~matrixfsdp.state.integrity.CheckpointError` naming it and what went wrong."""

    def __init__(self, path: Path, watched: Watched):
        super().__init__(str(path))
        self.watched = watched

    def read(self, plan: RankPlan, planner) -> None:
        """Read ``plan.items`` into ``planner``'s state dict, with DCP's own ``read_data``."""
        self.set_up_storage_reader(Metadata(state_dict_metadata={}, storage_data=plan.storage), False)
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(plan.storage[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                self.read_data(LoadPlan(items), planner).wait()
            except FileNotFoundError as e:
                raise CheckpointError(f"checkpoint {self.path}: {name} is missing (DCP's "
                                      ".metadata lists it)") from e
            except Exception as e:  # noqa: BLE001 (named, then agreed on by every rank)
                raise CheckpointError(read_failure(Path(str(self.path)), name, e)) from e


def _coordinate(mine: list, path: Path, verify: bool, names: str | None, fast: bool,
                world: int) -> tuple[Any, RankPlan | None]:
    """Rank 0's part: the index read and checked (the model's names both ways, where
    ``names``), its own shared entries planned; the message for the ranks: resuming as saved
    (``fast``) each rank's own files' records, else the index itself; with the shared
    entries rank 0 reads for all. A failure: that error, for every rank."""
    try:
        index = read_index(path, verify)
        if names is not None:  # the saved names of the model, both ways, before any other key
            cut = len(names) + 1
            check_names({fqn[cut:] for fqn, *_ in mine if fqn.startswith(names + ".")},
                        {k[cut:] for k in index.metadata.state_dict_metadata if k.startswith(names + ".")},
                        f"checkpoint {path}")
        own0 = plan_reads(mine, index.metadata, index, only_shared=True)
        for _, _, info in own0.shared:
            own0.files[info.relative_path] = index.record(info.relative_path)
        if fast:  # every rank's shared entries are rank 0's: the broadcast says which
            return own_files(index, world), own0
        return (index, [fqn for fqn, _, _ in own0.shared]), own0
    except Exception as e:  # noqa: BLE001 (every rank raises it)
        return ([e] * world if fast else e), None


def _plan(state: dict, path: Path, planner, reader: LoadReader, watched: Watched, rank: int,
          verify: bool, names: str | None) -> tuple[RankPlan, list[str], bool]:
    """This rank's reads (with its shared entries that rank 0 does not read for all), its
    shared entries, and whether rank 0 broadcasts shared entries (alike on every rank).
    Resuming as saved, each rank finds its pieces in its own files and rank 0 sends each only
    its files' records; otherwise rank 0 broadcasts the index and each rank plans from it.
    One all-reduce decides which, or carries any rank's failure to all."""
    world = dist.get_world_size(watched.group) if watched.on else 1
    failed, mine, own = None, [], None
    with watched.part("DCP's load planning"):
        try:
            planner.set_up_planner(state, None, rank == 0)
            mine = requests(planner.state_dict)
            own = own_reads(path, rank, mine)
            reader.prepare_local_plan(LoadPlan([]))  # DCP's hook, as dcp.load calls it
        except Exception as e:  # noqa: BLE001 (raised by every rank)
            failed = e
    key = shared_key(mine)
    got = exchange.maxima([world - rank if failed is not None else 0, int(own is None), key, -key],
                          watched.group)
    if got[0]:
        raise exchange.from_rank(failed, world - got[0], watched.group)
    fast = got[1] == 0 and got[2] == -got[3]
    msg, own0 = None, None
    if rank == 0:
        with watched.part("DCP's global load planning (the coordinator)", solo=True):
            msg, own0 = _coordinate(mine, path, verify, names, fast, world)
    msg = exchange.scatter_from_coordinator(msg, watched.group) if fast else \
        exchange.broadcast_from_coordinator(msg, watched.group)
    if isinstance(msg, BaseException):
        raise msg
    mine_shared = [fqn for fqn, size, chunks, is_shared in mine if is_shared and (chunks or size is None)]
    if fast:  # every rank's shared entries alike (the all-reduce above)
        plan, broadcast = own, bool(mine_shared)
        plan.files = {name: msg.get(name, (None, None, None, False)) for name in plan.files}
    else:
        index, fetched = msg
        broadcast = bool(fetched)
        try:  # DCP's own refusals (a missing key, a size): agreed on with the checks' verdict
            plan = plan_reads(mine, index.metadata, index)
        except Exception as e:  # noqa: BLE001
            return e, mine_shared, broadcast
        for fqn, item, info in plan.shared:
            if fqn not in fetched:  # a shared entry rank 0 does not hold: read here
                plan.items.append(item)
                plan.storage[item.storage_index] = info
                plan.files[info.relative_path] = index.record(info.relative_path)
    if own0 is not None:  # rank 0 reads the shared entries for all
        plan.shared = own0.shared
        plan.files.update(own0.files)
    return plan, mine_shared, broadcast


def _check(plan: RankPlan | Exception, path: Path, watched: Watched, verify: bool) -> None:
    """This rank's files checked (``verify``: their checksums too), then one verdict for all
    (a planning error of a rank, ``plan``, raised by every rank as it is)."""
    problem: Any = plan if isinstance(plan, Exception) else None
    with watched.part("checking the files it reads"):
        for name, record in plan.files.items() if problem is None else []:
            try:
                problem = check_file(path, name, record, verify)
            except OSError as e:
                problem = f"{path / name} cannot be read ({error_line(e)})"
            if problem is not None:
                break
    problem = exchange.agree(problem, watched.group)
    if isinstance(problem, Exception):
        raise problem
    if problem is not None:
        raise damaged(path, problem)


def _read(plan: RankPlan, shared: list[str], broadcast: bool, path: Path, planner,
          reader: LoadReader, watched: Watched, rank: int) -> None:
    """The shared entries from rank 0 (one broadcast), this rank's own reads, one verdict."""
    payload: Any = {}
    if broadcast:
        if rank == 0:
            with watched.part("reading what every rank loads alike (the coordinator)", solo=True):
                try:
                    payload = fetch_shared(path, plan)
                except CheckpointError as e:
                    payload = str(e)
        payload = exchange.broadcast_from_coordinator(payload, watched.group)
    failed = None
    with watched.part("reading its part"):
        try:
            if isinstance(payload, str):
                raise CheckpointError(payload)
            reader.read(plan, planner)
            apply_shared(planner, [fqn for fqn in shared if fqn in payload], payload, path)
        except CheckpointError as e:
            failed = str(e)
        except Exception as e:  # noqa: BLE001 (agreed on, then raised by every rank)
            failed = f"checkpoint {path}: loading failed: {error_line(e)}"
    failed = exchange.agree(failed, watched.group)
    if failed is not None:
        raise CheckpointError(failed)


def load(state: dict, path: Path, process_group=None, *, verify: bool = True,
         names: str | None = None) -> None:
    """Load ``state`` (filled in place, as ``dcp.load`` does) from checkpoint directory
    ``path``, every rank of ``process_group`` (default: the world) together.

    Rank 0 alone reads the index (the marker, ``CHECKSUMS.json``, DCP's ``.metadata``);
    resuming as saved each rank finds its pieces in its own files, otherwise it plans its
    reads from the index rank 0 broadcasts (:mod:`.load_plan`); each rank checks the files it
    reads (present, the name at their end, sizes; ``verify``: checksums) and the ranks agree
    on the verdict before anything is read; each rank then reads its own pieces, and the
    values every rank loads alike come from rank 0 in one broadcast. ``names``: an
    entry (``"model"``) whose saved names must equal the state's, both ways (``ValueError``
    naming them). Raises the same error on every rank: a damaged file named
    (:class:`~matrixfsdp.state.integrity.CheckpointError`), an entry the checkpoint lacks or
    holds otherwise (DCP's own errors); a rank that hangs is named (a
    :class:`~matrixfsdp.state.integrity.CheckpointTimeout` saying where it was last seen)."""
    path = Path(path)
    watched = Watched(process_group, str(path))
    rank = dist.get_rank(watched.group) if watched.on else 0
    planner, reader = DefaultLoadPlanner(), LoadReader(path, watched)
    try:
        plan, shared, broadcast = _plan(state, path, planner, reader, watched, rank, verify, names)
        _check(plan, path, watched, verify)
        _read(plan, shared, broadcast, path, planner, reader, watched, rank)
    except Exception as e:
        hung = watched.failure(e)
        if hung is not None:
            raise CheckpointTimeout(f"matrixfsdp.load_checkpoint: loading {path} timed out: {hung}",
                                    hung.missing, hung.rank) from e
        raise
    watched.done()
