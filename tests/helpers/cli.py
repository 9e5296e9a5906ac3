"""`matrixfsdp ...` run in the test process: the command's own ``main`` (what the console
script calls before leaving), with this process's stdout and stderr, and those of the rank
processes it starts, captured at the file-descriptor level.

It saves the command's own interpreter start (about 1.7 s of importing torch) per run.
Tests of what only a separate launcher process shows (its exit code under a signal, a
killed launcher, the installed console script) still start ``python -m matrixfsdp``."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

from matrixfsdp.__main__ import main


@contextlib.contextmanager
def captured_fds():
    """Redirect fds 1 and 2 to temporary files; yields a list that receives their text."""
    got: list[str] = []
    with tempfile.TemporaryFile("w+", buffering=1) as out, \
            tempfile.TemporaryFile("w+", buffering=1) as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:  # this process's prints (sys.stdout may be pytest's own file) and the ranks' (fds)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                yield got
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            for f in (out, err):
                f.seek(0)
                got.append(f.read())


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``matrixfsdp *args`` with ``env`` added to the environment: its exit status and
    output, as ``subprocess.run(..., capture_output=True, text=True)`` gives them."""
    saved_env = dict(os.environ)
    os.environ.update(env or {})
    code = 0
    try:
        with captured_fds() as got:
            try:
                code = main(list(args)) or 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["matrixfsdp", *args], code, got[0], got[1])
