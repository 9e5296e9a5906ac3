"""``matrixfsdp.Muon``'s parameter groups: their options, defaults and checks.

A Muon group (``use_muon=True``) takes exactly ``torch.optim.Muon``'s options plus
``ns_dtype``; an AdamW group (``use_muon=False``) exactly ``torch.optim.AdamW``'s. Any other
key (a misspelt ``weight_deacy``, a Muon option in an AdamW group) is refused, naming it.
Parameters may be given as tensors or as ``(name, tensor)`` pairs, as torch accepts them.
"""

from __future__ import annotations

import difflib
import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..runtime.module import get_root
from ..runtime.param import placement_of, root_of, sharded_param, waiting_for

# The one home of the defaults: torch.optim.Muon's (plus ns_dtype) and torch.optim.AdamW's
# (matrixfsdp.Muon's adamw_ keywords). Muon's signature and muon_param_groups read them,
# and the benchmark; tests/optim/test_muon_vs_torch.py checks them against torch's signatures.
MUON_DEFAULTS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                     ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
                     adjust_lr_fn=None, ns_dtype=torch.bfloat16, num_heads=None,
                     batch_ns=False)
# Muon options of this library's own, beyond torch.optim.Muon's: the NS dtype; per-head
# (block) Muon: each matrix's rows split into num_heads equal blocks, each orthogonalised
# as its own matrix (docs/optimizers.md#per-head-muon); batch_ns: the matrices of one shape
# that a rank steps in a group go through one batched NS (docs/optimizers.md#batched-ns).
MUON_EXTENSIONS = ("ns_dtype", "num_heads", "batch_ns")
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
    heads = group["num_heads"]
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise ValueError(f"num_heads={heads!r}: a positive int (row blocks per matrix) or None")
    if not isinstance(group["batch_ns"], bool):
        raise ValueError(f"batch_ns={group['batch_ns']!r}: True or False")
    for p in group["params"]:
        pl = placement_of(p)
        shape = tuple(pl.spec.shape) if pl is not None else tuple(p.shape)
        if heads is not None and len(shape) >= 2 and shape[-2] % heads:
            name = pl.spec.name if pl is not None else f"of shape {shape}"
            raise ValueError(
                f"parameter '{name}' (shape {shape}) is in a Muon group with num_heads={heads}, "
                f"which does not divide its {shape[-2]} rows into equal head blocks; put it in "
                "a group with its own num_heads (matrixfsdp.muon_param_groups(per_head=...))")
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


def warn_adamw_only(groups: list[dict]) -> None:
    """Say it when an ``mf.Muon`` over a sharded model steps no matrix with Muon (it would
    train as AdamW alone, silently): most often a model whose blocks were never given their
    own ``fully_shard`` (the plan's Muon matrices are the 2-D weights inside the units below
    the root), so the plan holds no Muon matrix. Decided from the plan, alike on every rank."""
    placed = [(p, pl) for g in groups for p in g["params"] if (pl := placement_of(p)) is not None]
    in_muon = {id(p) for g in groups if g.get("use_muon") for p in g["params"]}
    if not placed or any(pl.spec.muon for p, pl in placed if id(p) in in_muon):
        return
    root = root_of(placed[0][0])
    model = type(root.module).__name__ if root is not None else "the model"
    matrices = [] if root is None else [
        placement_of(p).spec.name for u in root.units for p in u.sharded if placement_of(p).spec.muon]
    if matrices:
        why = (f"{model}'s {len(matrices)} Muon matrices ({', '.join(matrices[:3])}"
               f"{', ...' if len(matrices) > 3 else ''}) are in none of its use_muon=True groups "
               "(frozen, or put in the AdamW group); build the groups with "
               "matrixfsdp.muon_param_groups(model)")
    else:
        why = (f"the plan of {model} holds no Muon matrix: Muon matrices are the trainable 2-D "
               "weights inside the fully_shard units below the root, so call "
               "matrixfsdp.fully_shard on each block before the root (matrixfsdp.shard_model "
               "does for transformers models), or select them with fully_shard(root, "
               "muon_filter=...)")
    warnings.warn(f"matrixfsdp.Muon: none of its {len(placed)} parameters is stepped by Muon, so "
                  f"it trains as AdamW only: {why}", UserWarning, stacklevel=3)


# Projections split per head, by child name: those of one head_dim-sized block per head
# (q, k, v and fused qkv; transformers', torchtitan's, this library's GPT's) and MLA's
# up-projections, whose head blocks are num_heads equal slices of their rows.
HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "wq", "wk", "wv", "wqkv",
                    "q", "k", "v", "qkv")
MLA_PROJECTIONS = ("q_b_proj", "kv_b_proj", "wq_b", "wkv_b")
_log = logging.getLogger("matrixfsdp")


