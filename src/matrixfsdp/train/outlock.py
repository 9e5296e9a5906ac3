"""One run per output directory: ``matrixfsdp train`` holds an exclusive lock on
``<out>/.matrixfsdp.lock`` for the run's whole life, taken before it writes anything there.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on the file: the kernel releases it when the last
file descriptor of its open file description closes, so when the last process of the run
ends, however it ends (SIGKILL, the OOM killer, a crash): a lock is never stale and a dead
run never blocks its retry. The launcher takes it and its local ranks inherit the same
descriptor (:func:`matrixfsdp.train.launch.launch`'s ``held``): if ranks outlived their
launcher (off Linux, where they are not killed with it), the lock would outlive it too.

After taking the lock the holder writes who it is into the file (pid, host, start time,
command, as one JSON object); a second run reads that to name the holder when it is
refused. The file stays after the run (deleting a lock file races with a run opening it);
its presence means nothing, only a live holder's lock does. On shared filesystems see
docs/troubleshooting.md ("One run per output directory")."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import datetime
from multiprocessing import context as mp_context
from multiprocessing import reduction
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no lock (said once, the run goes on)
    fcntl = None

LOCK_NAME = ".matrixfsdp.lock"
HOLDER_WAIT_S = 2.0  # a holder writes its record right after taking the lock: wait that long for it


class OutInUse(Exception):
    """``--out`` is locked by a live run; the message names the directory and the holder."""


class RunLock:
    """The held lock on ``<out>/.matrixfsdp.lock`` (``fd`` None: locks are not supported
    there, ``unsupported`` says why). Pickled into a process being started by
    ``multiprocessing`` (spawn), it passes its file descriptor to that process, which then
    holds the same lock; pickled otherwise, it goes without (the copy holds nothing)."""

    def __init__(self, path: Path, fd: int | None, unsupported: str | None = None):
        self.path, self.fd, self.unsupported = Path(path), fd, unsupported

    def release(self) -> None:
        """Close this process's descriptor (the lock ends with the run's last one)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __reduce__(self):
        if self.fd is None or mp_context.get_spawning_popen() is None:
            return RunLock, (str(self.path), None, self.unsupported)
        return _inherited, (str(self.path), reduction.DupFd(self.fd))


def _inherited(path: str, dup) -> RunLock:
    return RunLock(Path(path), dup.detach())


def _holder_text(fd: int) -> str:
    """The holder's record as one phrase: ``pid P on host H since T (COMMAND)``."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        try:
            rec = json.loads(os.pread(fd, 65536, 0).decode())
            break
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return "its holder has not recorded itself"
            time.sleep(0.1)
    text = f"pid {rec.get('pid')} on host {rec.get('host')} since {rec.get('started')}"
    if rec.get("host") == socket.gethostname() and isinstance(rec.get("pid"), int):
        try:
            os.kill(rec["pid"], 0)
        except ProcessLookupError:  # the launcher ended, processes it started still run
            text += ", which has ended; processes it started still hold the lock"
        except OSError:
            pass
    command = str(rec.get("command", ""))
    return text + (f": {command[:200]}" if command else "")


def enclosing_run(out: str | os.PathLike) -> str | None:
    """The live run whose folder holds ``out`` (a parent directory whose lock is held), as
    ``<folder> (<holder>)``, or None. Probed with a shared lock taken and dropped at once,
    which a live run's exclusive lock refuses; nothing is written."""
    if fcntl is None:
        return None
    for parent in Path(os.path.abspath(out)).parents:
        lock = parent / LOCK_NAME
        try:
            fd = os.open(lock, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            return f"{parent} ({_holder_text(fd)})"
        except OSError:
            pass  # no locks on that filesystem: nothing to tell
        finally:
            os.close(fd)
    return None


def lock_out(out: str | os.PathLike, command: list[str] | None = None) -> RunLock:
    """Take the lock of directory ``out`` (created if missing) for this process, or raise
    :class:`OutInUse` naming the holder, or the live run whose folder ``out`` lies in
    (:func:`enclosing_run`: a run nested in another's folder would write among its files).
    ``OSError``: ``out`` or the lock file cannot be created. A filesystem without locks
    (``ENOLCK``, ``ENOSYS``, ``EOPNOTSUPP``) gives a :class:`RunLock` with ``fd`` None and
    the reason in ``unsupported``."""
    path = Path(out)
    around = enclosing_run(path)
    if around is not None:
        raise OutInUse(f"--out {out} is inside the folder of a live run, {around}; a run there "
                       "would write among that run's files. Choose an --out outside it")
    path.mkdir(parents=True, exist_ok=True)
    lock = path / LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    if fcntl is None:
        os.close(fd)
        return RunLock(lock, None, "file locks are not available on this system")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder_text(fd)
        os.close(fd)
        raise OutInUse(f"--out {out} is in use by another run ({holder}); wait for it to end or "
                       f"stop it, or choose another --out (lock: {lock})") from None
    except OSError as e:
        os.close(fd)
        return RunLock(lock, None, f"{e.strerror or e}")
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": " ".join(command if command is not None else sys.argv)}
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)  # a reader on another host of a shared filesystem sees it
    return RunLock(lock, fd)
