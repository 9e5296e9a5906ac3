"""torch's private API lives in ``matrixfsdp/_compat.py`` only: each entry does what the
library relies on, on the installed torch, and no other module of the package names a
private torch module, function or attribute."""

from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

import matrixfsdp
from matrixfsdp import _compat

PACKAGE = Path(matrixfsdp.__file__).parent
# torch's (and CPython's) private attributes the library needed at some point, looked for on
# any object (our own attributes never use these names)
PRIVATE_ATTRIBUTES = {
    "_execution_engine", "_current_graph_task_id", "_get_root_mesh", "_flatten_mapping", "_flatten",
    "_get_default_store", "_get_backend", "_timeout", "_compiled_call_impl", "_spec",
    "_local_tensor", "_version", "_getframe", "_run_exitfuncs", "_foreach_norm", "_to_scalar",
    "_ConvNd", "_disabled_torch_function_impl", "DisableTorchFunctionSubclass", "_EventType",
}
ROOTS = {"torch", "dist", "nn", "sys", "atexit", "F"}  # module aliases an attribute chain starts at
ALLOWED = {"_compat.py"}  # at most two files may hold torch's private names
ACCESSORS = {"getattr", "hasattr", "setattr", "delattr"}  # a private name may hide in a string


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _torch_names(tree: ast.AST) -> set[str]:
    """The names a module binds to torch's modules and objects (``import torch.x as y``,
    ``from torch.x import y``): an attribute chain starting at one reaches into torch."""
    names = set(ROOTS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    return names


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    roots = _torch_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            names = node.module.split(".") + [a.name for a in node.names]
            if any(n.startswith("_") for n in names):
                found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch"
                      and any(p.startswith("_") for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            root = value.id if isinstance(value, ast.Name) else None
            if node.attr in PRIVATE_ATTRIBUTES or (root in roots and any(_private(a) for a in chain)):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ACCESSORS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            # getattr(torch.cpu, "_is_amx_tile_supported", ...): a private name as a string
            target = node.args[0]
            while isinstance(target, ast.Attribute):
                target = target.value
            if node.args[1].value in PRIVATE_ATTRIBUTES or (
                    isinstance(target, ast.Name) and target.id in roots):
                found.append(f"{path.name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_module_but_compat_names_torch_private_api():
    uses = {str(p.relative_to(PACKAGE)): u for p in sorted(PACKAGE.rglob("*.py"))
            if p.name not in ALLOWED and (u := _private_uses(p))}
    assert not uses, uses
    assert _private_uses(PACKAGE / "_compat.py"), "the scan finds nothing in _compat.py itself"


def test_the_scan_sees_private_names_behind_aliases_and_in_strings(tmp_path):
    """What the scan must catch, each written as a library module could: an attribute chain
    from a name imported from torch, and a private name handed to getattr as a string."""
    cases = {
        "alias.py": "import torch.distributed.checkpoint as dcp\nx = dcp.state_dict_saver._x\n",
        "from_import.py": "from torch.distributed import distributed_c10d as c10d\nc10d._world\n",
        "string.py": "import torch\namx = getattr(torch.cpu, '_is_amx_tile_supported', None)\n",
        "private_module.py": "from torch.distributed.tensor._dtensor_spec import DTensorSpec\n",
        "public.py": ("import torch\nclass A:\n    def f(self):\n"
                      "        return self._x, getattr(self, '_y', 0)\n"),
    }
    for name, code in cases.items():
        (tmp_path / name).write_text(code)
        assert bool(_private_uses(tmp_path / name)) == (name != "public.py"), name


def test_benchmarks_and_tools_use_torch_privates_only_through_compat():
    """The repository's own code outside the package (benchmarks/, studies/, tools/) reaches torch's
    private API through ``matrixfsdp._compat`` too, so one module says what is private."""
    root = PACKAGE.parent.parent
    uses = {str(p.relative_to(root)): u for folder in ("benchmarks", "studies", "tools")
            for p in sorted((root / folder).rglob("*.py")) if (u := _private_uses(p))}
    assert not uses, uses


def test_autograd_entries():
    assert not _compat.in_backward()
    seen, ended = [], []
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()
    x.register_hook(lambda g: seen.append(_compat.in_backward())
                    or _compat.queue_backward_callback(lambda: ended.append(True)))
    y.backward()
    assert seen == [True] and ended == [True]
    t = torch.zeros(2)
    before = _compat.tensor_version(t)
    t.add_(1)
    assert _compat.tensor_version(t) == before + 1


def test_torch_muon_newton_schulz():
    calls = []

    def ns(grad, *args):
        calls.append(grad.shape)
        return torch.zeros_like(grad)
    p = nn.Parameter(torch.ones(3, 4))
    opt = torch.optim.Muon([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.ones(3, 4)
    with _compat.torch_muon_newton_schulz(ns):
        opt.step()
    assert calls == [(3, 4)] and torch.equal(p, torch.ones(3, 4))  # a zero update from ns
    p.grad = torch.ones(3, 4)
    opt.step()  # torch's own again
    assert calls == [(3, 4)] and not torch.equal(p, torch.ones(3, 4))


def test_tensor_subclass_entries():
    ts = [torch.randn(3, 4), torch.randn(5)]
    assert _compat.FOREACH_NORM is torch._foreach_norm
    got = _compat.foreach_norm(ts, 2.0, dtype=torch.float64)
    assert all(torch.equal(g, torch.linalg.vector_norm(t, 2.0, dtype=torch.float64)) for g, t in zip(got, ts))

    class Plain(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            with _compat.plain_torch_function():
                return func(*args, **(kwargs or {}))

    out = torch.ones(2).as_subclass(Plain) + 1
    assert type(out) is torch.Tensor
    assert callable(_compat.DISABLED_TORCH_FUNCTION)
    assert {"TorchOp", "Allocation"} <= set(dir(_compat.PROFILER_EVENT_TYPE))


def test_module_entries():
    m = nn.Linear(2, 2)
    assert not _compat.compiled_in_place(m)
    m.compile()
    assert _compat.compiled_in_place(m)
    assert _compat.calling_pipeline_stage(m) is None  # no stage on the stack


def test_distributed_entries(world1):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    assert _compat.root_mesh(mesh["a"]) is mesh
    flat = _compat.flatten(mesh["a", "b"], "ab")
    assert flat.size() == 1 and "ab" in _compat.flattened_dims(mesh)
    store = _compat.default_store()
    store.set("matrixfsdp_compat", "1")
    assert store.get("matrixfsdp_compat") == b"1"
    timeout = _compat.backend_timeout(dist.group.WORLD, torch.device("cpu"))
    assert timeout is not None and timeout.total_seconds() > 0
    d = DTensor.from_local(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Replicate()])
    assert torch.equal(_compat.local_tensor(d), torch.arange(4.0))
    spec = _compat.dtensor_spec(d.device_mesh, (Replicate(),), (4,), (1,), torch.float32)
    assert spec.shape == torch.Size([4]) and spec.placements == (Replicate(),)
    assert _compat.functional_collectives.all_gather_tensor is not None
    # a norm pending over the mesh: DTensor's own norms of sharded tensors are placed so
    n = DTensor.from_local(torch.tensor(5.0), d.device_mesh, [_compat.norm_partial(2.0)])
    assert n.placements[0].is_partial() and torch.equal(n.full_tensor(), torch.tensor(5.0))
    assert _compat.norm_partial(float("inf")) == Partial("max")
    # a made group's timeout, set in place (HSDP's and tp's groups bounded by the world's)
    group = dist.new_group([0])
    _compat.set_group_timeout(group, timedelta(seconds=7))
    assert _compat.backend_timeout(group, torch.device("cpu")) == timedelta(seconds=7)
    # coalescing: gloo refuses it (its units then take one launch per op)
    with pytest.raises(RuntimeError, match="does not implement startCoalescing"):
        with _compat.coalescing(dist.group.WORLD, torch.device("cpu")):
            pass


def test_machine_entries():
    assert isinstance(_compat.amx_tile_supported(), bool)


@pytest.mark.parametrize("name", ["run_exit_handlers"])
def test_exit_entry_exists(name):  # exercised by tests/runtime/test_exit.py in a child process
    assert callable(getattr(_compat, name))


def test_pipeline_stage_runs_its_own_after_torch_s_metadata_cleanup():
    """The library's stage extends torch's cleanup after the first step's shape inference
    (``_compat.after_stage_metadata_inference``); a torch without that method is refused when
    a stage is built, never skipped silently."""
    from torch.distributed import pipelining

    from matrixfsdp.integrations.pipelining import PipelineStage
    name = _compat._STAGE_METADATA_CLEANUP
    assert callable(getattr(pipelining.PipelineStage, name))
    assert getattr(PipelineStage, name) is not getattr(pipelining.PipelineStage, name)
    seen = []

    class Stage:  # torch's method stands in; the library's runs after it
        def _post_metadata_inference_cleanup(self):
            seen.append("torch")
    _compat.after_stage_metadata_inference(Stage, lambda stage: seen.append("ours"))
    Stage()._post_metadata_inference_cleanup()
    assert seen == ["torch", "ours"]
    with pytest.raises(NotImplementedError, match=name):
        _compat.check_stage_metadata_inference(type("Other", (), {}))