def _head_dim(attn: nn.Module) -> int | None:
    hd = getattr(attn, "head_dim", None)
    if isinstance(hd, int) and hd > 0:
        return hd
    heads = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None)
    q = getattr(attn, "q", None) or getattr(attn, "q_proj", None) or getattr(attn, "wq", None)
    rows = getattr(q, "out_features", None)
    return rows // heads if isinstance(heads, int) and rows and rows % heads == 0 else None


def head_blocks(model: nn.Module) -> dict[str, int]:
    """``{parameter name: heads}`` for the attention projections of ``model`` found by name
    (``HEAD_PROJECTIONS``: a child ``nn.Linear`` of a module with ``head_dim``, or with
    ``n_heads`` / ``num_heads`` and a q projection, as transformers', torchtitan's and this
    library's attention modules have; its rows / head_dim heads, so GQA's k/v and a fused
    qkv come out right) and MLA's up-projections (``num_heads`` blocks)."""
    out: dict[str, int] = {}
    for mname, attn in model.named_modules():
        hd = _head_dim(attn)
        mla_heads = getattr(attn, "num_heads", None) or getattr(attn, "n_heads", None)
        for cname, child in attn.named_children():
            w = getattr(child, "weight", None)
            if not isinstance(w, torch.Tensor) or not isinstance(child, nn.Linear):
                continue
            rows = child.out_features
            heads = (rows // hd if cname in HEAD_PROJECTIONS and hd and rows % hd == 0 else
                     mla_heads if cname in MLA_PROJECTIONS and isinstance(mla_heads, int)
                     and rows % mla_heads == 0 else None)
            if heads and heads > 1:
                out[f"{mname}.{cname}.weight" if mname else f"{cname}.weight"] = heads
    return out


def muon_param_groups(model: nn.Module, *, lr: float = MUON_DEFAULTS["lr"],
                      adamw_lr: float = ADAMW_DEFAULTS["lr"],
                      per_head: bool | Mapping[str, int] = False, **options: Any) -> list[dict]:
    """The parameter groups of a planned model: Muon matrices (2-D, and 3-D expert stacks)
    and everything else. Frozen parameters (``requires_grad=False``) are in neither: they
    get no optimizer state and no weight decay.

    ``options`` starting with ``adamw_`` (``adamw_betas``, ``adamw_eps``,
    ``adamw_weight_decay``, ``adamw_amsgrad``, ``adamw_maximize``, ``adamw_foreach``,
    ``adamw_fused``) go to the AdamW group without the prefix; the rest (``weight_decay``,
    ``momentum``, ``ns_dtype``, ...) to the Muon groups. An unknown option raises a
    ``ValueError`` naming it. Every rank gets the same groups (non-owners hold empty
    placeholders), so ``state_dict`` lines up.

    ``per_head``: per-head Muon (docs/optimizers.md#per-head-muon) for the attention
    projections :func:`head_blocks` finds (True), or for the parameters named in a mapping
    ``{name: heads}``; one Muon group per head count (``num_heads``), the whole matrices in
    the first. What was split is logged (logger ``matrixfsdp``, INFO); True with nothing
    found raises.
    """
    muon_opts = {k: v for k, v in options.items() if not k.startswith("adamw_")}
    adamw_opts = {k[len("adamw_"):]: v for k, v in options.items() if k.startswith("adamw_")}
    check_options(muon_opts, True, "matrixfsdp.muon_param_groups")
    check_options(adamw_opts, False, "matrixfsdp.muon_param_groups (adamw_ prefix)")
    root = get_root(model)
    blocks = dict(per_head) if isinstance(per_head, Mapping) else head_blocks(model) if per_head else {}
    if per_head is True and not blocks:
        raise ValueError(f"matrixfsdp.muon_param_groups(per_head=True): no attention projection "
                         f"found in {type(model).__name__} (docs/optimizers.md#per-head-muon); "
                         "pass per_head={parameter name: heads}")
    default = muon_opts.get("num_heads")
    muon: dict[int | None, list] = {default: []}
    other = []
    for unit in root.units:
        for p in unit.sharded:
            if p.requires_grad:
                spec = placement_of(p).spec
                if spec.muon:
                    muon.setdefault(blocks.pop(spec.name, default), []).append(p)
                else:
                    other.append(p)
    if isinstance(per_head, Mapping) and blocks:
        raise ValueError(f"matrixfsdp.muon_param_groups: per_head names {sorted(blocks)}, which "
                         "are no Muon matrices of this model")
    split = {h: [placement_of(p).spec.name for p in ps] for h, ps in muon.items() if h}
    if split:
        _log.info("matrixfsdp: per-head Muon: %s", "; ".join(
            f"{len(names)} matrices in {h} heads ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            for h, names in split.items()))
    return [*(dict(params=ps, use_muon=True, lr=lr, **{**muon_opts, "num_heads": h})
              for h, ps in muon.items() if ps or h == default),
            dict(params=other, use_muon=False, lr=adamw_lr, **adamw_opts)]
