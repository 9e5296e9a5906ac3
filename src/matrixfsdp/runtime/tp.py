"""Tensor parallelism: DTensor parameters (``parallelize_module``) under the owner layout.

``parallelize_module(block, mesh["tp"], plan)`` then ``fully_shard(block, mesh=mesh["dp"])``,
FSDP2's order and spelling. Every parameter the TP plan touched is a DTensor on the 1-D tp
mesh; the runtime treats it as FSDP2 does, with one difference for Muon matrices
(docs/nd-parallel.md):

* a **tp-split Muon matrix** (``Shard(0)``: ColwiseParallel, ``Shard(1)``: RowwiseParallel)
  lives whole on one rank of the data-parallel x tp grid: the plan picks its data-parallel
  owner ``d`` as for any matrix, then the tp rank ``t`` of row ``d`` that holds it
  (:func:`~matrixfsdp.layout.planner.make_plan`). Forward: the holder sends each tp rank
  of its row that rank's slice (one all-to-all over the tp group per unit), then each slice
  travels over its data-parallel group exactly like a 1-D matrix (a broadcast from row
  ``d``). Backward, the reverse: each slice's gradient is averaged to row ``d`` over the
  data-parallel group, then the slices go to the holder (one all-to-all per unit), which
  has the whole averaged gradient. ``optimizer.step()`` runs torch's Muon on the whole
  logical matrix with no collective.
* every other DTensor parameter (norms under ``SequenceParallel``, a ``Shard(0)`` head or
  embedding) is sharded over the data-parallel ranks by rows of its local tensor, as
  FSDP2 does; a ``Replicate`` parameter's gradient is all-reduced over tp first (FSDP2's
  ``redistribute`` to the parameter's placements).

In forward and backward the module sees DTensor parameters with the TP plan's placements
(whose local tensors view the gathered buffers); the optimizer sees plain tensors. The tp
all-to-alls run on groups of their own (twins of the tp group): the gathers' and the
gradients' travel at different moments in backward, and DTensor's own collectives use the
mesh's group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..diagnosis.timeouts import bound_timeout, group_timeout
from ..layout.types import ParamSpec, Placement
from .collectives import Comm, CommStats


@dataclass(frozen=True)
class TPSplit:
    """A tp rank's slice of a Muon matrix its tp group owns, as its optimizer step needs it:
    the whole matrix's ``shape``, the ``dim`` it is sliced along, and ``comm``, the tp
    group's collectives of the step (the Newton-Schulz's all-reduces,
    :func:`~matrixfsdp.optim.newton_schulz.newton_schulz_split_`)."""

    shape: tuple[int, int]
    dim: int
    comm: Comm

    def all_reduce(self, t: torch.Tensor) -> None:
        """``t`` summed over the tp group, in place (waited for): one launch of its own,
        counted in the ``step`` phase's launches."""
        self.comm.batch("step", [lambda: self.comm.all_reduce(t, divisor=1)]).wait()


@dataclass(frozen=True)
class TPParam:
    """How one parameter is laid out by the TP plan: its tp mesh, placements, and the
    global (logical) shape and stride DTensor reports."""

    mesh: DeviceMesh
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def shard_dim(self) -> int | None:
        (pl,) = self.placements
        return pl.dim if isinstance(pl, Shard) else None

    def wrap(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """An unsharded parameter for forward: a DTensor on the tp mesh viewing ``local``."""
        return nn.Parameter(DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                               shape=torch.Size(self.shape), stride=self.stride),
                            requires_grad=requires_grad)

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """A gradient of the wrapped parameter as this rank's local tensor, in the
        parameter's placements (a ``Partial`` one is reduced over tp first, as FSDP2 does)."""
        if grad is None or not isinstance(grad, DTensor):
            return grad
        if tuple(grad.placements) != self.placements:
            grad = grad.redistribute(placements=self.placements)
        return grad.to_local()


