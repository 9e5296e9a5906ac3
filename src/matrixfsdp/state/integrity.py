"""Checksums of a checkpoint's files, the checks that refuse a damaged checkpoint in
words, and the errors a user sees about checkpoint files.

:func:`~matrixfsdp.state.files.save_checkpoint` records a SHA-256 and the size of each file
in ``CHECKSUMS.json`` before it writes the completion marker (which records that it did):
each rank hashes the files it wrote (DCP names them ``__<rank>_<n>.distcp``), read back
from disk after DCP closed them, and rank 0 hashes the rest (DCP's ``.metadata``).
:func:`verify_checkpoint` checks, in order of cost, and raises the same
:class:`CheckpointError` on every rank naming the first damaged file and how it is damaged:
the listing itself (missing where the marker says the save wrote one), every file's size,
DCP's ``.metadata`` (readable, and every file it places data in present and long enough:
:func:`check_structure`, which also covers checkpoints saved without checksums), then every
file's bytes, each file read by one rank.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist

try:
    import resource
except ImportError:  # not on Windows: no file-size limit to report
    resource = None  # type: ignore[assignment]

from ..runtime import arrival
from ..runtime.arrival import CollectiveTimeout
from ..runtime.collectives import all_gather_object

CHECKSUMS = "CHECKSUMS.json"  # {"files": {name: sha256 hex}, "sizes": {name: bytes}}, before the marker
COMPLETE = "COMPLETE"  # marker file rank 0 writes into a checkpoint directory before renaming it
METADATA = ".metadata"  # DCP's index of the checkpoint: which bytes of which file hold what
_CHUNK = 1 << 20
# Each file a save writes ends with its own name after this mark (DCP reads only the byte
# ranges its .metadata gives, so torch's readers never see it): a shard swapped with or
# copied over another is named without checksums too.
FILE_MARK = b"\x00matrixfsdp-file "


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, found or trusted. The message is one line that
    names the file or directory and what to do; the same on every rank."""


class CheckpointTimeout(CheckpointError, CollectiveTimeout):
    """A save or load that timed out waiting for a rank: one line for the user (a
    :class:`CheckpointError`) that names the ranks that did not arrive and where each was
    last seen (a :class:`~matrixfsdp.runtime.arrival.CollectiveTimeout`, ``missing``)."""

    def __init__(self, message: str = "", missing: list[int] | tuple = (), rank: int | None = None,
                 lost: bool = False):
        CollectiveTimeout.__init__(self, message, missing, rank, lost)


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def own_digests(directory: Path, group_rank: int) -> dict[str, str]:
    """Digests of the files DCP's ``FileSystemWriter`` wrote for rank ``group_rank``."""
    prefix = f"__{group_rank}_"
    return {f.name: file_digest(f) for f in sorted(directory.iterdir())
            if f.is_file() and f.name.startswith(prefix)}


def gather_digests(directory: Path, group, what: str) -> dict[str, str]:
    """Every rank's :func:`own_digests`, merged, on every rank of ``group`` (a collective,
    and a barrier: every rank has written); the hashing and the gather are arrival points
    of the save of ``what``. Without a process group, all files' digests."""
    if not dist.is_initialized():
        return {}
    group = group if group is not None else dist.group.WORLD
    with arrival.LocalWork(group, f"hashing its files of {what}"):
        mine = own_digests(directory, dist.get_rank(group))
    with arrival.Point(group, f"gather of the checksums of {what}"):
        everyone = all_gather_object(mine, group)
    return {k: v for d in everyone for k, v in d.items()}


def write_checksums(directory: Path, digests: dict[str, str], skip: tuple[str, ...]) -> int:
    """Rank 0: complete ``digests`` with every other file in ``directory`` (but ``skip``),
    write ``CHECKSUMS.json`` (digests and sizes) and fsync it. Returns the bytes of the
    files listed."""
    digests = dict(digests)
    for f in sorted(directory.iterdir()):
        if f.is_file() and f.name not in digests and f.name not in skip and f.name != CHECKSUMS:
            digests[f.name] = file_digest(f)
    sizes = {name: (directory / name).stat().st_size for name in digests}
    with open(directory / CHECKSUMS, "w") as f:
        json.dump({"algorithm": "sha256", "files": digests, "sizes": sizes}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    return sum(sizes.values())


def records_checksums(path: Path) -> bool:
    """Whether the ``COMPLETE`` marker of ``path`` records that its save wrote
    ``CHECKSUMS.json`` (every save since checksums exist); raises :class:`CheckpointError`
    for a marker that is not the JSON object a save writes."""
    try:
        marker = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} is damaged: {path / COMPLETE} is not the marker "
                              f"a save writes ({type(e).__name__}: {e}); refusing to load it") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"checkpoint {path} is damaged: {path / COMPLETE} is not the marker "
                              "a save writes; refusing to load it")
    return marker.get("checksums") == CHECKSUMS


