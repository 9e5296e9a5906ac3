"""The docs' pages and the commands they show: README.md and docs/*.md, the command lines in
their code (``matrixfsdp train|plan|calibrate|bench``, ``python -m benchmarks.*|studies.*|tools.*``),
the flags each passes, and each command's own ``--help`` read into its options
(docs/test_docs_commands.py, docs/test_docs_figures.py, docs/test_docs_examples.py)."""

from __future__ import annotations

import contextlib
import importlib
import io
import re

import pytest

from helpers import REPO
from matrixfsdp.__main__ import main

ROOT = REPO  # README.md and docs/
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(matrixfsdp (?:train|bench|plan|calibrate)"
                     r"|python -m (?:benchmarks|studies|tools|matrixfsdp)\.[\w.]+)"
                     r"((?:\s+(?!matrixfsdp\b|python\b|torchrun\b|srun\b|OMP_NUM_THREADS=)[^\s`|;]+)*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# a misspelt flag the pages show refused: "matrixfsdp train: error: unrecognized arguments: --step 5"
REFUSED = re.compile(r"matrixfsdp (train|plan): error: unrecognized arguments: ([^\n`|]+)")


def code_lines(text: str) -> list[str]:
    """The pages' code: fenced blocks and inline spans, each as one line (not architecture.md's
    file map, which quotes the modules' docstrings, not commands)."""
    text = re.sub(r"<!-- file map: .*?<!-- /file map -->", "", text, flags=re.S)
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)
    rest = re.sub(r"^```[a-z]*\n.*?^```", "", text, flags=re.S | re.M)
    spans = re.findall(r"`([^`]+)`", rest)
    lines = [line for b in blocks for line in re.sub(r"\\\n\s*", " ", b).splitlines()]
    return lines + [re.sub(r"\s*\n\s*", " ", c) for c in spans]


def which_parser(cmd: str, args: str) -> str:
    """The parser a documented command line reaches."""
    if cmd == "matrixfsdp bench":
        for mode in ("--link", "--tp", "--ep"):
            if re.search(rf"(?<![\w-]){mode}(?![\w-])", args):
                return f"bench {mode}"
    return cmd.removeprefix("matrixfsdp ").removeprefix("python -m ")


def refused() -> list[tuple[str, str, str]]:
    """(page, subcommand, arguments) of every misspelt flag a page shows refused."""
    return [(page.name, m.group(1), m.group(2).strip()) for page in PAGES
            for m in REFUSED.finditer(page.read_text())]


def documented() -> dict[str, dict[str, str]]:
    """{command: {flag: where it is documented}} (the misspelt flags shown refused are not)."""
    wrong = {(f"matrixfsdp {cmd}", flag) for _, cmd, args in refused() for flag in FLAG.findall(args)}
    found: dict[str, dict[str, str]] = {}
    for page in PAGES:
        for code in code_lines(page.read_text()):
            for m in COMMAND.finditer(code):
                args = m.group(2)
                for flag in FLAG.findall(args):
                    if (m.group(1), flag) not in wrong:
                        found.setdefault(which_parser(m.group(1), args), {}).setdefault(flag, page.name)
    return found


def help_text(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        if command.startswith(("benchmarks.", "studies.", "tools.", "matrixfsdp.")):
            importlib.import_module(command).main(["--help"])
        elif command.startswith("bench --link"):
            main(["bench", "--link", "1", "--help"])
        else:
            main([*command.split(), "--help"])
    return out.getvalue()


def help_options(text: str) -> dict[str, str]:
    """Each option of a ``--help`` text with its help (the lines up to the next option)."""
    found: dict[str, str] = {}
    current: list[str] = []
    for line in text.splitlines():
        m = re.match(r"\s{2}(-[-\w]+)", line)
        if m:
            names = re.findall(r"(?<![\w-])--?[\w-]+", line.split("  ", 2)[1])
            current = [o for o in names if o.startswith("--")]
            for o in current:
                found[o] = line
        elif current and line.startswith(" " * 8):
            for o in current:
                found[o] += " " + line.strip()
        else:
            current = []
    return found