def tp_param(fqn: str, p: torch.Tensor) -> TPParam | None:
    """The TP layout of parameter ``p`` (None for a plain tensor); refuses what the runtime
    cannot lay out, naming the parameter."""
    if not isinstance(p, DTensor):
        return None
    mesh, placements = p.device_mesh, tuple(p.placements)
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"matrixfsdp: parameter '{fqn}' is a DTensor on a {mesh.ndim}-D mesh {mesh}; "
            "tensor parallelism composes on a 1-D tp mesh (parallelize_module(module, "
            "mesh['tp'], ...)) before fully_shard")
    (pl,) = placements
    if not isinstance(pl, (Shard, Replicate)):
        raise NotImplementedError(f"matrixfsdp: parameter '{fqn}' has placement {pl}; only "
                                  "Shard and Replicate DTensor parameters are supported")
    if isinstance(pl, Shard) and p.shape[pl.dim] % mesh.size():
        raise NotImplementedError(
            f"matrixfsdp: parameter '{fqn}' {tuple(p.shape)} is split over {mesh.size()} tp ranks "
            f"along dim {pl.dim}, which they do not divide; pad that dim to a multiple of "
            f"{mesh.size()} (uneven TP shards are not supported)")
    return TPParam(mesh, placements, tuple(p.shape), tuple(p.stride()))