def read_listing(path: Path) -> tuple[dict[str, str], dict[str, int]] | None:
    """``(digests, sizes)`` of ``path``'s ``CHECKSUMS.json`` (sizes empty in a listing from
    before sizes were recorded); None for a checkpoint saved without checksums. Raises
    :class:`CheckpointError` for a listing that is unreadable, or missing where the marker
    says the save wrote it."""
    listing = path / CHECKSUMS
    if not listing.is_file():
        if records_checksums(path):
            raise CheckpointError(f"checkpoint {path} is damaged: {listing} is missing (its {COMPLETE} "
                                  "marker records that the save wrote it), so its files cannot be "
                                  "verified; refusing to load it")
        return None
    try:
        data = json.loads(listing.read_text())
        digests, sizes = data["files"], data.get("sizes", {})
        if not isinstance(digests, dict) or not isinstance(sizes, dict):
            raise ValueError("not a listing of files")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: {CHECKSUMS} is unreadable ({e}); "
                              "the checkpoint cannot be trusted") from None
    return digests, sizes


def _check_sizes(path: Path, digests: dict[str, str], sizes: dict[str, int]) -> str | None:
    """The first listed file that is missing or whose size is not the one saved."""
    for name in sorted(digests):
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        want, size = sizes.get(name), f.stat().st_size
        if want is not None and size != want:
            if size in [sizes.get(n) for n in digests if n != name]:  # another file's size: its bytes?
                swapped = _check_files(path, [name], digests)
                if swapped is not None and "holds the bytes" in swapped:
                    return swapped
            how = "truncated" if size < want else "longer than saved"
            return f"{f} is {how}: {size} bytes, the save wrote {want}"
    return None


def mark_file(f: Path) -> None:
    """Append ``f``'s own name after :data:`FILE_MARK` (once the save has written it)."""
    with open(f, "ab") as out:
        out.write(FILE_MARK + f.name.encode() + b"\n")
        out.flush()
        os.fsync(out.fileno())


def file_mark(f: Path) -> str | None:
    """The name the save wrote at the end of ``f`` (:func:`mark_file`), None if none."""
    with open(f, "rb") as fh:
        fh.seek(max(0, f.stat().st_size - 256))
        tail = fh.read()
    at = tail.rfind(FILE_MARK)
    name = tail[at + len(FILE_MARK):-1].decode(errors="replace") if at >= 0 and tail.endswith(b"\n") else ""
    return name or None


def check_structure(path: str | os.PathLike, listed: dict[str, str] | None = None) -> str | None:
    """What is wrong with checkpoint ``path``'s layout, read from DCP's ``.metadata`` alone
    (no tensor is read), or None: the metadata must unpickle to DCP's index, and every file
    it places data in must be present and long enough, and hold the bytes the save wrote
    into it by the name at its end (:func:`mark_file`, where the save wrote one); with
    ``listed`` (the checksums' file names) every such file must be listed. Checksums or not."""
    import torch.distributed.checkpoint as dcp  # DCP imports numpy and more: only when checking
    path = Path(path)
    try:
        storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
        ends: dict[str, int] = {}
        for info in storage.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # noqa: BLE001 (anything unpickling garbage may raise)
        return f"{path / METADATA} is not DCP's metadata ({error_line(e)})"
    for name, end in sorted(ends.items()):
        f = path / name
        if not f.is_file():
            return f"{f} is missing (DCP's {METADATA} places data in it)"
        if f.stat().st_size < end:
            return (f"{f} is truncated: {f.stat().st_size} bytes, DCP's {METADATA} places data up "
                    f"to byte {end}")
        mark = file_mark(f)
        if mark is not None and mark != name:
            return (f"{f} holds the bytes the save wrote into {mark} (the files were swapped "
                    "or copied over each other)")
    unlisted = sorted(set(ends) - set(listed)) if listed is not None else []
    if unlisted:
        return (f"{path / unlisted[0]} is not listed in {CHECKSUMS}, though DCP's {METADATA} "
                "places data in it (the listing was replaced after the save)")
    return None


