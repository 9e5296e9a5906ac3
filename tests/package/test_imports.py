"""The package's import graph, read from every import statement (module level, inside
functions, under ``if TYPE_CHECKING``): no circle at any level, package modules imported
only at module level (a deferred import is for an optional dependency, never a way around
a circle), the layers' one-way order, no module over 450 lines, one name one meaning (no
public top-level name defined twice where a library module is one of the two), and every
module imports on its own in a fresh interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import matrixfsdp

PACKAGE = Path(matrixfsdp.__file__).parent
MAX_LINES = 450
# The layers, lowest first: a module may import its own layer and those below it.
# ``_compat`` is one module (torch's private API, test_compat.py), below everything;
# ``fully_shard`` is one module (the public fully_shard: the runtime's units, then torch's
# state-dict hooks and the optimizers' step hooks, calls down into three layers).
# ``costs`` is what a layout costs (``mf.plan_costs``; the advisor's memory, bytes and step
# time): arithmetic over ``layout`` and Muon's batching (``optim``), read from above.
# train is the training command; the advisor (plan, calibrate: calibrate launches ranks with
# train's launcher) and the test process groups sit on top, and nothing below imports them.
LAYERS = [("_compat",), ("layout",), ("diagnosis",), ("runtime",), ("tensors",), ("optim",),
          ("costs",), ("fully_shard",), ("state",), ("integrations",), ("train",),
          ("advisor", "testing")]
SINGLE_MODULE_LAYERS = {"matrixfsdp._compat", "matrixfsdp.fully_shard"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(package module imported, line, at module level) for every import statement."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deferred = {id(s) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                for s in ast.walk(f) if isinstance(s, (ast.Import, ast.ImportFrom))}
    found = []
    for s in ast.walk(tree):
        if isinstance(s, ast.Import):
            targets = [a.name for a in s.names]
        elif isinstance(s, ast.ImportFrom):
            base = s.module or ""
            if s.level:
                up = package.split(".")
                up = up[:len(up) - (s.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in s.names]
        else:
            continue
        for t in dict.fromkeys(targets):
            if t in known and t != name:
                found.append((t, s.lineno, id(s) not in deferred))
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {n: {t for t, _, _ in _imports(n, p, set(mods))} for n, p in mods.items()}


def _layer(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) < 2 or parts[1] == "__main__":
        return None  # the package's faces (API, command line): they may import every layer
    for i, group in enumerate(LAYERS):
        if parts[1] in group:
            return i
    return None


def test_no_import_circle_at_any_level():
    graph = _graph()
    state: dict[str, int] = {}
    circles = []

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                circles.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_package_modules_are_imported_at_module_level():
    mods = _modules()
    late = [f"{p.relative_to(PACKAGE.parent)}:{line} imports {t} inside a function"
            for n, p in mods.items() for t, line, top in _imports(n, p, set(mods)) if not top]
    assert not late, "\n".join(late)


def test_layers_import_downwards_only():
    graph = _graph()
    top = len(LAYERS) - 1  # the package's face (``import matrixfsdp``) counts as the top
    up = [f"{n} imports {m}" for n, targets in graph.items() for m in targets
          if _layer(n) is not None and (top if _layer(m) is None else _layer(m)) > _layer(n)]
    assert not up, "\n".join(sorted(up))


def test_every_module_sits_in_a_layer_folder_and_is_short():
    mods = _modules()
    loose = [n for n in mods if n not in ("matrixfsdp", "matrixfsdp.__main__")
             and (_layer(n) is None or (n.count(".") == 1 and n not in SINGLE_MODULE_LAYERS
                                        and not mods[n].name == "__init__.py"))]
    assert not loose, f"modules outside the layer folders: {loose}"
    long = {n: len(p.read_text().splitlines()) for n, p in mods.items()}
    long = {n: c for n, c in long.items() if c > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_planning_never_imports_torch_distributed():
    """``layout`` (what the runtime reads) and ``costs`` (what a layout costs): pure Python
    over shapes, so a 405B model plans and costs on one CPU core."""
    mods = _modules()
    planning = {_layer("matrixfsdp.layout"), _layer("matrixfsdp.costs")}
    bad = [n for n, p in mods.items() if _layer(n) in planning
           for s in ast.walk(ast.parse(p.read_text())) if isinstance(s, (ast.Import, ast.ImportFrom))
           if any(m.startswith("torch.distributed")
                  for m in ([a.name for a in s.names] if isinstance(s, ast.Import) else [s.module or ""]))]
    assert not bad, bad


def _library(name: str) -> bool:
    """The library: every module but the commands' (the command line, the training command,
    the advisor; their repeats among themselves, ``main``, ``parse_args``, are theirs)."""
    parts = name.split(".")
    return not (len(parts) > 1 and parts[1] in ("train", "advisor", "__main__")
                or name == "matrixfsdp.diagnosis.flight")


def _defined(path: Path) -> set[str]:
    """Public names a module defines at top level: functions, classes, assignments."""
    names = set()
    for s in ast.parse(path.read_text()).body:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(s.name)
        elif isinstance(s, (ast.Assign, ast.AnnAssign)):
            for t in s.targets if isinstance(s, ast.Assign) else [s.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return {n for n in names if not n.startswith("_")}


def test_one_name_one_meaning():
    """No public top-level name is defined in two modules where one of them is a library
    module: a name means one thing (a second use imports the first, or takes its own name)."""
    homes: dict[str, list[str]] = {}
    for n, p in _modules().items():
        for name in _defined(p):
            homes.setdefault(name, []).append(n)
    twins = {name: ms for name, ms in homes.items() if len(ms) > 1 and any(map(_library, ms))}
    assert not twins, "public names defined in two modules:\n" + "\n".join(
        f"{name}: {', '.join(ms)}" for name, ms in sorted(twins.items()))


FRESH = """
import os, sys, importlib, traceback
import torch
from torch import nn
from torch.optim import optimizer as opt_mod
from torch.nn.modules import module as mod_mod
import matrixfsdp as mf
print(sorted(n for n in sys.modules
             if n.split('.')[:2] in (['matrixfsdp', 'train'], ['matrixfsdp', 'testing'],
                                     ['matrixfsdp', 'advisor'])
             or n == 'matrixfsdp.__main__'))
