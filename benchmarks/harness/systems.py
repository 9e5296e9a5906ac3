"""The systems the benchmark runs, built on one rank, and the parameters each ends with.

Every system gets a fresh GPT (same seed, dtype and mixed-precision policy), sharded per
block then at the root, and its optimizers:

* ``matrixfsdp``: ``matrixfsdp.fully_shard`` + ``matrixfsdp.Muon`` (``muon_param_groups``);
* ``fsdp2_adamw``: FSDP2's ``fully_shard`` + ``torch.optim.AdamW`` on every parameter;
* ``fsdp2_torch_muon``, ``fsdp2_dist_muon``, ``fsdp2_muon_fsdp2``: FSDP2 + the peer Muon
  optimizers of :mod:`.peers`, on the matrices MatrixFSDP's default rule picks
  (:func:`split_muon`), AdamW on the rest;
* ``fsdp2_soap``, ``matrixfsdp_soap`` (optional): SOAP on whole matrices, gathered under
  FSDP2 or on the owners (:mod:`.matrix_systems`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import matrixfsdp as mf
from matrixfsdp.train.models import GPT

from . import peers
from .config import BenchConfig
from .matrix_systems import SOAP_SYSTEMS, build_soap_system
from .peers import split_muon


@dataclass
class System:
    """A built system: the model and the objects whose ``step``/``zero_grad`` we call."""

    model: nn.Module
    group: dist.ProcessGroup  # the system's own process group; its barriers use it too
    optimizers: list[Any]


def build_system(name: str, cfg: BenchConfig, mesh: Any, device: torch.device,
                 group: dist.ProcessGroup) -> System:
    """System ``name`` on this rank, over ``mesh``: 1-D, or 2-D ``(replicate, shard)`` for
    HSDP (FSDP2's HSDP for the FSDP2 systems). ``group`` (the whole mesh) is the system's
    own group for the harness's barriers."""
    from torch.distributed.fsdp import MixedPrecisionPolicy


    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config()).to(device=device, dtype=getattr(torch, cfg.dtype))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.mp == "bf16" else MixedPrecisionPolicy()
    if name in SOAP_SYSTEMS:
        return System(model, group, build_soap_system(name, model, mesh, mp, cfg))
    if name == "matrixfsdp":
        for block in model.layers:
            mf.fully_shard(block, mesh=mesh, mp_policy=mp)
        mf.fully_shard(model, mesh=mesh, mp_policy=mp)
        groups = mf.muon_param_groups(
            model, lr=cfg.lr, adamw_lr=cfg.adamw_lr, weight_decay=cfg.weight_decay,
            momentum=cfg.momentum, adamw_betas=cfg.adamw_betas, adamw_eps=cfg.adamw_eps,
            adamw_weight_decay=cfg.adamw_weight_decay)
        return System(model, group, [mf.Muon(groups)])

    from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if name == "fsdp2_adamw":
        return System(model, group, [torch.optim.AdamW(
            model.parameters(), lr=cfg.adamw_lr, betas=cfg.adamw_betas, eps=cfg.adamw_eps,
            weight_decay=cfg.adamw_weight_decay)])

    muon, adamw = split_muon(model)
    kw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
              adamw_lr=cfg.adamw_lr, adamw_betas=cfg.adamw_betas, adamw_eps=cfg.adamw_eps,
              adamw_weight_decay=cfg.adamw_weight_decay)
    if name == "fsdp2_torch_muon":
        return System(model, group, peers.build_torch_muon(muon, adamw, **kw))
    if name == "fsdp2_dist_muon":
        return System(model, group, [peers.build_dist_muon(model, mesh, list(model.layers), muon,
                                                           adamw, **kw)])
    if name == "fsdp2_muon_fsdp2":
        return System(model, group, [peers.build_muon_fsdp2(muon, adamw, **kw)])
    raise ValueError(f"unknown system {name!r}")


def full_params(name: str, model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """Full parameters as fp32 CPU tensors (a collective; only kept where ``keep``)."""
    if name.startswith("matrixfsdp"):
        full = mf.full_state_dict(model)
        names = [n for n, _ in model.named_parameters()]
        return {n: full[n].detach().float().cpu() for n in names} if keep else {}
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        if keep:
            out[n] = t.detach().float().cpu()
    return out
