"""Checksums of a checkpoint's files, and the errors a user sees about checkpoint files.

:func:`~matrixfsdp.state.files.save_checkpoint` records a SHA-256 per file in
``CHECKSUMS.json`` before it writes the completion marker: each rank hashes the files it
wrote (DCP names them ``__<rank>_<n>.distcp``), read back from disk after DCP closed them,
and rank 0 hashes the rest (DCP's ``.metadata``). :func:`verify_checkpoint` re-reads them,
each file on one rank, and raises the same :class:`CheckpointError` on every rank naming
the first file that differs or is missing.
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

from ..runtime.collectives import all_gather_object

CHECKSUMS = "CHECKSUMS.json"  # {file name: sha256 hex}, written and fsynced before the marker
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, found or trusted. The message is one line that
    names the file or directory and what to do; the same on every rank."""


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


def gather_digests(directory: Path, group) -> dict[str, str]:
    """Every rank's :func:`own_digests`, merged, on every rank of ``group`` (a collective,
    and a barrier: every rank has written). Without a process group, all files' digests."""
    if not dist.is_initialized():
        return {}
    rank = dist.get_rank(group)
    mine = own_digests(directory, rank)
    everyone = all_gather_object(mine, group)
    return {k: v for d in everyone for k, v in d.items()}


def write_checksums(directory: Path, digests: dict[str, str], skip: tuple[str, ...]) -> int:
    """Rank 0: complete ``digests`` with every other file in ``directory`` (but ``skip``),
    write ``CHECKSUMS.json`` and fsync it. Returns the bytes of the files listed."""
    digests = dict(digests)
    for f in sorted(directory.iterdir()):
        if f.is_file() and f.name not in digests and f.name not in skip and f.name != CHECKSUMS:
            digests[f.name] = file_digest(f)
    with open(directory / CHECKSUMS, "w") as f:
        json.dump({"algorithm": "sha256", "files": digests}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    return sum((directory / name).stat().st_size for name in digests)


def _check_files(path: Path, names: list[str], expected: dict[str, str]) -> str | None:
    for name in names:
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if file_digest(f) != expected[name]:
            return f"{f} does not match its checksum (the file changed after the save)"
    return None


def verify_checkpoint(path: str | os.PathLike, *, process_group=None) -> bool:
    """Check every file of checkpoint ``path`` against its ``CHECKSUMS.json``.

    A collective when a process group is initialised: rank i of ``process_group`` (default:
    the world) reads files i, i + W, ... so each file is read once, and every rank raises
    the same :class:`CheckpointError` naming the first bad file. Returns False (nothing
    checked) for a checkpoint saved before checksums existed, True when all match."""
    path = Path(path)
    listing = path / CHECKSUMS
    if not listing.is_file():
        return False
    try:
        expected = json.loads(listing.read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: {CHECKSUMS} is unreadable ({e}); "
                              "the checkpoint cannot be trusted") from None
    names = sorted(expected)
    if dist.is_initialized():
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        problem = _check_files(path, names[rank::world], expected)
        problem = next((p for p in all_gather_object(problem, process_group) if p), None)
    else:
        problem = _check_files(path, names, expected)
    if problem:
        raise CheckpointError(f"checkpoint {path} is corrupt: {problem}; refusing to load it")
    return True


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


def first_failure(exc: BaseException) -> str:
    """``Type: first line`` of ``exc``; for DCP's ``CheckpointException`` (every rank's
    failures, whose own message is only their ranks), ``rank R: Type: first line`` of the
    first rank's."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank = min(failures)
        pair = failures[rank]
        return f"rank {rank}: {first_failure(pair[0] if isinstance(pair, tuple) else pair)}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}" + (f": {text[0]}" if text else "")


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``), None if unlimited or unknown."""
    if resource is None:
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def write_failure(exc: BaseException, path: Path, previous: Path | None,
                  stuck: str | None = None) -> CheckpointError:
    """The one-line error of a save that failed writing ``path``: the disk error first (a
    full disk says so), or ``stuck`` (the ranks whose write had not finished when this
    rank's wait timed out), and that ``previous`` (the newest complete checkpoint) is intact."""
    os_err = disk_error(exc)
    if stuck is not None:
        what = f"writing {path} timed out: {stuck}"
    elif os_err is not None and os_err.errno == errno.ENOSPC:
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
        what = f"writing {path} failed: {first_failure(exc)}"
        limit = file_size_limit()
        if limit is not None:  # a short write may be all the backend says of it
            what += f" (this process's file-size limit is {limit} bytes: ulimit -f)"
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    return CheckpointError(f"matrixfsdp.save_checkpoint: {what}; nothing was committed, {kept}")
