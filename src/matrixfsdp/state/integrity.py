"""Checksums of a checkpoint's files, the checks that refuse a damaged checkpoint in
words, and the errors a user sees about checkpoint files.

:func:`~matrixfsdp.state.files.save_checkpoint` records a SHA-256 and the size of each file
in ``CHECKSUMS.json`` before it writes the completion marker (which records that it did):
each rank hashes the files it wrote (DCP names them ``__<rank>_<n>.distcp``), read back
from disk after DCP closed them, and rank 0 hashes the rest (DCP's ``.metadata``); every
file a save writes ends with its own name (:func:`mark_file`).

The checks are split so that no rank reads more than it must: the coordinator (rank 0)
alone reads the index, :func:`read_index` (the marker, the listing, DCP's ``.metadata``:
its size, that it unpickles, that every file it places data in is listed, its checksum),
and each rank checks the files it reads, :func:`check_file` (present, the name at its
end, its size, long enough for the data the index places there, its checksum). A load
(:func:`~matrixfsdp.state.dcp_io.load`) checks the files each rank reads;
:func:`verify_checkpoint` every file, each on the rank that wrote it. Either way the ranks
agree on the verdict with one small all-reduce and raise the same :class:`CheckpointError`
naming the damaged file and how.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

try:
    import resource
except ImportError:  # not on Windows: no file-size limit to report
    resource = None  # type: ignore[assignment]

from ..diagnosis import arrival
from ..diagnosis.arrival import CollectiveTimeout
from . import exchange

CHECKSUMS = "CHECKSUMS.json"  # {"files": {name: sha256 hex}, "sizes": {name: bytes}}, before the marker
COMPLETE = "COMPLETE"  # marker file rank 0 writes into a checkpoint directory before renaming it
METADATA = ".metadata"  # DCP's index of the checkpoint: which bytes of which file hold what
_CHUNK = 1 << 20
# Each file a save writes ends with its own name after this mark (DCP reads only the byte
# ranges its .metadata gives, so torch's readers never see it): a shard swapped with or
# copied over another is named without checksums too.
FILE_MARK = b"\x00matrixfsdp-file "
# Before the name: what the file holds (JSON, one record per item: fqn, the tensor's size,
# the chunk's offsets and sizes, where its bytes lie), behind this mark and the JSON's length,
# so that a rank finds its own pieces in its own files without DCP's index (.metadata).
FILE_INDEX = b"\x00matrixfsdp-index "


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, found or trusted. The message is one line that
    names the file or directory and what to do; the same on every rank."""


class CheckpointTimeout(CheckpointError, CollectiveTimeout):
    """A save or load that timed out waiting for a rank: one line for the user (a
    :class:`CheckpointError`) that names the ranks that did not arrive and where each was
    last seen (a :class:`~matrixfsdp.diagnosis.arrival.CollectiveTimeout`, ``missing``)."""

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
    """Every rank's :func:`own_digests`, merged, on rank 0 of ``group`` (empty elsewhere): a
    collective, and on rank 0 a barrier (every rank has written). One gather to rank 0, which
    writes the listing: no rank receives every rank's digests. The hashing and the gather
    are arrival points of the save of ``what``. Without a process group, nothing."""
    if not dist.is_initialized():
        return {}
    group = group if group is not None else dist.group.WORLD
    with arrival.LocalWork(group, f"hashing its files of {what}"):
        mine = own_digests(directory, dist.get_rank(group))
    with arrival.Point(group, f"gather of the checksums of {what}"):
        everyone = exchange.gather_to_coordinator(mine, group)
    return {k: v for d in everyone or [] for k, v in d.items()}


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


def mark_file(f: Path, items: list | None = None) -> None:
    """Append, once the save has written ``f``: ``items`` (what it holds, see
    :data:`FILE_INDEX`), then ``f``'s own name after :data:`FILE_MARK`."""
    tail = b""
    if items is not None:
        blob = json.dumps(items, separators=(",", ":")).encode()
        tail = blob + FILE_INDEX + str(len(blob)).encode() + b"\n"
    with open(f, "ab") as out:
        out.write(tail + FILE_MARK + f.name.encode() + b"\n")
        out.flush()
        os.fsync(out.fileno())


