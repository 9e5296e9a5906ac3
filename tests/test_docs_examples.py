"""The runnable examples in docs/ run: each ```python block that follows a line
"Runnable as is: `torchrun --nproc-per-node N ...`" is run under torchrun with N ranks,
once. Each ends with ``mf.exit_rank()``: a rank that left through interpreter finalization
aborted now and then in torch's gloo race (docs/design.md, "Leaving a rank"), which an
earlier version of this test hid by retrying."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("page,ranks,code", examples(), ids=[e[0] for e in examples()])
def test_docs_example_runs(page, ranks, code, tmp_path):
    assert code.rstrip().endswith("mf.exit_rank()  # leave without interpreter finalization: "
                                  'design.md, "Leaving a rank"'), f"{page}: ends without mf.exit_rank()"
    script = tmp_path / "example.py"
    script.write_text(code)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert run.returncode == 0, f"{page}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
