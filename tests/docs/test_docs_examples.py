"""The docs' code runs as written. Each ```python block that follows a line "Runnable as is:
`torchrun --nproc-per-node N FILE`" (README.md and docs/*.md) runs on N ranks; where FILE is
under examples/, the block must be that file, byte for byte, and the file is what runs.
Every other ```python block is marked as a snippet on its first line (``# snippet ...``).
Each runnable example ends with ``mf.exit_rank()``: a rank that left through interpreter
finalization aborted now and then in torch's gloo race (docs/design.md, "Leaving a rank").

The README's example (examples/quickstart.py) runs under torchrun itself, as the README
says. The others run with the environment torchrun gives a rank (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), in the suite's pool of rank processes, all examples of one
rank count in one job: the same scripts, the same ``init_process_group("gloo")``, without
paying 4-7 s of interpreter start per example; their ``mf.exit_rank()`` ends the script
instead of the process."""

from __future__ import annotations

import os
import re
import runpy
import socket
import subprocess
import sys
from collections import defaultdict

import pytest
from helpers.docs_pages import PAGES, ROOT
from helpers.rank_pool import spawn

import matrixfsdp as mf

MARK = re.compile(r"Runnable as is: `torchrun --nproc-per-node (\d+) ([\w./-]+)`")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
EXIT = 'mf.exit_rank()  # leave without interpreter finalization: design.md, "Leaving a rank"'
UNDER_TORCHRUN = "examples/quickstart.py"  # the README's: run as a user runs it


def examples() -> list[tuple[str, int, str, str]]:
    """(page, ranks, file named by the marker, code) of every runnable block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in MARK.finditer(text):
            block = BLOCK.search(text, m.end())
            found.append((page.name, int(m.group(1)), m.group(2), block.group(1)))
    return found


def test_every_python_block_is_runnable_or_marked_a_snippet():
    """A reader can tell which code runs as it stands: each ```python block of the pages
    follows a "Runnable as is" line or says on its first line that it is a snippet."""
    unmarked = []
    for page in PAGES:
        text = page.read_text()
        runnable = {BLOCK.search(text, m.end()).start() for m in MARK.finditer(text)}
        for b in BLOCK.finditer(text):
            if b.start() not in runnable and not b.group(1).startswith("# snippet"):
                line = text[:b.start()].count("\n") + 1
                unmarked.append(f"{page.name}:{line}: {b.group(1).splitlines()[0]}")
    assert not unmarked, "python blocks neither runnable nor marked '# snippet':\n" + "\n".join(unmarked)


@pytest.mark.parametrize("page,ranks,name,code", examples(), ids=[f"{e[0]}:{e[2]}" for e in examples()])
def test_runnable_block_is_complete(page, ranks, name, code):
    """Each runnable block ends as design.md advises; one that names a file of examples/ is
    that file (the page shows what the suite runs)."""
    assert code.rstrip().endswith(EXIT), f"{page}: ends without mf.exit_rank()"
    if name.startswith("examples/"):
        assert code == (ROOT / name).read_text(), f"{page}: the block differs from {name}"


def test_readme_example_under_torchrun(tmp_path):
    """examples/quickstart.py, as the README runs it: ``torchrun --nproc-per-node 2``."""
    (page, ranks, name, _), = [e for e in examples() if e[2] == UNDER_TORCHRUN]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", str(ROOT / name)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert run.returncode == 0, f"{page}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert "step 5: loss" in run.stdout and "MatrixFSDP plan: 2 ranks" in run.stdout, run.stdout
    assert (tmp_path / "runs/quickstart/step_5/.metadata").is_file()


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


def _run_as_torchrun_rank(rank: int, world: int, scripts: list[tuple[str, str, int]]) -> None:
    """Each (page, script, port) in turn, as torchrun would run it on this rank."""
    import torch._dynamo
    exit_rank, mf.exit_rank = mf.exit_rank, _leave
    here = os.getcwd()
    try:
        for page, script, port in scripts:
            torch._dynamo.reset()  # a compile example counts its own graphs
            torch._dynamo.utils.counters.clear()
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            os.chdir(os.path.dirname(script))
            try:
                runpy.run_path(script, run_name="__main__")
            except _Left as left:
                assert left.code == 0, f"{page}, rank {rank}: exit_rank({left.code})"
            except BaseException as e:
                raise AssertionError(f"{page}, rank {rank}: {type(e).__name__}: {e}") from e
            else:
                raise AssertionError(f"{page}, rank {rank}: the example did not reach mf.exit_rank()")
    finally:
        mf.exit_rank = exit_rank
        os.chdir(here)


def _pooled() -> dict[int, list[tuple[str, str, str]]]:
    by_ranks = defaultdict(list)
    for page, ranks, name, code in examples():
        if name != UNDER_TORCHRUN:
            by_ranks[ranks].append((page, name, code))
    return dict(sorted(by_ranks.items()))


@pytest.mark.parametrize("ranks", list(_pooled()))
def test_docs_examples_run(ranks, tmp_path):
    """Every runnable example of this rank count, one job of the pool."""
    scripts = []
    for i, (page, name, code) in enumerate(_pooled()[ranks]):
        where = tmp_path / str(i)
        where.mkdir()
        script = ROOT / name if name.startswith("examples/") else where / "example.py"
        if script.parent == where:
            script.write_text(code)
        else:  # run the repository's file from a directory of its own
            (where / script.name).write_text(script.read_text())
            script = where / script.name
        scripts.append((page, str(script), _free_port()))
    spawn(_run_as_torchrun_rank, ranks, scripts, init=False, timeout=400)
