"""The "any matrix optimizer" row: SOAP (pytorch-optimizer's) on whole matrices, two ways.

* ``matrixfsdp_soap``: ``matrixfsdp.fully_shard`` + ``matrixfsdp.matrix_optimizer(SOAP)``:
  each owner steps its whole matrices, no communication in the step;
* ``fsdp2_soap``: FSDP2 + SOAP on whole matrices gathered in the step, as
  ``torch.optim.Muon`` on DTensors gathers them (:class:`GatheredStep`): every rank
  all-gathers every matrix and its gradient, steps SOAP on the full copies (the same work on
  every rank) and keeps its own shard.

Both run AdamW on the other parameters. Not in the default system list (``--systems
fsdp2_soap,matrixfsdp_soap``); their exactness reference is each other, not torch's Muon.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import matrixfsdp as mf

from .peers import split_muon

SOAP_SYSTEMS: tuple[str, ...] = ("fsdp2_soap", "matrixfsdp_soap")


def soap(params: Sequence[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """pytorch-optimizer's SOAP (its defaults, preconditioner refreshed every 10 steps)."""
    from pytorch_optimizer import SOAP
    return SOAP(params, lr=lr)


class GatheredStep:
    """A per-matrix optimizer over FSDP2's DTensor matrices, stepped on gathered copies.

    ``step``: for each matrix, ``full_tensor()`` of the parameter and of its gradient (two
    all-gathers), the optimizer's step on the full copies, then this rank's shard copied
    back from the updated copy (no communication: every rank computed the same)."""

    def __init__(self, params: Sequence[torch.Tensor], make: Callable[[list], torch.optim.Optimizer]):
        self.params = list(params)
        self.full = [nn.Parameter(p.full_tensor().detach().clone()) for p in self.params]
        self.optimizer = make(self.full)
        self.state = self.optimizer.state  # what the harness's memory accounting reads

    @torch.no_grad()
    def step(self) -> None:
        from torch.distributed.tensor import distribute_tensor
        for p, f in zip(self.params, self.full):
            f.copy_(p.full_tensor())
            f.grad = None if p.grad is None else p.grad.full_tensor()
        self.optimizer.step()
        for p, f in zip(self.params, self.full):
            p.to_local().copy_(distribute_tensor(f, p.device_mesh, p.placements,
                                                 src_data_rank=None).to_local())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, f in zip(self.params, self.full):
            p.grad = f.grad = None


def build_soap_system(name: str, model: nn.Module, mesh: Any, mp: Any, cfg: Any) -> list[Any]:
    """Shard ``model`` as system ``name`` does and return its optimizers."""
    if name == "matrixfsdp_soap":
        for block in model.layers:
            mf.fully_shard(block, mesh=mesh, mp_policy=mp)
        mf.fully_shard(model, mesh=mesh, mp_policy=mp)
        return [mf.matrix_optimizer(soap, model, lr=cfg.adamw_lr),
                torch.optim.AdamW(mf.shard_params(model), lr=cfg.adamw_lr, betas=cfg.adamw_betas,
                                  eps=cfg.adamw_eps, weight_decay=cfg.adamw_weight_decay)]
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    matrices, rest = split_muon(model)
    return [GatheredStep(matrices, lambda ps: soap(ps, cfg.adamw_lr)),
            torch.optim.AdamW(rest, lr=cfg.adamw_lr, betas=cfg.adamw_betas, eps=cfg.adamw_eps,
                              weight_decay=cfg.adamw_weight_decay)]
