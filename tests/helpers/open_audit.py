"""Test helper: :func:`install` makes this process record, in a log, one JSON line per file it
opens (``sys.addaudithook``, the ``open`` event: ``open()``, ``os.open``, ``Path.open``)
and per file it hashes (``matrixfsdp.state.integrity.file_digest``), each with whether the
default process group existed at that moment. Run as a script, ``python
tests/helpers/open_audit.py LOG ARGS...`` installs it and runs ``matrixfsdp ARGS...`` in this
process (one rank under torchrun's environment: RANK, WORLD_SIZE, ...).

The recording comes from outside the library: the hook and the wrapper are installed by
the test, before the command runs. Each line is written with ``os.write`` to a descriptor
opened before the hook, so the log itself adds no ``open`` event."""

from __future__ import annotations

import json
import os
import sys


def install(log_path: str) -> None:
    """Record this process's opens and hashes into ``log_path`` (appended, one JSON a line)."""
    import torch.distributed as dist

    from matrixfsdp.state import integrity

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(kind: str, path, extra: dict | None = None) -> None:
        line = {"kind": kind, "path": os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike))
                else str(path), "pg": dist.is_available() and dist.is_initialized(), **(extra or {})}
        os.write(fd, (json.dumps(line) + "\n").encode())

    def hook(event: str, args) -> None:
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            record("open", args[0])

    digest = integrity.file_digest

    def counted(path):
        record("hash", path, {"bytes": os.stat(path).st_size})
        return digest(path)

    integrity.file_digest = counted
    sys.addaudithook(hook)


if __name__ == "__main__":
    install(sys.argv[1])
    from matrixfsdp.__main__ import run
    sys.argv = ["matrixfsdp", *sys.argv[2:]]
    run()
