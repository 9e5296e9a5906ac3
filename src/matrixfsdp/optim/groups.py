"""``matrixfsdp.Muon``'s parameter groups: their options, defaults and checks.

A Muon group (``use_muon=True``) takes exactly ``torch.optim.Muon``'s options plus
``ns_dtype``; an AdamW group (``use_muon=False``) exactly ``torch.optim.AdamW``'s. Any other
key (a misspelt ``weight_deacy``, a Muon option in an AdamW group) is refused, naming it.
Parameters may be given as tensors or as ``(name, tensor)`` pairs, as torch accepts them.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import nn

from ..runtime.fully_shard import get_root
from ..runtime.param import placement_of, sharded_param, waiting_for

# The one home of the defaults: torch.optim.Muon's (plus ns_dtype) and torch.optim.AdamW's
# (matrixfsdp.Muon's adamw_ keywords). Muon's signature and muon_param_groups read them,
# and the benchmark; tests/test_optim.py checks them against torch's signatures.
MUON_DEFAULTS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                     ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
                     adjust_lr_fn=None, ns_dtype=torch.bfloat16)
ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                      maximize=False, foreach=None, capturable=False, differentiable=False,
                      fused=None)
# Keys a group may hold besides its kind's options (torch adds param_names for named params).
GROUP_KEYS = ("params", "use_muon", "param_names")


def check_options(keys, use_muon: bool, where: str) -> None:
    """Raise ``ValueError`` naming the first key that is not an option of this kind of group."""
    known = (MUON_DEFAULTS if use_muon else ADAMW_DEFAULTS).keys()
    for k in keys:
        if k not in known and k not in GROUP_KEYS:
            close = difflib.get_close_matches(k, list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{where}: unknown {'Muon' if use_muon else 'AdamW'} option {k!r}{hint}; the "
                f"options are {', '.join(sorted(known))}")


def split_named(params: Any) -> tuple[list[torch.Tensor], list[str] | None]:
    """A group's parameters as tensors, and their names if given as ``(name, tensor)``."""
    items = [params] if isinstance(params, torch.Tensor) else list(params)
    if items and all(isinstance(x, tuple) for x in items):
        return [x[1] for x in items], [x[0] for x in items]
    if any(isinstance(x, tuple) for x in items):
        raise ValueError("all optimizer params should be with/without names. Some param names "
                         "are missing")
    return items, None


def check_muon_group(group: dict) -> None:
    """torch.optim.Muon's checks (written so that NaN fails them as it does there), and that
    every parameter is a whole matrix somewhere."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not (0.0 <= lr and 0.0 <= group["momentum"] and 0.0 <= group["weight_decay"]):
        raise ValueError(f"invalid Muon hyperparameters: lr={lr}, "
                         f"momentum={group['momentum']}, weight_decay={group['weight_decay']}")
    if group["adjust_lr_fn"] not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
    if group["ns_steps"] >= 100 or len(group["ns_coefficients"]) != 3:
        raise ValueError("ns_steps must be < 100 and ns_coefficients three floats")
    for p in group["params"]:
        pl = placement_of(p)
        if pl is not None and not pl.spec.muon and pl.spec.numel:  # empty: a no-op anywhere
            raise ValueError(
                f"parameter '{pl.spec.name}' (shape {pl.spec.shape}) is in a use_muon=True "
                "group, but the plan shards it by rows over all ranks, so no rank holds the "
                "whole matrix and Muon cannot run on it exactly. Select it as a Muon matrix "
                "with fully_shard(root, muon_filter=...) or move it to the AdamW group")
        if pl is None and p.dim() not in (2, 3):
            raise ValueError(f"Muon supports 2-D matrices and 3-D (experts, m, n) stacks of "
                             f"expert matrices, got shape {tuple(p.shape)}")


def check_adamw_group(group: dict) -> None:
    """torch.optim.AdamW's checks, and a refusal of the options not honoured here."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if group["foreach"] and not group["capturable"]:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not (0.0 <= lr and 0.0 <= group["eps"] and 0.0 <= group["weight_decay"]
            and all(0.0 <= b < 1.0 for b in group["betas"])):
        raise ValueError(f"invalid AdamW hyperparameters: lr={lr}, eps={group['eps']}, "
                         f"betas={group['betas']}, weight_decay={group['weight_decay']}")
    if group["foreach"] and group["fused"]:
        raise ValueError("AdamW group: `fused` and `foreach` cannot be `True` together")
    for opt in ("capturable", "differentiable"):
        if group[opt]:
            raise NotImplementedError(
                f"matrixfsdp.Muon's AdamW groups do not support {opt}=True (a step inside a "
                "CUDA graph / differentiating through the step); use torch.optim.AdamW on "
                "matrixfsdp.shard_params(model) for that")


def check_planned_together(params: list[torch.Tensor]) -> None:
    """Catch an optimizer built before the root ``fully_shard``: some parameters sharded
    (or waiting to be), others outside every unit."""
    managed = [p for p in params if placement_of(p) is not None or waiting_for(p) is not None]
    plain = [p for p in params if placement_of(p) is None and waiting_for(p) is None]
    if managed and plain:
        unit = waiting_for(managed[0]) or sharded_param(managed[0]).unit
        raise ValueError(
            f"optimizer built before the root fully_shard: a parameter of shape "
            f"{tuple(plain[0].shape)} is outside every fully_shard unit while another "
            f"(in {type(unit.module).__name__}) is sharded. Call "
            "matrixfsdp.fully_shard on every block and then on the root module, then build "
            "the optimizer from matrixfsdp.muon_param_groups(model)")


def muon_param_groups(model: nn.Module, *, lr: float = MUON_DEFAULTS["lr"],
                      adamw_lr: float = ADAMW_DEFAULTS["lr"], **options: Any) -> list[dict]:
    """The two parameter groups of a planned model: Muon matrices (2-D, and 3-D expert
    stacks) and everything else. Frozen parameters (``requires_grad=False``) are in
    neither: they get no optimizer state and no weight decay.

    ``options`` starting with ``adamw_`` (``adamw_betas``, ``adamw_eps``,
    ``adamw_weight_decay``, ``adamw_amsgrad``, ``adamw_maximize``, ``adamw_foreach``,
    ``adamw_fused``) go to the AdamW group without the prefix; the rest (``weight_decay``,
    ``momentum``, ``ns_dtype``, ...) to the Muon group. An unknown option raises a
    ``ValueError`` naming it. Every rank gets the same groups (non-owners hold empty
    placeholders), so ``state_dict`` lines up.
    """
    muon_opts = {k: v for k, v in options.items() if not k.startswith("adamw_")}
    adamw_opts = {k[len("adamw_"):]: v for k, v in options.items() if k.startswith("adamw_")}
    check_options(muon_opts, True, "matrixfsdp.muon_param_groups")
    check_options(adamw_opts, False, "matrixfsdp.muon_param_groups (adamw_ prefix)")
    root = get_root(model)
    muon, other = [], []
    for unit in root.units:
        for p in unit.sharded:
            if p.requires_grad:
                (muon if placement_of(p).spec.muon else other).append(p)
    return [dict(params=muon, use_muon=True, lr=lr, **muon_opts),
            dict(params=other, use_muon=False, lr=adamw_lr, **adamw_opts)]
