"""torch's private API, in one place.

Every name torch does not document as public that this package uses goes through this
module: what it does for us, and why no public API does it. Checked against torch 2.13.0
(the version the Makefile installs; the package asks for ``torch>=2.9``, whose other
versions were not installed here). ``tests/package/test_compat.py`` checks each entry against the
installed torch, and that no other module of the package names a private torch attribute.

Not counted as private: ``nn.Module``'s own registries (``_parameters``, ``_buffers``,
``_modules``, ``_non_persistent_buffers_set``), which torch's own public utilities read and
write in place (``nn.utils.parametrize``, FSDP2's ``fully_shard``), and the functional
``torch.optim.adam.adam``, which ``torch.optim.adam.__all__`` exports.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives  # noqa: F401 (benchmarks/parallel/ep_model.py)
from torch import nn
from torch._C._profiler import _EventType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

TORCH_CHECKED = ("2.13.0",)


# ---- autograd ----------------------------------------------------------------------------------
def all_gather_single(*args, **kwargs):
    """torch >= 2.13's name, or the older one (looked up at each call, as FSDP2 does)."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_single(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def in_backward() -> bool:
    """Whether this thread runs inside a backward pass (an optimizer stepped from a gradient
    hook; a hook that must not count recomputation). No public query exists;
    ``torch._C._current_graph_task_id`` is -1 outside any graph task."""
    return torch._C._current_graph_task_id() != -1


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass ends (after every gradient hook), as FSDP2's
    root post-backward does. No public API: autograd's engine ``queue_callback``."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (bumped by every in-place write): whether an
    initialiser wrote a tensor. ``Tensor._version``: no public accessor."""
    return t._version


# ---- tensor subclasses -------------------------------------------------------------------------
FOREACH_NORM = torch._foreach_norm  # what torch's clip_grad_norm_ / get_total_norm call
FOREACH_MUL_ = torch._foreach_mul_  # what torch's clip_grads_with_norm_ scales with
# FSDP2's reduce-scatter copy-in: each tensor cut into ``num_chunks`` along ``dim``, every
# chunk zero-padded to one size and written into ``out`` (one kernel, no padded copies)
CHUNK_CAT = torch._chunk_cat
DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl  # DTensor's own setting
# the aten op ``Tensor.to`` dispatches to (a tensor subclass's ``__torch_dispatch__`` sees it)
ATEN_TO_COPY = torch.ops.aten._to_copy.default


def plain_torch_function() -> Any:
    """A context in which a tensor subclass's ``__torch_function__`` calls torch as for a
    plain tensor (results stay plain): ``torch._C.DisableTorchFunctionSubclass``, what
    ``Tensor.__torch_function__`` itself enters."""
    return torch._C.DisableTorchFunctionSubclass()


def foreach_norm(tensors: list[torch.Tensor], p: float,
                 dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The ``p``-norm of each tensor in one kernel per device and dtype (``torch._foreach_norm``,
    which torch's ``clip_grad_norm_`` uses; ``torch.linalg.vector_norm`` is one kernel per
    tensor)."""
    return list(FOREACH_NORM(tensors, p, dtype=dtype))


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """Each tensor times ``scalar`` (a 0-d tensor on their device), in place, in one kernel
    per device and dtype (``torch._foreach_mul_``, what torch's ``clip_grads_with_norm_``
    scales with; torch's own checks hand it only exact ``torch.Tensor``s)."""
    FOREACH_MUL_(tensors, scalar)


# ---- DTensor -----------------------------------------------------------------------------------
def dtensor_spec(mesh: DeviceMesh | None, placements: tuple, shape: tuple[int, ...],
                 stride: tuple[int, ...], dtype: torch.dtype) -> DTensorSpec:
    """The spec ``DTensor.__new__`` takes (mesh, placements, global shape, stride, dtype):
    a ``DTensor`` subclass whose placement DTensor does not define (a range of rows) has no
    public constructor (``distribute_tensor`` and ``from_local`` compute with placements)."""
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))


def norm_partial(norm_type: float) -> Any:
    """The DTensor placement of a p-norm of this rank's piece, pending the norm over all
    ranks, as DTensor's own norms of sharded tensors place it (FSDP2's gradients):
    ``Partial("max")`` for ``inf``; for ``p > 0``, ``_NormPartial(p)`` (``p``-th powers
    summed, then the root), which no public placement says."""
    if norm_type == float("inf"):
        return Partial("max")
    from torch.distributed.tensor._ops._math_ops import _NormPartial
    return _NormPartial(norm_type)


def local_tensor(t: DTensor) -> torch.Tensor:
    """A ``DTensor``'s local tensor without ``to_local()``'s autograd and placement logic."""
    return t._local_tensor


# ---- meshes and process groups -----------------------------------------------------------------
def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself if none): ``DeviceMesh._get_root_mesh``."""
    return mesh._get_root_mesh()


def flattened_dims(mesh: DeviceMesh) -> dict[str, DeviceMesh]:
    """The dims flattened out of ``mesh`` (``mesh["a", "b"]._flatten("ab")``), by name:
    ``DeviceMesh._flatten_mapping`` (empty where torch has none)."""
    return dict(getattr(mesh, "_flatten_mapping", {}))


def flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dims as one named dim (torchtitan builds ``dp_shard_cp`` so):
    ``DeviceMesh._flatten``."""
    return mesh._flatten(name)


def default_store() -> dist.Store:
    """The default process group's store (where ranks post how far they got):
    ``distributed_c10d._get_default_store``."""
    return dist.distributed_c10d._get_default_store()