def file_index(f: Path) -> list | None:
    """The items the save recorded at the end of ``f`` (:func:`mark_file`), if it ends with
    its own name; None where it has none or they do not read."""
    try:
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(0, size - 512))
            tail = fh.read()
            at = tail.rfind(FILE_MARK)
            start = tail.rfind(FILE_INDEX, 0, at)
            if at < 0 or start < 0 or tail[at - 1:at] != b"\n" or \
                    tail[at + len(FILE_MARK):].rstrip(b"\n").decode(errors="replace") != f.name:
                return None
            n = int(tail[start + len(FILE_INDEX):at - 1])
            fh.seek(size - len(tail) + start - n)
            found = json.loads(fh.read(n))
            return found if isinstance(found, list) else None
    except (OSError, ValueError):
        return None


def file_mark(f: Path) -> str | None:
    """The name the save wrote at the end of ``f`` (:func:`mark_file`), None if none."""
    with open(f, "rb") as fh:
        fh.seek(max(0, f.stat().st_size - 256))
        tail = fh.read()
    at = tail.rfind(FILE_MARK)
    name = tail[at + len(FILE_MARK):-1].decode(errors="replace") if at >= 0 and tail.endswith(b"\n") else ""
    return name or None


_digests: dict[tuple, str] = {}  # (path, size, mtime, ctime, inode) -> digest: each file hashed once


