"""Every code name README.md and docs/*.md cite exists: a page that names a function, a class's
attribute, a module or a file of this repository names one that is there today.

What counts as a code name (the rule; everything else in backticks is left alone):

* **Python names of the package**: ``mf.X...`` and ``matrixfsdp.X...`` wherever they occur
  inside code (inline spans and fenced blocks), call arguments and subscripts cut off
  (``mf.clip_grad_norm_(...)`` is ``mf.clip_grad_norm_``); ``mf.set_modules_to_*`` means
  some name with that prefix. Resolved by import and ``getattr``, ``mf`` being ``matrixfsdp``.
* **Dotted names from a room of the package**: an inline span that starts with ``layout.``,
  ``costs.``, ``advisor.``, ``runtime.``, ``diagnosis.``, ``tensors.``, ``integrations.``, ``train.``,
  ``testing.`` or ``_compat.`` is ``matrixfsdp.<span>`` (``optim.``, ``state.`` and
  ``fully_shard.`` are not taken: as many pages use those words for torch's objects and
  variables). The former rooms (``planning``, ``shards``, ``sharding``, ``bench``) are read
  the same way, so a name from one fails.
* **``Class.attr``**: an inline span starting ``Name.attr`` where ``Name`` is a class the
  package defines (``Root.finish_grads``, ``UnitLayout.reduce_layout``); the attribute must be
  a method, property, class attribute or ``self.attr`` assignment of a class of that name, or
  reachable by ``getattr`` (inherited).
* **Files and folders**: a token ending ``.py`` (optionally ``::test``) or a folder ending
  ``/``, inside code, whose first component is ``src``, ``matrixfsdp``, ``benchmarks``,
  ``studies``, ``tools``, ``examples``, ``tests`` or a room of the package (``runtime/unit.py``
  is ``src/matrixfsdp/runtime/unit.py``); a bare file name (``exit.py``) must be a file of
  ``src/``, ``benchmarks/``, ``studies/``, ``tools/`` or ``examples/``, unless it is listed below as
  another project's file or an example's placeholder name. Paths of other projects
  (``torch/...``, ``torchtitan/...``) are not checked. A path with a dotted tail
  (``runtime/module.make_unit``) is a module and its attribute.
* **Modules run as commands**: ``python -m benchmarks.x``, ``studies.x``, ``tools.x``,
  ``matrixfsdp.x``.

Not read: architecture.md's generated file map (``tests/docs/test_docs_file_map.py`` checks
it) and the generated figure blocks (``tests/docs/test_docs_figures.py``), HTML comments.
``tests/...`` paths are checked like any other (:data:`SKIP_TEST_PATHS` turns that off while
the tests move between folders).
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

from helpers import REPO

import matrixfsdp

ROOT = REPO
PACKAGE = Path(matrixfsdp.__file__).resolve().parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_TEST_PATHS = False  # True skips tests/ paths (while the tests move between folders)
ROOMS = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
# the package's former rooms (now layout/, tensors/, fully_shard.py, benchmarks/): a name
# from one of them is checked like a room's, so that it fails
FORMER_ROOMS = {"planning", "shards", "sharding", "bench"}
DOTTED_ROOMS = (ROOMS - {"optim", "state"}) | {"_compat"} | FORMER_ROOMS
OUTSIDE = ("benchmarks", "studies", "tools")  # beside the package, imported from the repository root
PATH_ROOTS = {"src", "matrixfsdp", *OUTSIDE, "examples", "tests"} | ROOMS | FORMER_ROOMS
# bare file names that are not this repository's: other projects' files the pages name, and
# the placeholder names of the pages' own runnable examples
FOREIGN_FILES = {"chainable.py", "_optimizer_reshard_runtime.py", "example.py", "recipe.py"}

_GENERATED = re.compile(r"<!-- file map: .*?<!-- /file map -->|<!-- figure (\w+):.*?<!-- /figure \1 -->"
                        r"|<!--.*?-->", re.S)
_FENCE = re.compile(r"^ *```[^\n]*\n(.*?)^ *```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")
_PY_NAME = re.compile(r"(?<![\w./-])(?:mf|matrixfsdp)(?:\.[A-Za-z_]\w*)+(\*)?")
_CLASS_ATTR = re.compile(r"^([A-Z]\w*)\.([A-Za-z_]\w*)")
_PATH = re.compile(r"(?<![\w./-])([A-Za-z_][\w.-]*(?:/[\w.-]+)*/?)(?:::\w+)?(?![\w/])")
_RUN_MODULE = re.compile(r"-m\s+((?:benchmarks|studies|tools|matrixfsdp)(?:\.\w+)+)")


def _blank(m: re.Match) -> str:
    return "\n" * m.group(0).count("\n")  # keeps every later line where it was


def code_of(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(inline spans, fenced blocks)`` of a page, each with its first line's number."""
    text = _GENERATED.sub(_blank, text)
    blocks = [(text[:m.start()].count("\n") + 2, m.group(1)) for m in _FENCE.finditer(text)]
    text = _FENCE.sub(_blank, text)
    spans = [(text[:m.start()].count("\n") + 1, " ".join(m.group(1).split()))
             for m in _SPAN.finditer(text)]
    return spans, blocks