def _check_files(path: Path, names: list[str], expected: dict[str, str]) -> str | None:
    for name in names:
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        digest = file_digest(f)
        if digest != expected[name]:
            twin = next((n for n, d in expected.items() if d == digest and n != name), None)
            if twin is not None:
                return (f"{f} holds the bytes the save wrote into {twin} (the files were swapped "
                        "or copied over each other)")
            return f"{f} does not match its checksum (the file changed after the save)"
    return None


def _problem(path: Path, rank: int, world: int) -> str | None:
    """This rank's share of :func:`verify_checkpoint`'s checks, cheapest first: the
    listing, the sizes and (rank 0) the structure on every rank alike, then the bytes of
    files ``rank``, ``rank + world``, ..."""
    try:
        found = read_listing(path)
    except CheckpointError as e:
        return str(e)
    digests, sizes = found if found is not None else ({}, {})
    problem = _check_sizes(path, digests, sizes)
    if problem is None and rank == 0:
        problem = check_structure(path, digests if found is not None else None)
    if problem is None:
        problem = _check_files(path, sorted(digests)[rank::world], digests)
    return None if problem is None else f"checkpoint {path} is damaged: {problem}; refusing to load it"


def verify_checkpoint(path: str | os.PathLike, *, process_group=None) -> bool:
    """Check checkpoint ``path`` against its ``CHECKSUMS.json`` and DCP's ``.metadata``
    (see the module's docstring for the order), without loading it.

    A collective when a process group is initialised: rank i of ``process_group`` (default:
    the world) reads files i, i + W, ... so each file is read once, and every rank raises
    the same :class:`CheckpointError` naming the first damaged file and how. Returns False
    for a checkpoint saved before checksums existed (its structure checked, its bytes
    not), True when every file matches."""
    path = Path(path)
    if dist.is_initialized():
        group = process_group if process_group is not None else dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        with arrival.LocalWork(group, f"checking the files of {path}"):
            problem = _problem(path, rank, world)
        with arrival.Point(group, f"gather of the checks of {path}"):
            problem = next((p for p in all_gather_object(problem, group) if p), None)
    else:
        problem = _problem(path, 0, 1)
    if problem:
        raise CheckpointError(problem)
    return (path / CHECKSUMS).is_file()


def disk_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` in ``exc`` (an ``OSError``, DCP's ``CheckpointException`` of every
    rank's failures, or any exception chain holding one), if any."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        for pair in getattr(e, "failures", {}).values():  # CheckpointException: rank -> (exc, tb)
            todo.append(pair[0] if isinstance(pair, tuple) else pair)
        todo += [e.__cause__, e.__context__]
    return None


def error_line(exc: BaseException) -> str:
    """``Type: first line`` of ``exc``; for DCP's ``CheckpointException`` (every rank's
    failures, whose own message is only their ranks), ``rank R: Type: first line`` of the
    first rank's."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank = min(failures)
        pair = failures[rank]
        return f"rank {rank}: {error_line(pair[0] if isinstance(pair, tuple) else pair)}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}" + (f": {text[0]}" if text else "")


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``), None if unlimited or unknown."""
    if resource is None:
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def write_failure(exc: BaseException, path: Path, previous: Path | None,
                  stuck: CollectiveTimeout | None = None) -> CheckpointError:
    """The one-line error of a save that failed writing ``path``: the disk error first (a
    full disk says so), or ``stuck`` (the ranks that did not arrive when this rank's wait
    timed out, and where each was last seen: a :class:`CheckpointTimeout`), and that
    ``previous`` (the newest complete checkpoint) is intact."""
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    if stuck is not None:
        return CheckpointTimeout(f"matrixfsdp.save_checkpoint: saving {path} timed out: {stuck}; "
                                 f"nothing was committed, {kept}", stuck.missing, stuck.rank)
    os_err = disk_error(exc)
    if os_err is not None and os_err.errno == errno.ENOSPC:
        what = f"no space left on the device writing {path}"
    elif os_err is not None:
        # an OSError from a write has no file name (None), one from open() has it
        code = errno.errorcode.get(os_err.errno or -1)
        named = [v for v in (os_err.filename, code) if v]
        what = (f"cannot write {path}: {os_err.strerror or os_err}"
                + (f" ({', '.join(map(str, named))})" if named else "")
                + ("; a file-size limit (ulimit -f) or the file system's largest file was reached"
                   if os_err.errno == errno.EFBIG else ""))
    else:
        what = f"writing {path} failed: {error_line(exc)}"
        limit = file_size_limit()
        if limit is not None:  # a short write may be all the backend says of it
            what += f" (this process's file-size limit is {limit} bytes: ulimit -f)"
    return CheckpointError(f"matrixfsdp.save_checkpoint: {what}; nothing was committed, {kept}")
