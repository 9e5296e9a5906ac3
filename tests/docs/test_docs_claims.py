"""The claims a newcomer checked against the code, kept true: the README's first screen and
Status, how to run the quickstart after ``make demo``, the owner layout's bytes qualified
wherever they are stated, HSDP's "once in the world" and replicate-dim bytes, the first
command on a GPU machine, and what torchtitan's one line does not cover."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from helpers import REPO

from matrixfsdp.__main__ import main

ROOT = REPO
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FIRST_SCREEN = 30  # lines


def _prose(text: str) -> list[str]:
    """A page's paragraphs and table rows, without code blocks and generated figure blocks."""
    text = re.sub(r"<!-- figure (\w+):.*?<!-- /figure \1 -->|<!-- file map: .*?<!-- /file map -->",
                  "", text, flags=re.S)
    text = re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M)
    parts = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.splitlines()
        if lines and all(line.startswith("|") for line in lines):
            parts += lines  # a table: each row stands alone
        else:
            parts.append(" ".join(line.strip() for line in lines))
    return parts


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_the_readme_s_first_screen_says_what_who_and_the_two_commands():
    first = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN])
    assert "Fully sharded data parallelism" in first and "Muon" in first  # what
    assert "It is for" in first  # who
    assert "make demo" in first and "make test" in first
    assert "P/(P-1)" not in first  # the bytes come after what it is for


def test_the_readme_s_status_is_short_and_points_to_the_docs():
    status = _section(README.read_text(), "Status")
    lines = [line for line in status.splitlines()[2:] if line.strip()]
    assert len(lines) <= 20, f"the README's Status is {len(lines)} lines (at most 20)"
    assert "docs/benchmarks.md" in status and "docs/design.md" in status


def test_the_quickstart_says_to_activate_the_environment_first():
    """torchrun is .venv's, not on PATH after ``make demo``: the README says so before its
    runnable example, and the Makefile's environment is where it says."""
    text = README.read_text()
    run = text.index("Runnable as is: `torchrun --nproc-per-node 2 examples/quickstart.py`")
    assert "source .venv/bin/activate" in text[:run]
    assert "VENV    := .venv" in (ROOT / "Makefile").read_text()


def test_p_over_p_minus_1_is_said_for_1d_meshes_only():
    """The busiest rank's ``P/(P-1)`` holds on a 1-D mesh; every paragraph that states it as
    a bound says so (TP, HSDP and the planner's advice at scale move more)."""
    bare = [f"{page.name}: {p[:100]}" for page in PAGES for p in _prose(page.read_text())
            if re.search(r"at most (about )?`?[PS]/\([PS]-1\)", p) and "1-D" not in p]
    assert not bare, "P/(P-1) stated without its 1-D mesh:\n" + "\n".join(bare)
    design = (ROOT / "docs" / "design.md").read_text()
    assert "Beyond a 1-D mesh the busiest rank moves more" in design and "5.07x" in design


def test_hsdp_claims_say_their_limits():
    """Stepped once in the world: the 2-D matrices (expert stacks on every replica). The
    replicate dim's bytes: FSDP2 HSDP's on the mean rank, not the busiest; plan.md explains
    its ``replicate vs FSDP2 HSDP`` column."""
    for page in PAGES:
        for p in _prose(page.read_text()):
            if re.search(r"(stepped|steps?) (once|by one rank) in the (whole )?world", p):
                assert "2-D" in p, f"{page.name}: {p[:120]}"
            assert not re.search(r"replicate-dim bytes equal", p), f"{page.name}: {p[:120]}"
    hsdp = (ROOT / "docs" / "hsdp.md").read_text()
    assert "expert stacks are the exception, stepped on" in hsdp
    plan = (ROOT / "docs" / "plan.md").read_text()
    explained = [p for p in _prose(plan) if "replicate vs FSDP2 HSDP" in p and not p.startswith("|")]
    assert explained and "shard x tp" in explained[0] and "Summed over all ranks" in explained[0]


def _calibrate_help() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    return " ".join(out.getvalue().split())


def test_the_first_command_on_a_gpu_machine_is_one_everywhere():
    """gpu.md, plan.md and ``calibrate --help`` agree: ``make gpu-check`` first, then
    ``matrixfsdp calibrate``; gpu.md says what to install there."""
    gpu = (ROOT / "docs" / "gpu.md").read_text()
    assert "`make gpu-check` is the first command on a GPU machine" in gpu
    assert "On a GPU machine, in order" in gpu and "pip install -e" in gpu
    plan = " ".join((ROOT / "docs" / "plan.md").read_text().split())
    assert "after `make gpu-check`" in plan
    assert "run it after make gpu-check" in _calibrate_help().replace("``", "")
    for text in (gpu, plan, _calibrate_help()):
        assert "calibrate` is the first command" not in text and "it is the first command" not in text


def test_torchtitan_s_one_line_says_what_it_refuses():
    """The README's torchtitan row names what ``parallelize`` refuses, as the code does."""
    import inspect

    from matrixfsdp.integrations import torchtitan

    row = next(line for line in README.read_text().splitlines()
               if line.startswith("| torchtitan's own trainer"))
    refused = re.findall(r'\("([^"]+)",', inspect.getsource(torchtitan._unsupported))
    assert refused == ["expert parallelism with tensor parallelism", "training.enable_cpu_offload",
                       "parallelism.enable_fsdp_symm_mem"], refused
    assert "refused there" in row and all(kind in row for kind in refused), row
