"""Figures come from their commands: every measured table of README.md and docs/ sits in a
block ``<!-- figure NAME -->`` that ``make docs-figures`` (``tools.docs_figures``)
fills from ``docs/figures/NAME.md``, which names the commands that produced it. Checked
here without running them: each block is its file; each figure is shown; its commands are
ones the commands accept; and where the raw results are kept beside a figure
(``NAME.json``), the code's own renderer gives the figure's tables from them today (the
bench's column definitions and floors, as the code defines them now)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from helpers.docs_pages import FLAG, PAGES, help_options, help_text, which_parser

from tools import docs_figures as df

FIGURES = Path(df.FIGURES)


def _blocks() -> dict[str, list[tuple[str, str]]]:
    """{figure: [(page, content of its block)]}."""
    found: dict[str, list[tuple[str, str]]] = {}
    for page in PAGES:
        for name, body in re.findall(r"<!-- figure (\w+): [^\n]*-->\n(.*?)\n<!-- /figure \1 -->",
                                     page.read_text(), re.S):
            found.setdefault(name, []).append((page.name, body))
    return found


def test_every_block_is_its_figure_file():
    stale = [f"{page}: {name}" for name, shown in _blocks().items() for page, body in shown
             if not (FIGURES / f"{name}.md").exists()
             or body != (FIGURES / f"{name}.md").read_text().strip("\n")]
    assert not stale, "blocks that are not their docs/figures file (make docs-figures): " + ", ".join(stale)


def test_every_figure_is_shown_and_every_file_is_a_figure():
    shown = set(_blocks())
    made = set(df.REGISTRY) | {"bench_summary"}
    assert made <= shown, f"figures no page shows: {sorted(made - shown)}"
    files = {p.stem for p in FIGURES.glob("*.md")}
    assert files <= made, f"files of docs/figures no command makes: {sorted(files - made)}"


@pytest.mark.parametrize("name", list(df.REGISTRY))
def test_figure_commands_are_the_commands(name):
    """Each command of a figure parses: every flag is in its command's --help."""
    for command in df.REGISTRY[name].commands:
        words = shlex.split(command.format(out="runs/x"))
        if words[0] == "python":
            which = words[2]
        else:
            which = which_parser(" ".join(words[:2]), command)
        options = help_options(help_text(which))
        flags = [f for f in FLAG.findall(" ".join(words)) if f not in options]
        assert not flags, f"{name}: `{command}` passes {flags}, which {which} --help lacks"


def _kept(name: str):
    path = FIGURES / f"{name}.json"
    if not path.exists():
        pytest.skip(f"docs/figures/{name}.json: not generated yet")
    return json.loads(path.read_text()), (FIGURES / f"{name}.md").read_text()


@pytest.mark.parametrize("name, render", [
    ("bench", "benchmarks.harness.report:render_markdown"),
    ("ep", "benchmarks.parallel.ep_report:render"),
    ("tp", "benchmarks.parallel.tp_report:render")])
def test_figure_tables_are_the_code_s_own(name, render):
    """The stored run rendered by today's code gives the figure's tables: the columns, their
    definitions and the floors are the code's, not a hand-kept copy."""
    import importlib
    module, fn = render.split(":")
    results, figure = _kept(name)
    assert getattr(importlib.import_module(module), fn)(results).strip() in figure
    if name == "bench":
        assert df._bench_summary(results).strip() == (FIGURES / "bench_summary.md").read_text().strip()
