"""The package's import graph: no cycle among module-level imports, and every module
imports on its own in a fresh interpreter (no import that works only because another
module happened to be imported first)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import matrixfsdp

PACKAGE = Path(matrixfsdp.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Package modules imported at module level (not inside functions, not under
    ``if TYPE_CHECKING``), resolved to module names."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            continue  # typing only, never run
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            stmts = [node]
        elif isinstance(node, (ast.If, ast.Try)):  # guarded imports still run at import time
            stmts = [s for s in ast.walk(node) if isinstance(s, (ast.Import, ast.ImportFrom))]
        else:
            continue  # imports inside functions are lazy: they cannot form an import cycle
        for s in stmts:
            if isinstance(s, ast.Import):
                targets = [a.name for a in s.names]
            else:
                base = s.module or ""
                if s.level:
                    up = package.split(".")
                    up = up[:len(up) - (s.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in s.names]
            found |= {t for t in targets if t in known and t != name}
    return found


def test_no_import_cycle():
    mods = _modules()
    graph = {n: _module_level_imports(n, p, set(mods)) for n, p in mods.items()}
    state: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """One interpreter imports the package once (so torch and every other dependency are
    loaded), forgets the package's own modules, then forks a child per module: each child
    starts with no matrixfsdp module loaded and imports only that one."""
    names = sorted(_modules())
    code = (
        "import os, sys, importlib, traceback\n"
        "import matrixfsdp, matrixfsdp.cli, matrixfsdp.bench.harness\n"
        "for m in [m for m in sys.modules if m == 'matrixfsdp' or m.startswith('matrixfsdp.')]:\n"
        "    del sys.modules[m]\n"
        f"names = {names!r}\n"
        "bad = []\n"
        "for n in names:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            importlib.import_module(n)\n"
        "        except BaseException:\n"
        "            traceback.print_exc()\n"
        "            os._exit(1)\n"
        "        os._exit(0)\n"
        "    if os.waitpid(pid, 0)[1] != 0:\n"
        "        bad.append(n)\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert len(names) > 40, names
