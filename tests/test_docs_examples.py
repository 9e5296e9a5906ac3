"""The runnable examples in docs/ run: each ```python block that follows a line
"Runnable as is: `torchrun --nproc-per-node N ...`" runs on N ranks, once. Each ends with
``mf.exit_rank()``: a rank that left through interpreter finalization aborted now and then
in torch's gloo race (docs/design.md, "Leaving a rank"), which an earlier version of this
test hid by retrying.

The first example runs under torchrun itself, as the page says. The others run with the
environment torchrun gives a rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), in the
suite's pool of rank processes: the same script, the same ``init_process_group("gloo")``,
without paying 4-7 s of interpreter start per example; their ``mf.exit_rank()`` ends the
job instead of the process."""

from __future__ import annotations

import os
import re
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import spawn

import matrixfsdp as mf

DOCS = Path(__file__).resolve().parent.parent / "docs"
MARK = re.compile(r"Runnable as is: `torchrun --nproc-per-node (\d+) [\w.]+`")


def examples() -> list[tuple[str, int, str]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for m in MARK.finditer(text):
            block = re.search(r"```python\n(.*?)```", text[m.end():], re.S)
            found.append((page.name, int(m.group(1)), block.group(1)))
    return found


class _Left(BaseException):
    """``mf.exit_rank(code)`` inside a pooled example: the script's end."""

    def __init__(self, code: int = 0):
        super().__init__(code)
        self.code = code


def _leave(code: int = 0):
    raise _Left(code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as_torchrun_rank(rank: int, world: int, script: str, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.chdir(os.path.dirname(script))
    exit_rank, mf.exit_rank = mf.exit_rank, _leave
    try:
        runpy.run_path(script, run_name="__main__")
    except _Left as left:
        assert left.code == 0, f"rank {rank}: exit_rank({left.code})"
    else:
        raise AssertionError(f"rank {rank}: the example did not reach mf.exit_rank()")
    finally:
        mf.exit_rank = exit_rank


@pytest.mark.parametrize("page,ranks,code", examples(), ids=[e[0] for e in examples()])
def test_docs_example_runs(page, ranks, code, tmp_path):
    assert code.rstrip().endswith("mf.exit_rank()  # leave without interpreter finalization: "
                                  'design.md, "Leaving a rank"'), f"{page}: ends without mf.exit_rank()"
    script = tmp_path / "example.py"
    script.write_text(code)
    if page != examples()[0][0]:
        spawn(_run_as_torchrun_rank, ranks, str(script), _free_port(), init=False)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert run.returncode == 0, f"{page}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
