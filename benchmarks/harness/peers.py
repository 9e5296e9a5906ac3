"""Peer Muon systems for the benchmark, each applied to a model already sharded by FSDP2.

The model must have been sharded with ``torch.distributed.fsdp.fully_shard`` (each block,
then the root) on a 1-D mesh, so every parameter is a ``DTensor`` with ``Shard(0)``.
``muon_params`` are the 2-D matrices for Muon, ``adamw_params`` everything else.
Hyperparameters follow ``torch.optim.Muon``: Nesterov momentum, NS coefficients
(3.4445, -4.775, 2.0315), 5 NS steps in bf16, ``adjust_lr_fn="original"``
(``lr * sqrt(max(1, rows/cols))`` on the *global* matrix shape), and decoupled weight
decay ``p *= 1 - lr * wd``. AdamW is ``torch.optim.AdamW`` semantics with the ``adamw_*``
hyperparameters.

Peers
-----
``build_torch_muon``
    ``torch.optim.Muon`` applied directly to the DTensor parameters (DTensor sharding
    propagation gathers each matrix implicitly; NS runs redundantly on every rank) plus
    ``torch.optim.AdamW``. This is the reference semantics, so there are no differences.

``build_dist_muon``
    torchtitan 0.3.0 ``DistMuon`` (``torchtitan.distributed.flex_shard.build_dist_muon``)
    with ``ComputeLayout({axis: Owned()})`` for every Muon matrix and one ``BucketConfig``
    per block, combined with ``torch.optim.AdamW`` the way torchtitan does it: through
    ``torchtitan.components.optimizer.OptimizersContainer`` (one ``DistMuon`` group and
    one ``AdamW`` group, selected by exact FQN). Every option is passed explicitly
    (``DistMuon``'s defaults equal ``torch.optim.Muon``'s; ``adjust_lr_fn="original"``).
    Differences from ``torch.optim.Muon`` that cannot be configured:

    * the NS kernel is the same algorithm (``addmm`` form, clamp-normalisation with
      ``eps``) but runs on the owner only; the direction is copied back into an fp32
      buffer before ``param.add_`` -- rounding-level only;
    * it requires every configured Muon parameter to have a gradient at ``step()``
      (torch skips parameters whose ``grad`` is ``None``);
    * the storage mesh must have named axes (``init_device_mesh(..., mesh_dim_names=...)``),
      because compute layouts are keyed by mesh-axis name;
    * AdamW runs through the container with ``foreach=True`` on CUDA and the for-loop
      implementation elsewhere, i.e. the same choice ``torch.optim.AdamW`` makes by default.

    CPU/gloo shim (benchmark only, active only while ``build_dist_muon`` constructs the
    optimizer, restored afterwards; see ``_dist_muon_cpu_shim``): as shipped, DistMuon

    1. rejects non-CUDA storage in ``DistMuon._validate_parameter_storage``
       ("DistMuon requires one CUDA device per process"); the shim accepts exactly one
       CPU device per process and defers to the original for anything else;
    2. creates its transfer stream with ``device_handle.Stream(device=device, priority=0)``
       in ``_CommunicationContext.create``, which ``torch.cpu.Stream`` does not accept; for
       CPU the shim builds the same context with ``torch.cpu.Stream(priority=0)``.

    Both are construction-time only (the context is created once and reused by
    ``step()``). CPU streams and events are no-ops and the ``all_to_all_single`` calls are
    synchronous, so the algorithm, the bucket plans and the collectives are unchanged.

``build_muon_fsdp2``
    muon-fsdp2 0.3.0 ``muon_fsdp2.Muon`` with a ``use_muon=True`` group (``rms_scale=False``
    gives torch's "original" lr scaling, ``nesterov=True``, ``ns_steps=5``) and a
    ``use_muon=False`` group for the rest, which uses the package's own AdamW (bias-corrected
    Adam with decoupled ``p *= 1 - lr*wd``: the same update as ``torch.optim.AdamW`` with
    ``amsgrad=False``). Each matrix is gathered to rank ``index % world`` (index within the
    group), orthogonalised there and scattered back. Differences that cannot be configured:

    * NS coefficients (3.4445, -4.775, 2.0315) and bf16 are hard-coded (equal to torch's
      defaults); the Frobenius normalisation divides by ``norm + 1e-7`` rather than
      ``norm.clamp(min=1e-7)``, and the NS loop is ``torch.compile``-d (needs a C++
      compiler on CPU; the first step compiles) -- rounding-level differences only;
    * the aspect-ratio scale multiplies the fp32 copy of the NS output instead of the lr;
    * parameters whose ``grad`` is ``None`` get a zero gradient and are still stepped
      (weight decay, momentum / Adam moments), where torch skips them;
    * it gathers with equal-size ``torch.distributed.gather``, so every Muon matrix's
      row count must be divisible by the world size (uneven FSDP2 shards fail);
    * the AdamW ``eps`` default is 1e-10 and there is no ``amsgrad``; ``adamw_eps`` is
      always passed explicitly.

The exact peer versions are installed with ``pip install --no-deps`` by the Makefile
(``PEERS``): torchtitan's ``flex_shard`` and optimizer container import only those beyond
torch.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from matrixfsdp.layout.planner import plan_module
from matrixfsdp.optim.muon import MUON_DEFAULTS

__all__ = ["build_dist_muon", "build_muon_fsdp2", "build_torch_muon"]

# Every system runs Muon's default Newton-Schulz (torch's and ours).
NS_COEFFICIENTS = MUON_DEFAULTS["ns_coefficients"]
NS_STEPS = MUON_DEFAULTS["ns_steps"]
NS_EPS = MUON_DEFAULTS["eps"]


def _check_split(muon_params: Sequence[torch.Tensor],
                 adamw_params: Sequence[torch.Tensor]) -> None:
    muon_ids = {id(p) for p in muon_params}
    adamw_ids = {id(p) for p in adamw_params}
    if muon_ids & adamw_ids:
        raise ValueError("a parameter is in both muon_params and adamw_params")
    for p in muon_params:
        if p.ndim != 2:
            raise ValueError(f"Muon only supports 2-D parameters, got shape {tuple(p.shape)}")


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


# ---------------------------------------------------------------- torch.optim.Muon


def build_torch_muon(muon_params: Sequence[torch.Tensor],
                     adamw_params: Sequence[torch.Tensor], *, lr: float, weight_decay: float,
                     momentum: float, adamw_lr: float, adamw_betas: tuple[float, float],
                     adamw_eps: float, adamw_weight_decay: float) -> list[torch.optim.Optimizer]:
    """``torch.optim.Muon`` on the DTensor matrices plus ``torch.optim.AdamW`` on the rest.

    Returns the optimizers as a list; step and zero_grad each of them.
    """
    muon_params, adamw_params = list(muon_params), list(adamw_params)
    _check_split(muon_params, adamw_params)
    optimizers: list[torch.optim.Optimizer] = []
    if muon_params:
        optimizers.append(torch.optim.Muon(
            muon_params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True,
            ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS, ns_steps=NS_STEPS,
            adjust_lr_fn="original"))
    if adamw_params:
        optimizers.append(torch.optim.AdamW(adamw_params, lr=adamw_lr, betas=adamw_betas,
                                            eps=adamw_eps, weight_decay=adamw_weight_decay))
    return optimizers


# ---------------------------------------------------------------- torchtitan DistMuon


@contextlib.contextmanager
def _dist_muon_cpu_shim() -> Iterator[None]:
    """Let torchtitan 0.3.0 DistMuon be constructed on CPU (gloo) for the benchmark.

    Patches, for the duration of the ``with`` block only, the two construction-time points
    described in the module docstring; restores the originals on exit.
    """
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed.flex_shard import _optimizer_reshard_runtime as rt
    from torchtitan.distributed.flex_shard.dist_muon import DistMuon

    orig_validate = DistMuon.__dict__["_validate_parameter_storage"]
    orig_create = rt._CommunicationContext.__dict__["create"]

    def _validate_parameter_storage(self) -> torch.device:
        devices = {p.to_local().device for g in self.param_groups for p in g["params"]
                   if isinstance(p, DTensor)}
        if len(devices) == 1 and next(iter(devices)).type == "cpu":
            if any(not isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
                raise TypeError("DistMuon requires DTensor parameters")
            return devices.pop()
        return orig_validate(self)

    def create(cls, device: torch.device):
        if torch.device(device).type != "cpu":
            return orig_create.__func__(cls, device)
        handle = torch.get_device_module(device)
        # The only change: torch.cpu.Stream takes no ``device`` argument.
        transfer_stream = handle.Stream(priority=0)

        def create_slot():
            return rt._PipelineSlot(buffers=rt._BufferSlot(), compute_input_ready=handle.Event(),
                                    compute_done=handle.Event(), done=handle.Event())

        return cls(device_handle=handle, transfer_stream=transfer_stream,
                   slots=tuple(create_slot() for _ in range(rt._NUM_PIPELINE_SLOTS)))

    DistMuon._validate_parameter_storage = _validate_parameter_storage
    rt._CommunicationContext.create = classmethod(create)
    try:
        yield
    finally:
        DistMuon._validate_parameter_storage = orig_validate
        rt._CommunicationContext.create = orig_create


def _exact_pattern(fqns: Sequence[str]) -> str:
    return "^(?:" + "|".join(re.escape(f) for f in fqns) + ")$"


def build_dist_muon(model: nn.Module, mesh, blocks: Sequence[nn.Module],
                    muon_params: Sequence[torch.Tensor], adamw_params: Sequence[torch.Tensor], *,
                    lr: float, weight_decay: float, momentum: float, adamw_lr: float,
                    adamw_betas: tuple[float, float], adamw_eps: float,
                    adamw_weight_decay: float):
    """torchtitan 0.3.0 DistMuon (``Owned()`` per matrix, one bucket per block) + AdamW.

    Returns torchtitan's ``OptimizersContainer`` (``.step()``, ``.zero_grad()``).
    ``mesh`` is the 1-D FSDP2 mesh; it must have a named axis.
    """
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.distributed.flex_shard import ComputeLayout, Owned

    muon_params, adamw_params = list(muon_params), list(adamw_params)
    axis = _dist_muon_axis(mesh, model, muon_params, adamw_params)
    names = _names(model)
    muon_fqns = [canonical_fqn(names[id(p)]) for p in muon_params]
    adamw_fqns = [canonical_fqn(names[id(p)]) for p in adamw_params]
    owned = ComputeLayout(shardings_by_mesh_axis={axis: Owned()})
    on_cuda = any(p.device.type == "cuda" for p in muon_params + adamw_params)
    groups = []
    if muon_fqns:
        groups.append(ParamGroupConfig(
            pattern=_exact_pattern(muon_fqns), optimizer_name="DistMuon",
            optimizer_kwargs=dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                  nesterov=True, ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS,
                                  ns_steps=NS_STEPS, adjust_lr_fn="original",
                                  foreach=False, fused=False)))
    if adamw_fqns:
        groups.append(ParamGroupConfig(
            pattern=_exact_pattern(adamw_fqns), optimizer_name="AdamW",
            optimizer_kwargs=dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                                  weight_decay=adamw_weight_decay)))
    config = OptimizersContainer.Config(
        param_groups=groups,
        implementation="foreach" if on_cuda else "for-loop",
        optimizer_factory_kwargs_by_name={"DistMuon": {
            "compute_sharding_by_fqn": {f: owned for f in muon_fqns},
            "bucket_configs": _block_buckets(model, blocks, muon_fqns)}})
    with _dist_muon_cpu_shim():
        return OptimizersContainer(config, model_parts=[model])


def _dist_muon_axis(mesh, model: nn.Module, muon_params: list, adamw_params: list) -> str:
    """The FSDP2 mesh's axis name, after checking what DistMuon needs."""
    from torch.distributed.tensor import DTensor

    _check_split(muon_params, adamw_params)
    if mesh.ndim != 1:
        raise ValueError(f"expected the 1-D FSDP2 mesh, got a {mesh.ndim}-D mesh")
    if mesh.mesh_dim_names is None:
        raise ValueError("torchtitan DistMuon keys compute layouts by mesh-axis name: create the "
                         "FSDP2 mesh with init_device_mesh(..., mesh_dim_names=('fsdp',))")
    names = _names(model)
    for p in muon_params:
        if not isinstance(p, DTensor) or id(p) not in names:
            raise ValueError("muon_params must be DTensor parameters of the FSDP2-sharded model")
    return mesh.mesh_dim_names[0]


