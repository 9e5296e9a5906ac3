"""A finished rank leaves through exit_rank: its output is flushed and its exit code kept."""

from __future__ import annotations

import subprocess
import sys


def test_exit_rank_flushes_runs_atexit_and_keeps_the_code():
    code = ("import atexit, sys; from matrixfsdp.runtime.exit import exit_rank; "
            "atexit.register(lambda: print('atexit', end='')); "
            "print('out', end=''); print('err', end='', file=sys.stderr); exit_rank(3)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (3, "outatexit", "err")