hooks = lambda: (len(opt_mod._global_optimizer_pre_hooks), len(opt_mod._global_optimizer_post_hooks),
                 len(mod_mod._global_forward_pre_hooks), len(mod_mod._global_forward_hooks),
                 len(mod_mod._global_backward_hooks))
print(hooks())
names = [n for n in NAMES if n not in sys.modules]
print(len(names))
pids = {}
for n in names:  # all children at once: they run side by side on the cores
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(n)
            assert n == "matrixfsdp.__main__" or "matrixfsdp.__main__" not in sys.modules, \
                f"{n} imports the command line"
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    pids[pid] = n
bad = sorted(pids[pid] for pid in list(pids) if os.waitpid(pid, 0)[1] != 0)
print(bad)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 2000))
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
for _ in range(2):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mf.fully_shard(model[0]); mf.fully_shard(model)
print(hooks())
torch.distributed.destroy_process_group()
"""


@pytest.fixture(scope="module")
def fresh() -> list[str]:
    """One fresh interpreter: what ``import matrixfsdp`` loads and registers, then a forked
    child per module it did not load, then ``fully_shard`` twice: its output lines."""
    names = sorted(_modules())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", f"NAMES = {names!r}\n{FRESH}"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert len(names) > 40, names
    return out.stdout.splitlines()[-5:]


def test_every_module_imports_alone_in_a_fresh_interpreter(fresh):
    """A fresh interpreter imports the package (what any import of one of its modules runs
    first: ``__init__`` and every module it imports, in its order), then forks a child per
    module that this did not load (the command line, the bench, ...): each child imports only
    that one, and none but ``matrixfsdp.__main__`` loads the command line (the bench reaches
    the shared rank helpers through matrixfsdp.train.launch). (Re-importing the package in
    every child, as before, ran the same ``__init__`` in every child: 0.15 s of CPU each.)"""
    children, bad = fresh[2], fresh[3]
    assert int(children) > 10, fresh
    assert bad == "[]", bad


def test_import_loads_the_library_only_and_registers_no_hook(fresh):
    """``import matrixfsdp`` loads neither the training command, the advisor nor the test
    process groups (of the planner, only the cost model ``mf.plan_costs`` needs: ``costs``) and
    registers no process-wide hook; ``fully_shard`` registers torch's one process-wide optimizer step
    pre-hook that finds the optimizers over a sharded model (optim/watch.py), once however
    many models it shards."""
    loaded, at_import, after_shard = fresh[0], fresh[1], fresh[4]
    assert loaded == "[]", loaded
    assert at_import == "(0, 0, 0, 0, 0)", at_import
    assert after_shard == "(1, 0, 0, 0, 0)", after_shard