def _block_buckets(model: nn.Module, blocks: Sequence[nn.Module], muon_fqns: list[str]) -> tuple:
    """One DistMuon bucket per block, in block order; Muon matrices outside every block
    get a last one."""
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.distributed.flex_shard import BucketConfig

    prefixes = {id(m): canonical_fqn(n) for n, m in model.named_modules()}
    buckets, claimed = [], set()
    for i, block in enumerate(blocks):
        if id(block) not in prefixes:
            raise ValueError(f"block {i} is not a submodule of the model")
        prefix = prefixes[id(block)]
        fqns = [f for f in muon_fqns if f not in claimed and (not prefix or f.startswith(prefix + "."))]
        if fqns:
            buckets.append(BucketConfig(patterns=tuple(fqns), name=prefix or f"block{i}"))
            claimed.update(fqns)
    rest = [f for f in muon_fqns if f not in claimed]
    if rest:
        buckets.append(BucketConfig(patterns=tuple(rest), name="rest"))
    return tuple(buckets)


# ---------------------------------------------------------------- muon-fsdp2


def build_muon_fsdp2(muon_params: Sequence[torch.Tensor],
                     adamw_params: Sequence[torch.Tensor], *, lr: float, weight_decay: float,
                     momentum: float, adamw_lr: float, adamw_betas: tuple[float, float],
                     adamw_eps: float, adamw_weight_decay: float):
    """muon-fsdp2 0.3.0 ``Muon`` with a ``use_muon`` group per kind (rms_scale=False)."""
    from muon_fsdp2 import Muon

    muon_params, adamw_params = list(muon_params), list(adamw_params)
    _check_split(muon_params, adamw_params)
    groups = []
    if muon_params:
        groups.append(dict(params=muon_params, use_muon=True, lr=lr, momentum=momentum,
                           weight_decay=weight_decay, rms_scale=False, nesterov=True,
                           ns_steps=NS_STEPS))
    if adamw_params:
        groups.append(dict(params=adamw_params, use_muon=False, lr=adamw_lr,
                           betas=tuple(adamw_betas), eps=adamw_eps,
                           weight_decay=adamw_weight_decay))
    return Muon(groups)


def split_muon(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(muon, adamw)`` parameters: the peers' Muon matrices are exactly the ones
    MatrixFSDP's default rule picks."""
    plan = plan_module(model, list(model.layers), world_size=1)
    names = {pl.spec.name for pl in plan.placements.values() if pl.spec.muon}
    muon, adamw = [], []
    for name, p in model.named_parameters():
        (muon if name in names else adamw).append(p)
    return muon, adamw
