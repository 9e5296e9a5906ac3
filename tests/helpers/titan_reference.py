"""torchtitan on FSDP2 with torch's Muon: the reference the torchtitan trainer tests compare
the one line against (tests only).

* :func:`torch_muon_container`: torchtitan's ``OptimizersContainer`` with ``Muon`` naming
  ``torch.optim.Muon`` (torchtitan 0.3.0 has no factory for the name) on whole matrices,
  each 3-D expert stack stepped as one 2-D ``torch.optim.Muon`` matrix per expert
  (:class:`StackedMuon`: torch's Muon refuses 3-D parameters);
* :func:`fsdp2_parallelize`: a model family's own torchtitan ``parallelize_fn`` (FSDP2),
  summing its reduce-scatters on gloo (its divide factor needs ``PREMUL_SUM``, which gloo
  lacks: the CPU shim's part, as for llama3);
* :func:`arg_mbs_adapter`: torchtitan 0.3.0's trainer calls ``schedule.step(arg_mbs=...,
  kwarg_mbs=..., target_mbs=...)``, which torch 2.13's pipeline schedules lack: the one
  call, adapted onto torch's own ``_step_microbatches`` (test-only, both sides alike).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn


# ---- torch.optim.Muon, expert stacks included ---------------------------------------------------
def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _write_back(p: torch.Tensor, full: torch.Tensor) -> None:
    """``full`` (the whole stack, alike on every rank) into parameter ``p``'s own piece."""
    from torch.distributed.tensor import DTensor, Replicate
    if not isinstance(p, DTensor):
        p.detach().copy_(full)
        return
    mesh = p.device_mesh
    whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    p.to_local().detach().copy_(whole.redistribute(mesh, p.placements).to_local())


class StackedMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` over torchtitan's param groups, on whole matrices: each step
    gathers every parameter whole (FSDP2's DTensors; the same on every rank), gives each
    matrix's copy its gradient (a 3-D expert stack: ``E`` 2-D matrices, one per expert),
    lets torch's Muon step the copies (their momentum is the parameter's), and writes this
    rank's piece of the result back. torch's Muon run directly on FSDP2's DTensors computes
    the same (its Newton-Schulz on sharded DTensors), one collective per matmul: about 7x
    slower here."""

    def __init__(self, params: Any, **defaults: Any):
        super().__init__(params, defaults)
        self._inner: torch.optim.Muon | None = None
        self._copies: dict[nn.Parameter, list[nn.Parameter]] = {}

    def _build(self) -> None:
        groups = []
        for g in self.param_groups:
            ps = []
            for p in g["params"]:
                full = _full(p.detach())
                whole = list(full) if p.ndim == 3 else [full]
                self._copies[p] = [nn.Parameter(m.clone()) for m in whole]
                ps += self._copies[p]
            groups.append(dict(params=ps, **{k: v for k, v in g.items()
                                             if k not in ("params", "param_names")}))
        self._inner = torch.optim.Muon(groups)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if self._inner is None:
            self._build()
        for g, inner in zip(self.param_groups, self._inner.param_groups):
            inner.update({k: v for k, v in g.items() if k not in ("params", "param_names")})
        stepped = []
        for p, copies in self._copies.items():
            if p.grad is None:
                continue
            full, grad = _full(p.detach()), _full(p.grad)
            if p.ndim == 2:
                full, grad = full[None], grad[None]
            for e, c in enumerate(copies):
                c.copy_(full[e])
                c.grad = grad[e].clone()
            stepped.append(p)
        self._inner.step()
        for p in stepped:
            new = torch.stack([c.detach() for c in self._copies[p]])
            _write_back(p, new if p.ndim == 3 else new[0])
            for c in self._copies[p]:
                c.grad = None


def _fields(opt: Any) -> dict:
    from torchtitan.components.optimizer import OptimizersContainer
    return {f.name: getattr(opt, f.name) for f in dataclasses.fields(OptimizersContainer.Config)}


@functools.cache
def _container_class() -> type:
    from torchtitan.components.optimizer import OptimizersContainer

    class TorchMuonContainer(OptimizersContainer):
        """torchtitan's container, with ``Muon`` naming ``torch.optim.Muon`` (expert stacks:
        :class:`StackedMuon`)."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):
            pass

        @staticmethod
        def _resolve_optimizer_factory(name: str):
            if name == "Muon":
                return StackedMuon
            return OptimizersContainer._resolve_optimizer_factory(name)

        @staticmethod
        def _build_param_groups(model, param_group_configs, impl_kwargs):
            """torchtitan's, for the groups that get a parameter of this part (a pipeline
            part may hold no Muon matrix: torchtitan would refuse its pattern)."""
            from matrixfsdp.integrations.torchtitan_optim import _groups_matching
            return OptimizersContainer._build_param_groups(
                model, _groups_matching(model, param_group_configs), impl_kwargs)

    return TorchMuonContainer


def torch_muon_container(optimizer: Any) -> Any:
    """``optimizer`` (torchtitan's ``OptimizersContainer.Config``, with ``Muon`` groups) as
    the reference container's config."""
    return _container_class().Config(**_fields(optimizer))


# ---- FSDP2 as torchtitan applies it ------------------------------------------------------------
def fsdp2_parallelize(model: nn.Module, *, parallelize_fn: Any, **kwargs: Any) -> nn.Module:
    """torchtitan's own ``parallelize_fn`` of the model's family; gloo has no PREMUL_SUM for
    FSDP2's divide factor, so the reduce sums and divides apart (the CPU shim's part)."""
    from torch.distributed.fsdp import FSDPModule
    model = parallelize_fn(model, **kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model


def on_fsdp2(config: Any) -> Any:
    """A torchtitan config (its own parallelize function, Muon groups) as the reference:
    FSDP2 summing on gloo, torch's Muon, the ``partial_dtensor`` backend the one line uses,
    its pipelining function's schedule through :func:`arg_mbs_adapter`."""
    spec = config.model_spec
    spec.parallelize_fn = functools.partial(fsdp2_parallelize, parallelize_fn=spec.parallelize_fn)
    if spec.pipelining_fn is not None:
        spec.pipelining_fn = arg_mbs_adapter(spec.pipelining_fn)
    config.optimizer = torch_muon_container(config.optimizer)
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


# ---- torchtitan 0.3.0's schedule.step(arg_mbs=...) on torch 2.13 --------------------------------
class ArgMbsSchedule:
    """A torch pipeline schedule taking the call torchtitan 0.3.0's trainer makes,
    ``step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=, return_outputs=)``
    (micro-batches already split), which torch 2.13's ``step`` lacks: what its ``step``
    does per iteration (the stages' backward flag and runtime states), then its own
    ``_step_microbatches`` with the given micro-batches. Anything else is the schedule's."""

    def __init__(self, schedule: Any):
        self._schedule = schedule

    def __getattr__(self, name: str) -> Any:
        return getattr(self._schedule, name)

    def step(self, *, arg_mbs: Any = None, kwarg_mbs: Any = None, target_mbs: Any = None,
             losses: Any = None, loss_kwargs: Any = None, return_outputs: bool = True) -> None:
        s = self._schedule
        stages = getattr(s, "_stages", None) or [s._stage]
        for stage in stages:
            stage.has_backward = s._has_backward
            stage.clear_runtime_states()
        s._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                             loss_kwargs=loss_kwargs)


def arg_mbs_adapter(pipelining_fn: Any) -> Any:
    """``pipelining_fn`` (torchtitan's, or the one line's) whose schedule takes torchtitan
    0.3.0's ``step(arg_mbs=...)`` call (:class:`ArgMbsSchedule`)."""
    @functools.wraps(pipelining_fn)
    def adapted(*args: Any, **kwargs: Any) -> Any:
        schedule, parts, first, last = pipelining_fn(*args, **kwargs)
        return ArgMbsSchedule(schedule), parts, first, last
    return adapted
