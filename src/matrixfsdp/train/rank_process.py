"""How a local rank process starts: forked, with torch and the library already imported,
instead of a fresh interpreter per rank importing them anew (``spawn``: about 3 s a rank
here, all ranks at once on the same cores).

* A launcher that is a single thread (``matrixfsdp train`` as a command: nothing has
  started a thread yet, not even OpenMP's pool) forks its ranks itself: they start at once,
  sharing its imported modules.
* Any other launcher (a thread beside it: a test runner, a notebook, an application that
  calls :func:`matrixfsdp.train.launch.launch`) has its ranks forked by
  ``multiprocessing``'s ``forkserver``, a single-threaded server that imports torch and the
  library once per launcher process (about 3 s) and forks every rank it is asked for.
  Forking a process with other threads can leave a lock held forever in the child.

A rank is handed what ``spawn`` would have given it (:class:`FromLauncher`): the
launcher's environment and its stdout and stderr as they are at launch (a fork server's
are those of its own start), and the read end of a pipe only the launcher writes to. That
pipe is how a rank dies with its launcher, however the launcher ends (SIGKILL by a
scheduler or the OOM killer included): the kernel closes the launcher's end with the
launcher, the rank's watcher thread reads end-of-file and ends the process at once. The
kernel's parent-death signal cannot do it under a fork server: the rank's parent is the
server, which lives as long as any rank it forked.

CUDA: neither way touches the GPU before the fork (importing torch and the library starts
no CUDA context; a launcher that has one uses the server), and each rank picks its device
after the fork."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from multiprocessing import reduction

import torch.multiprocessing

# What a rank imports anyway: the server imports it once, every rank forks with it loaded.
PRELOAD = ["torch", "torch.distributed", "matrixfsdp"]


class FromLauncher:
    """Handed to a rank being started, it carries the launcher's environment, the read end
    of the launcher's liveness pipe (``alive_fd``) and, pickled into a fork server's rank,
    the launcher's stdout and stderr as file descriptors (a rank the launcher forks has
    them already); :meth:`adopt` in the rank puts them in place."""

    def __init__(self, alive_fd: int, write_fd: int, launcher: int):
        self.alive_fd, self.launcher = alive_fd, launcher
        self.env = dict(os.environ)
        # Forked by the launcher itself (not pickled): the rank has its fds 1 and 2 already,
        # and also the pipe's write end, which it must close or it would keep itself alive.
        self.stdout = self.stderr = None
        self.close_fd = write_fd

    def __reduce__(self):
        fds = [reduction.DupFd(fd) for fd in (1, 2, self.alive_fd)]
        return _received, (self.env, self.launcher, fds)

    def adopt(self) -> None:
        """In the rank: the launcher's stdout and stderr as fds 1 and 2, its environment,
        and a watcher that ends this process when the launcher is gone. What the server
        imported (torch and the library, about 300,000 objects that live as long as
        the rank) is moved out of the garbage collector's reach (``gc.freeze``): each full
        collection during training then scans only what the run made (measured 0.16 s per
        full collection before, well under a millisecond after)."""
        gc.freeze()
        sys.stdout.flush()
        sys.stderr.flush()
        if self.close_fd is not None:
            os.close(self.close_fd)
        for target, fd in ((1, self.stdout), (2, self.stderr)):
            if fd is not None:
                os.dup2(fd, target)
                os.close(fd)
        os.environ.clear()
        os.environ.update(self.env)
        threading.Thread(target=_die_with_launcher, args=(self.alive_fd, self.launcher),
                         name="launcher-watch", daemon=True).start()


def _received(env: dict, launcher: int, fds) -> FromLauncher:
    got = FromLauncher.__new__(FromLauncher)
    got.env, got.launcher, got.close_fd = env, launcher, None
    got.stdout, got.stderr, got.alive_fd = (d.detach() for d in fds)
    return got


def _die_with_launcher(fd: int, launcher: int) -> None:
    """Block on the launcher's pipe; at end of file (the launcher is gone) leave at once,
    committing nothing more (a checkpoint is committed by one rename after all its data is
    written: a rank ended before it leaves only a ``.partial`` directory)."""
    while True:
        try:
            if not os.read(fd, 1):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    os.write(2, f"rank process {os.getpid()}: its launcher (pid {launcher}) has ended; "
                "leaving\n".encode())
    os._exit(1)


def single_threaded() -> bool:
    """Whether this process has one thread, native ones included (Linux: its task list;
    elsewhere never assumed)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


@contextlib.contextmanager
def ranks_started(entry, args: tuple, nprocs: int):
    """``entry(rank, from_launcher, *args)`` in ``nprocs`` forked processes (see the module's
    docstring: by this process when it is a single thread, else by the preloaded server);
    yields torch's process context (its ``join`` raises when a rank fails). On leaving, the
    liveness pipe closes: a rank still running then ends too."""
    method = "fork" if single_threaded() else "forkserver"
    if method == "forkserver":
        ctx = torch.multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # applies when the server starts (once per launcher)
    read_fd, write_fd = os.pipe()
    try:
        try:
            started = torch.multiprocessing.start_processes(
                entry, args=(FromLauncher(read_fd, write_fd, os.getpid()), *args), nprocs=nprocs,
                join=False, start_method=method)
        finally:
            os.close(read_fd)
        yield started
    finally:
        os.close(write_fd)