@cache
def _package_classes() -> dict[str, list[tuple[str, set[str]]]]:
    """{class name: [(module, attributes the source gives it)]} for every class of the package."""
    found: dict[str, list[tuple[str, set[str]]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            attrs = set()
            for s in node.body:
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    attrs.add(s.name)
                elif isinstance(s, ast.Assign):
                    attrs |= {t.id for t in s.targets if isinstance(t, ast.Name)}
                elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                    attrs.add(s.target.id)
            for s in ast.walk(node):
                if isinstance(s, ast.Attribute) and isinstance(s.ctx, ast.Store) \
                        and isinstance(s.value, ast.Name) and s.value.id == "self":
                    attrs.add(s.attr)
            found.setdefault(node.name, []).append((module, attrs))
    return found


def _resolve(dotted: str) -> bool:
    """Whether ``matrixfsdp.a.b.c`` is a module or an attribute reachable from one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _prefix_exists(dotted: str) -> bool:
    """``matrixfsdp.set_modules_to_*``: some attribute of the module has that prefix."""
    module, _, prefix = dotted.rpartition(".")
    return _resolve(module) and any(n.startswith(prefix) for n in dir(importlib.import_module(module)))


def _class_attr(cls: str, attr: str) -> bool | None:
    """None if ``cls`` is no class of the package; else whether it has ``attr``."""
    classes = _package_classes().get(cls)
    if not classes:
        return None
    for module, attrs in classes:
        if attr in attrs:
            return True
        obj = getattr(importlib.import_module(module), cls, None)
        if obj is not None and hasattr(obj, attr):
            return True
    return False


def _path_problem(token: str) -> str | None:
    """Why the path ``token`` names nothing here (None if it does, or is not ours to check)."""
    token = token.split("::")[0]
    first, slash, rest = token.partition("/")
    if not slash:
        if not token.endswith(".py") or token in FOREIGN_FILES:
            return None
        names = {p.name for d in ("src", *OUTSIDE, "examples") for p in (ROOT / d).rglob("*.py")}
        return None if token in names else "no such file in src/, benchmarks/, studies/, tools/ or examples/"
    if first not in PATH_ROOTS or (first == "tests" and SKIP_TEST_PATHS) \
            or (first == "src" and not rest.startswith("matrixfsdp")):
        return None
    base = {"src": ROOT / "src", "matrixfsdp": PACKAGE, "benchmarks": ROOT / "benchmarks",
            "studies": ROOT / "studies", "tools": ROOT / "tools", "examples": ROOT / "examples",
            "tests": ROOT / "tests"}
    where = base[first] / rest if first in base else PACKAGE / token
    if token.endswith("/"):
        return None if where.is_dir() else "no such folder"
    if token.endswith((".py", ".md", ".json", ".txt")) or where.exists():
        return None if where.exists() else "no such file"
    module, _, attrs = token.partition(".")  # runtime/module.make_unit: a module, then a name
    file = (base[first] / module.partition("/")[2] if first in base else PACKAGE / module).with_suffix(".py")
    if not file.exists():
        return f"no module {file.relative_to(ROOT)}"
    dotted = ".".join(file.relative_to(ROOT / "src" if first not in OUTSIDE else ROOT)
                      .with_suffix("").parts)
    return None if _resolve(f"{dotted}.{attrs}") else f"{dotted} has no {attrs}"


def problems_in(code: str, inline: bool) -> list[str]:
    """The names of one span (``inline``) or fenced block that do not exist, each with why."""
    found = []
    for m in _PY_NAME.finditer(code):
        dotted = "matrixfsdp" + m.group(0).rstrip("*").removeprefix("mf").removeprefix("matrixfsdp")
        ok = _prefix_exists(dotted) if m.group(1) else _resolve(dotted)
        if not ok:
            found.append(f"{m.group(0)}: no such name in matrixfsdp")
    for m in _RUN_MODULE.finditer(code):
        if not _resolve(m.group(1)):
            found.append(f"python -m {m.group(1)}: no such module")
    for m in _PATH.finditer(code):
        token = m.group(1)
        if "/" in token or token.split("::")[0].endswith(".py"):
            why = _path_problem(token.rstrip("."))
            if why:
                found.append(f"{token}: {why}")
    if inline:
        first = code.split(".")[0]
        if first in DOTTED_ROOMS and re.fullmatch(r"\w+(\.\w+)+(\(.*\)|\[.*\])?", code) \
                and not re.search(r"\.(py|md)\b", code):
            dotted = "matrixfsdp." + re.split(r"[(\[]", code)[0]
            if not _resolve(dotted):
                found.append(f"{code}: no such name ({dotted})")
        m = _CLASS_ATTR.match(code)
        if m and _class_attr(*m.groups()) is False:
            found.append(f"{m.group(0)}: the package's {m.group(1)} has no {m.group(2)}")
    return found


def stale_names() -> list[str]:
    out = []
    for page in PAGES:
        spans, blocks = code_of(page.read_text())
        for line, code in spans:
            out += [f"{page.name}:{line}: {p}" for p in problems_in(code, inline=True)]
        for line, code in blocks:
            out += [f"{page.name}:{line}+: {p}" for p in problems_in(code, inline=False)]
    return out


def test_every_code_name_the_docs_cite_exists():
    stale = stale_names()
    assert not stale, "code names in README.md / docs/ that the repository lacks:\n" + "\n".join(stale)


def test_the_rule_sees_what_it_should():
    """Each kind of name, a real one and a stale one (the issue's examples among them)."""
    must_pass = ["mf.clip_grad_norm_(model.parameters(), 1.0)", "matrixfsdp.integrations.torchtitan",
                 "mf.set_modules_to_*", "Root.finish_grads", "UnitLayout.reduce_layout",
                 "runtime/unit.py", "src/matrixfsdp/fully_shard.py", "layout/", "exit.py",
                 "benchmarks/harness/main.py", "python -m tools.docs_figures", "_compat.coalescing",
                 "studies/scale.py", "python -m studies.step_ops",
                 "torch/optim/_muon.py", "DTensor.from_local", "fully_shard.state(m)._state_ctx",
                 "chainable.py", "tests/runtime/test_tp_group.py",
                 "RowShard.__reduce_ex__"]
    must_fail = ["tests/test_gone.py", "mf.no_such_function(x)", "matrixfsdp.planning.layout",
                 "UnitLayout.subset",
                 "runtime/fully_shard.py", "sharding.py", "shards/", "planning.layout.calls",
                 "runtime/fully_shard.make_unit", "python -m benchmarks.no_such", "Root.no_such",
                 "benchmarks/studies/scale.py", "python -m benchmarks.studies.step_ops",
                 "matrixfsdp/shards/row_shard.py"]
    assert [c for c in must_pass if problems_in(c, inline=True)] == []
    assert [c for c in must_fail if not problems_in(c, inline=True)] == []
    spans, blocks = code_of("a `mf.Muon` b\n<!-- `mf.gone` -->\n```python\nmf.fully_shard(m)\n```\n`x`\n")
    assert spans == [(1, "mf.Muon"), (6, "x")] and blocks == [(4, "mf.fully_shard(m)\n")]