def checked_digest(f: Path) -> str:
    """:func:`file_digest` of ``f``, remembered while the file is unchanged (its size,
    modification and change times and inode), so that a resume's two loads (its ``train``
    entry, then the rest) hash a file once."""
    st = f.stat()
    key = (str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key not in _digests:
        if len(_digests) > 256:
            _digests.clear()
        _digests[key] = file_digest(f)
    return _digests[key]


@dataclass
class Index:
    """What the coordinator read of a checkpoint: DCP's metadata and, per file, what the save
    recorded of it (``digests``/``sizes``: None for a checkpoint saved without checksums)
    and the end of the data the metadata places in it."""

    metadata: Any
    digests: dict[str, str] | None
    sizes: dict[str, int]
    ends: dict[str, int]

    def record(self, name: str) -> tuple[str | None, int | None, int | None, bool]:
        """``(digest, size, end, listed)`` of file ``name``: what :func:`check_file` checks."""
        listed = self.digests is not None and name in self.digests
        return ((self.digests or {}).get(name), self.sizes.get(name), self.ends.get(name), listed)


def damaged(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is damaged: {problem}; refusing to load it")


def read_index(path: Path, verify: bool = True) -> Index:
    """The coordinator's checks, cheapest first, and what it read: the marker and the
    listing (:func:`read_listing`), DCP's ``.metadata`` against the listing (present, its
    size), unpickled (``... is not DCP's metadata``), every file it places data in listed,
    then (``verify``) its checksum. Raises :class:`CheckpointError` naming the file and how
    it is damaged. Opens the marker, the listing and ``.metadata``, no shard file."""
    import torch.distributed.checkpoint as dcp  # DCP imports numpy and more: only when loading
    found = read_listing(path)
    digests, sizes = found if found is not None else (None, {})
    if found is not None and METADATA in digests:
        problem = check_file(path, METADATA, (None, sizes.get(METADATA), None, True), False)
        if problem is not None:
            raise damaged(path, problem)
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        ends: dict[str, int] = {}
        for info in meta.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # noqa: BLE001 (anything unpickling garbage may raise)
        raise damaged(path, f"{path / METADATA} is not DCP's metadata ({error_line(e)})") from None
    unlisted = sorted(set(ends) - set(digests)) if digests is not None else []
    if unlisted:
        raise damaged(path, f"{path / unlisted[0]} is not listed in {CHECKSUMS}, though DCP's "
                            f"{METADATA} places data in it (the listing was replaced after the save)")
    if verify and digests is not None and METADATA in digests:
        problem = check_file(path, METADATA, (digests[METADATA], None, None, True), True)
        if problem is not None:
            raise damaged(path, problem)
    return Index(meta, digests, sizes, ends)


def check_file(path: Path, name: str, record: tuple, verify: bool) -> str | None:
    """What is wrong with file ``name`` of checkpoint ``path`` against ``record``
    (:meth:`Index.record`), cheapest first, or None: present, the name the save wrote at its
    end (a shard swapped with or copied over another ends with the other's), its size as
    listed, long enough for the data DCP's metadata places in it, then (``verify``) its
    checksum. Opens only this file."""
    digest, size, end, listed = record
    f = path / name
    if not f.is_file():
        return f"{f} is missing" + ("" if listed else f" (DCP's {METADATA} places data in it)")
    mark = file_mark(f) if name != METADATA else None
    if mark is not None and mark != name:
        return (f"{f} holds the bytes the save wrote into {mark} (the files were swapped or "
                "copied over each other)")
    actual = f.stat().st_size
    if size is not None and actual != size:
        how = "truncated" if actual < size else "longer than saved"
        return f"{f} is {how}: {actual} bytes, the save wrote {size}"
    if end is not None and actual < end:
        return f"{f} is truncated: {actual} bytes, DCP's {METADATA} places data up to byte {end}"
    if verify and digest is not None and checked_digest(f) != digest:
        return f"{f} does not match its checksum (the file changed after the save)"
    return None


_SAVED_BY = re.compile(r"__(\d+)_\d+\.distcp")


def _shares(index: Index, world: int) -> list[dict[str, tuple]]:
    """Every file of the index (the listing, or the files DCP's metadata names), each to the
    rank that wrote it (``__<rank>_<n>.distcp``; modulo ``world``), the rest to rank 0."""
    shares: list[dict[str, tuple]] = [{} for _ in range(world)]
    for name in sorted(set(index.digests or {}) | set(index.ends)):
        m = _SAVED_BY.fullmatch(name)
        shares[int(m.group(1)) % world if m else 0][name] = index.record(name)
    return shares


def verify_checkpoint(path: str | os.PathLike, *, process_group=None) -> bool:
    """Check every file of checkpoint ``path`` against its ``CHECKSUMS.json`` and DCP's
    ``.metadata`` (see the module's docstring), without loading it.

    A collective when a process group is initialised: rank 0 of ``process_group`` (default:
    the world) reads the index and hands each rank the files it wrote (those of ranks beyond
    the group's size to rank ``r`` modulo it), each rank checks and hashes its files, and one
    all-reduce agrees on the verdict: every rank raises the same :class:`CheckpointError`
    naming the damaged file (the lowest rank's) and how. Returns False for a checkpoint
    saved before checksums existed (its structure checked, its bytes not), True when every
    file matches."""
    path = Path(path)
    on = dist.is_initialized()
    group = (process_group if process_group is not None else dist.group.WORLD) if on else None
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if on else (0, 1)
    shares: Any = None
    if rank == 0:
        try:
            index = read_index(path, verify=True)
            shares = [(s, index.digests is not None) for s in _shares(index, world)]
        except CheckpointError as e:
            shares = [e] * world
    if on:
        with arrival.Point(group, f"scatter of the files to check of {path}"):
            mine = exchange.scatter_from_coordinator(shares, group)
    else:
        mine = shares[0]
    if isinstance(mine, CheckpointError):
        raise CheckpointError(str(mine))
    files, listed = mine
    problem = None
    with arrival.LocalWork(group, f"checking the files of {path}") if on else contextlib.nullcontext():
        for name, record in files.items():
            problem = check_file(path, name, record, True)
            if problem is not None:
                break
    if on:
        with arrival.Point(group, f"verdict of the checks of {path}"):
            problem = exchange.agree(problem, group)
    if problem:
        raise damaged(path, problem)
    return listed


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
