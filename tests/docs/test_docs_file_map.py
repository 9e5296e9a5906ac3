"""docs/architecture.md's file map is the tree: the block between its markers is what
``make docs-map`` (``python -m tools.file_map``) writes from the modules' docstrings, so a
module added, moved, removed or re-described fails here until the map is regenerated."""

from __future__ import annotations

import shutil

import pytest
from helpers import REPO

from tools import file_map as fm

ROOT = REPO


def test_the_file_map_is_the_tree():
    page = fm.PAGE.read_text()
    assert fm.START in page and fm.END in page, f"{fm.PAGE}: the file map's markers are gone"
    assert fm.splice(page, fm.file_map()) == page, \
        "docs/architecture.md's file map differs from the tree: run `make docs-map`"


def test_every_mapped_module_says_what_it_is():
    """Each module and folder of the map has a docstring whose first sentence the map shows."""
    bare = [str(p.relative_to(ROOT)) for tree in fm.TREES for p in sorted((ROOT / tree).rglob("*.py"))
            if not fm.summary(p) and not (p.name == "__init__.py" and p.parent == ROOT / "src/matrixfsdp")]
    assert not bare, f"modules without a docstring (the map would say nothing of them): {bare}"
    shown = fm.file_map()
    missing = [str(p.relative_to(ROOT)) for tree in fm.TREES for p in (ROOT / tree).rglob("*.py")
               if p.name != "__init__.py" and p.name not in shown]
    assert not missing, missing


def test_the_map_drifts_when_a_module_is_added(tmp_path, capsys, monkeypatch):
    """The check sees a new module (and ``--check`` exits 1 naming the fix), and a
    rewrite puts it in."""
    for tree in fm.TREES:
        shutil.copytree(ROOT / tree, tmp_path / tree, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "architecture.md"
    page.write_text(fm.PAGE.read_text())
    (tmp_path / "src/matrixfsdp/layout/newcomer.py").write_text('"""A module the map lacks. More."""\n')
    monkeypatch.setattr(fm, "ROOT", tmp_path)
    monkeypatch.setattr(fm, "PAGE", page)
    assert fm.main(["--check"]) == 1
    assert "run make docs-map" in capsys.readouterr().err
    assert fm.main([]) == 0
    assert "newcomer.py" in page.read_text() and "A module the map lacks." in page.read_text()
    assert fm.main(["--check"]) == 0


@pytest.mark.parametrize("doc,want", [
    ('"""``a``: b (:mod:`.c`, e.g. d). More."""', "a: b."),
    ('"""O(1) bytes, f(x) kept (an aside)\n    across lines. Next."""',
     "O(1) bytes, f(x) kept across lines."),
    ('"""How it measures (see :class:`~x.Y`):\n\n* one"""', "How it measures."),
])
def test_the_summary_rule(tmp_path, doc, want):
    path = tmp_path / "m.py"
    path.write_text(doc + "\n")
    assert fm.summary(path) == want