def tp_spec(spec: ParamSpec, info: TPParam | None) -> ParamSpec:
    """The planner's view of a DTensor parameter: a 2-D Muon matrix split along dim 0 or 1
    is planned whole (its logical shape, split ``tp`` ways); an expert stack split by
    whole experts over an ep mesh (Shard(0)) as this rank's stack of experts; any other
    DTensor parameter as its local tensor (what FSDP2 shards)."""
    if info is None:
        return spec
    dim, size = info.shard_dim, info.mesh.size()
    if spec.muon and dim is not None and size > 1:
        if len(info.shape) == 3 and dim != 0:
            raise NotImplementedError(
                f"matrixfsdp: expert stack '{spec.name}' {info.shape} is split over its mesh "
                f"{info.mesh.mesh_dim_names} along dim {dim}; experts split within a matrix "
                "(expert tensor parallelism) are not supported: split whole experts (Shard(0), "
                "expert parallelism)")
        if len(info.shape) == 2:
            return replace(spec, shape=info.shape, tp=size, tp_dim=dim)
    # expert parallelism (a Shard(0) expert stack: this rank's experts, each a Muon matrix
    # of its own) and every other DTensor: the local tensor
    local = tuple(n // size if d == dim else n for d, n in enumerate(info.shape))
    return replace(spec, shape=local)


def global_placement(pl: Placement, info: TPParam | None) -> Placement:
    """``pl`` (as this tp rank stores it) in the coordinates of the whole (logical) tensor,
    what checkpoints and optimizer states name: a ``Shard(0)`` DTensor's local tensor is
    rows ``[t R, (t+1) R)`` of the global one (``t``: this rank on the DTensor's mesh, tp or
    ep); a tp rank's slice of a matrix its tp group owns is its rows, or (split along dim
    1) its columns ``[t C, (t+1) C)``, of the whole matrix. A tp-split matrix owned by one
    tp rank (planned whole), a ``Replicate`` or a plain parameter is already global. A
    ``Shard(1)`` parameter that is no Muon matrix keeps its local placement (``global_ok``
    says the state functions refuse it)."""
    if info is None or pl.spec.tp > 1 or info.shard_dim is None:
        return pl
    t, size = info.mesh.get_local_rank(), info.mesh.size()
    group = pl.spec.muon and pl.owner is not None and len(info.shape) == 2 and size > 1
    if group:  # a tp rank's slice of a matrix its tp group owns
        spec = replace(pl.spec, shape=info.shape, tp=size, tp_dim=info.shard_dim)
        if info.shard_dim == 1:
            c = pl.spec.shape[1]
            return Placement(spec, pl.owner, list(pl.row_ranges), None, (t * c, (t + 1) * c))
        off = t * pl.spec.rows
        return Placement(spec, pl.owner, [(a + off, b + off) for a, b in pl.row_ranges], None)
    if info.shard_dim != 0:
        return pl
    off = t * pl.spec.rows
    return Placement(replace(pl.spec, shape=info.shape), pl.owner,
                     [(a + off, b + off) for a, b in pl.row_ranges], pl.tp_owner)


def global_ok(pl: Placement, info: TPParam | None) -> bool:
    """Whether :func:`global_placement` places ``pl`` in the whole tensor."""
    return info is None or pl.spec.tp > 1 or info.shard_dim in (None, 0) or pl.cols is not None


def slice_shape(spec: ParamSpec) -> tuple[int, ...]:
    """The shape of one tp rank's slice of a tp-split matrix."""
    return spec.slice_shape


def tp_slice(full: torch.Tensor, spec: ParamSpec, s: int) -> torch.Tensor:
    """Tp rank ``s``'s slice of the whole matrix ``full`` (a view)."""
    n = spec.shape[spec.tp_dim] // spec.tp
    return full.narrow(spec.tp_dim, s * n, n)


def check_tp_mesh(tp_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
    """The tp mesh and the data-parallel mesh must be orthogonal slices of one mesh: each
    data-parallel group holds one tp coordinate, each tp group one data-parallel one."""
    dp_ranks = set(dp_mesh.mesh.flatten().tolist())
    tp_ranks = set(tp_mesh.mesh.flatten().tolist())
    if dp_ranks & tp_ranks != {dist.get_rank()}:
        raise ValueError(
            f"matrixfsdp: the tensor-parallel mesh {tp_mesh} and the fully_shard mesh {dp_mesh} "
            f"share the ranks {sorted(dp_ranks & tp_ranks)}; pass fully_shard the data-parallel "
            "dims of the same mesh the TP plan used (mesh['dp'] next to mesh['tp'])")


class TPGroups:
    """This rank's tp group (from the DTensor parameters' mesh) and the runtime's collectives
    over it, each a counted :class:`~matrixfsdp.runtime.collectives.Comm` on one group:
    ``gather`` (forward and backward gathers), ``grads`` (the gradients' last hop) and
    ``step`` (the Newton-Schulz of the matrices the tp group owns, in the optimizer step):
    the mesh's own group, its timeout bounded by the world's (no group made). One group serves
    both: a unit's gradient hop is issued right after its shard-group reduce (from the side
    stream, :meth:`~matrixfsdp.runtime.streams.Streams.chain`) or, without streams, where the
    schedule finishes that reduce (:meth:`~matrixfsdp.runtime.overlap.Schedule.add_reduce`):
    either way at a point the order of the units sets, so every rank interleaves hops and
    gathers alike (one communicator, not two, on NCCL)."""

    def __init__(self, mesh: DeviceMesh, stats: CommStats):
        self.mesh = mesh
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        limit = group_timeout(dist.group.WORLD, mesh.device_type)
        group = bound_timeout(mesh.get_group(), limit, mesh.device_type)
        self.gather = Comm(group, stats, "tp_")
        self.grads = Comm(group, stats, "tp_grad_")
        self.step = Comm(group, stats, "tp_step_")


# ---- torch.compile around the root --------------------------------------------------------
def refuse_compile_under_tp(module: nn.Module, args) -> None:
    """Forward pre-hook of every unit whose module holds DTensor parameters, run right after
    the unit's first-use sharding: on the root of a model with tensor parallelism it refuses
    ``torch.compile(model)`` (or a compiled function that calls the model), whether the root
    was made at the outer ``fully_shard`` call or is being made by this very forward (a
    model whose root is its only unit). Dynamo would compile the blocks' forwards, which on
    torch 2.13 compute wrong gradients when fed the TP plan's pending collective results
    (the case ``unit.py`` refuses for ``module.compile()`` on a block).

    Unlike the units' other hooks it is not ``torch.compiler.disable``d, so Dynamo traces it,
    and there ``is_compiling()`` is True; the raise is left to :func:`refuse_compiled`,
    which is disabled: Dynamo breaks the graph at the call and runs it eagerly, so the error
    reaches the caller (a ``raise`` traced by Dynamo itself is dropped with the frame it
    falls back from, which then runs eagerly with ``is_compiling()`` False: measured).
    Eager forwards pay one ``is_compiling()`` call."""
    if torch.compiler.is_compiling():
        root = module._mf_unit.root
        if root is not None and root.tp is not None and root.module is module:
            refuse_compiled(f"torch.compile around {type(module).__name__}, the root (Dynamo "
                            "would compile its blocks' forwards)")


@torch.compiler.disable
def refuse_compiled(how: str) -> None:
    """The one refusal of ``torch.compile`` in a model with tensor parallelism, wherever it
    is found (``how``: a block's ``module.compile()`` at its forward, a ``torch.compile(block)``
    wrapper inside the model at the root's registration check, ``torch.compile`` around the
    root at its traced pre-hook). Not traced by Dynamo (``compiler.disable``), so the error
    reaches the caller from inside a compiled frame too."""
    raise NotImplementedError(
        f"matrixfsdp: {how} in a model with tensor parallelism: on torch 2.13 a compiled "
        "block fed the TP plan's pending collective results computes wrong gradients (1e-4 "
        "off one process, measured; under FSDP2 + TP it crashes). Train TP models eagerly, "
        "without torch.compile (docs/compile.md)")