@contextlib.contextmanager
def coalescing(group: dist.ProcessGroup, device: torch.device | None):
    """The collectives issued inside go out as one launch (NCCL: one ``ncclGroupStart`` /
    ``ncclGroupEnd``, one kernel); yields a list that holds, on exit, the one work to wait
    for. ``ProcessGroup._start_coalescing`` / ``_end_coalescing``: what torch's own
    ``batch_isend_irecv`` and ``_coalescing_manager`` call (the latter's Python fast path
    would capture ``all_gather_into_tensor`` and refuse mixing it with other ops, so the
    group's own methods are called directly). Raises on a backend without coalescing
    (gloo: "does not implement startCoalescing")."""
    group._start_coalescing(device)
    works: list = []
    try:
        yield works
    finally:
        works.append(group._end_coalescing(device))


def set_group_timeout(group: dist.ProcessGroup, timeout: Any) -> None:
    """``group``'s collectives time out after ``timeout`` (a ``timedelta``) from now on, set on
    the group itself: ``distributed_c10d._set_pg_timeout`` (what torchtitan calls
    ``set_timeout``); no public API changes a made group's timeout, and a new group with
    the timeout would be another communicator on NCCL."""
    dist.distributed_c10d._set_pg_timeout(timeout, group)


def backend_timeout(group: dist.ProcessGroup, device: torch.device) -> Any:
    """The timeout a group's backend for ``device`` was made with (a ``timedelta``), or
    None: ``ProcessGroup._get_backend(device).options._timeout``. Raises if the group has no
    backend for that device."""
    return getattr(group._get_backend(device).options, "_timeout", None)


# ---- modules, compile, pipelining --------------------------------------------------------------
def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` compiled ``module`` in place (no wrapper module):
    ``nn.Module._compiled_call_impl``."""
    return getattr(module, "_compiled_call_impl", None) is not None


# torch.distributed.pipelining.PipelineStage's methods that call the stage's module
_STAGE_CALLERS = ("forward_maybe_with_nosync", "_compute_outputs")


# torch.distributed.pipelining.PipelineStage's method run after the first step's metadata
# inference (one real forward and backward): it clears FSDP2's gradients there (torch 2.9 to 2.13)
_STAGE_METADATA_CLEANUP = "_post_metadata_inference_cleanup"


def after_stage_metadata_inference(cls: type, then: Callable[[Any], None]) -> None:
    """Make ``cls`` (a subclass of torch's ``PipelineStage``) run ``then(stage)`` after torch's
    cleanup of its first step's metadata inference. Where this torch has no such method,
    :func:`check_stage_metadata_inference` refuses to build a stage (the cleanup would be
    skipped silently, and the inference's gradients kept)."""
    if not callable(getattr(cls, _STAGE_METADATA_CLEANUP, None)):
        return
    base = getattr(cls, _STAGE_METADATA_CLEANUP)

    def cleanup(stage: Any) -> None:
        base(stage)
        then(stage)

    setattr(cls, _STAGE_METADATA_CLEANUP, cleanup)


def check_stage_metadata_inference(cls: type) -> None:
    """Raise where :func:`after_stage_metadata_inference` could not extend this torch's stage."""
    if not callable(getattr(cls, _STAGE_METADATA_CLEANUP, None)):
        raise NotImplementedError(
            f"matrixfsdp: torch {torch.__version__}'s PipelineStage has no {_STAGE_METADATA_CLEANUP}, "
            "where matrixfsdp.integrations.pipelining.PipelineStage drops the gradients of the first "
            "step's shape inference; this torch is not supported by it (matrixfsdp._compat)")


def calling_pipeline_stage(module: nn.Module, depth: int = 18) -> Any:
    """The ``torch.distributed.pipelining`` stage whose forward is calling ``module`` now
    (None if none): read from the stack, a few frames up (the module call, its hooks), by
    the names of the stage's methods that call it (``forward_maybe_with_nosync``, at shape
    inference ``_compute_outputs``). torch's stage tells nothing to the module it calls."""
    frame = inspect.currentframe()
    for _ in range(depth):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return None
        if frame.f_code.co_name in _STAGE_CALLERS:
            stage = frame.f_locals.get("self")
            return stage if getattr(stage, "submod", None) is module else None
    return None


# ---- torch's optimizers ------------------------------------------------------------------------
@contextlib.contextmanager
def torch_muon_newton_schulz(fn: Callable[..., torch.Tensor]):
    """``torch.optim.Muon``'s Newton-Schulz replaced by ``fn(grad, ns_coefficients, ns_steps,
    eps)`` while entered (``make gpu-check``'s reference runs it in fp32; torch's casts to bf16
    and has no option): ``torch.optim._muon._zeropower_via_newtonschulz``, which its step looks
    up at each call."""
    from torch.optim import _muon
    original = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = fn
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


# ---- processes, profiling and the machine ------------------------------------------------------
def amx_tile_supported() -> bool:
    """Whether torch can use this CPU's AMX tiles (bf16 matmuls through oneDNN), as the
    machine descriptions of the benchmarks and ``matrixfsdp calibrate`` record it:
    ``torch.cpu._is_amx_tile_supported`` (False where this torch has no such query). No
    public query exists; ``torch.backends.cpu.get_cpu_capability`` names the vector ISA only."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())



def run_exit_handlers() -> None:
    """Run the ``atexit`` handlers now (before ``os._exit``): ``atexit._run_exitfuncs``,
    CPython's own exit path minus interpreter finalization."""
    atexit._run_exitfuncs()


# The tags of torch profiler's event tree (``TorchOp``, ``Allocation``), read by the bench.
PROFILER_EVENT_TYPE = _EventType
