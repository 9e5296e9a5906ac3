"""Muon on whole owned matrices and AdamW on even shards, in one ``torch.optim.Optimizer``.

Every Muon matrix lives whole on its owner, whose gradient is already the full average
over ranks, so ``step()`` is local: no collective of any kind. On other ranks the matrix
is an empty placeholder without a gradient, which the step skips; momentum therefore
lives only on the owner. An expert stack ``(experts, m, n)`` is held as a ``(k, m, n)``
tensor of k whole experts per rank; its NS runs batched over those k experts, each
normalised and orthogonalised on its own, exactly as k separate matrices. AdamW is
element-wise, so it runs unchanged on row shards.

``state_dict()`` holds this rank's state only, so it loads back only where every rank
holds the same tensors: the same world size and plan. It records both in each param group
(``mf_world_size``, ``mf_plan``: a digest of the names, shapes and placements of the
group's parameters), and ``load_state_dict`` checks them, and every tensor's shape, before
touching anything: a state saved at another world size or plan is refused on every rank,
including one whose own state happens to fit.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from array import array
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.adam import adam as _adam
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .param import pending_unit, placement_of, root_of, sharded_param
from .runtime import get_root, plan_params

# torch.optim.Muon's defaults, also read by the benchmark so every system runs the same NS.
MUON_DEFAULTS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                     ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
                     adjust_lr_fn=None, ns_dtype=torch.bfloat16)


def zeropower_via_newtonschulz(g: torch.Tensor, coefficients: tuple[float, float, float],
                               steps: int, eps: float,
                               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximately orthogonalise the ``m x n`` matrix ``g`` (``torch.optim.Muon``'s NS),
    or each matrix of a ``(k, m, n)`` stack (batched, each matrix on its own).

    Runs in ``dtype`` on the wide orientation: Frobenius-normalise, then ``steps`` quintic
    iterations ``X <- aX + (bA + cA^2) X`` with ``A = X X^T``. Returns a tensor of ``g``'s
    shape in ``dtype``; ``g`` is not modified.
    """
    return _newton_schulz_(g.to(dtype, copy=True), coefficients, steps, eps)


def _newton_schulz_(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                    eps: float) -> torch.Tensor:
    """NS on ``x``, which the caller hands over (it is normalised in place)."""
    a, b, c = coefficients
    wide = x.size(-2) <= x.size(-1)
    if not wide:
        x = x.mT
    if x.dim() == 2:
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    else:  # (k, m, n) experts: one batched NS, each expert with its own norm
        x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = torch.bmm(x, x.mT)
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x if wide else x.mT


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix lr: "original" ``lr*sqrt(max(1, m/n))``, "match_rms_adamw"
    ``0.2*lr*sqrt(max(m, n))``, with ``(m, n)`` the last two dims (one expert of a
    ``(k, m, n)`` stack). Needs the whole matrix's shape, never a shard's."""
    m, n = shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, m / n))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(m, n))
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}")


# Recorded in each param group of ``state_dict()``, checked and dropped by ``load_state_dict``.
# A loader that reshards (``matrixfsdp.set_state_dict``) drops them from what it hands over.
PLAN_KEYS = ("mf_world_size", "mf_plan")
RESHARD_HINT = ("optimizer state saved at another world size or plan; save with "
                "matrixfsdp.get_state_dict / torch.distributed.checkpoint and load with "
                "matrixfsdp.set_state_dict (which reshards)")
_STATE_KEYS = {True: ("momentum_buffer",), False: ("exp_avg", "exp_avg_sq")}


def _name(p: torch.Tensor) -> str:
    pl = placement_of(p)
    return f"'{pl.spec.name}'" if pl is not None else f"of shape {tuple(p.shape)}"


class Muon(torch.optim.Optimizer):
    """Muon for the ``use_muon=True`` groups, AdamW for the ``use_muon=False`` ones.

    Muon groups take ``torch.optim.Muon``'s options and defaults (lr, weight_decay,
    momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn) plus ``ns_dtype``
    (bf16 like torch; float32 for tight checks). A Muon parameter may be 2-D or a 3-D
    ``(experts, m, n)`` stack, which is stepped as ``experts`` separate matrices.
    AdamW groups take ``torch.optim.AdamW``'s (lr, betas, eps, weight_decay, foreach,
    fused); constructor defaults for them are the ``adamw_`` keywords. With ``foreach``
    and ``fused`` both None (the default) the kernel is the one ``torch.optim.AdamW``
    picks for these tensors' device, so the result equals its default path bit for bit.
    A group's own values win, as in every torch optimizer.
    """

    def __init__(self, params: Iterable[dict], *, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 ns_dtype: torch.dtype = torch.bfloat16, adamw_lr: float = 1e-3,
                 adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float = 1e-2, adamw_foreach: bool | None = None,
                 adamw_fused: bool | None = None):
        self._kind_defaults = {
            True: dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                       ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                       adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype),
            False: dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                        weight_decay=adamw_weight_decay, foreach=adamw_foreach, fused=adamw_fused),
        }
        self._ns_buffers: dict[tuple, torch.Tensor] = {}  # (shape, dtype, device) -> NS input
        groups = list(params)
        if not groups or not all(isinstance(g, dict) for g in groups):
            raise ValueError("matrixfsdp.Muon takes parameter groups (dicts) with a 'use_muon' "
                             "flag; build them with matrixfsdp.muon_param_groups(model)")
        _check_planned_together([p for g in groups for p in _as_list(g["params"])])
        super().__init__(groups, {})
        self.defaults = {**self._kind_defaults[True],
                         **{f"adamw_{k}": v for k, v in self._kind_defaults[False].items()}}

    def _ns_input(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(like.shape), dtype, like.device)
        if key not in self._ns_buffers:
            self._ns_buffers[key] = torch.empty(like.shape, dtype=dtype, device=like.device)
        return self._ns_buffers[key]

    def add_param_group(self, param_group: dict) -> None:
        if "use_muon" not in param_group:
            raise ValueError("every matrixfsdp.Muon parameter group needs 'use_muon': True "
                             "(Muon) or False (AdamW)")
        group = dict(param_group)
        group["params"] = plan_params(_as_list(group["params"]))
        use_muon = bool(group["use_muon"])
        for k, v in self._kind_defaults[use_muon].items():
            group.setdefault(k, v)
        if use_muon:
            _validate_muon_group(group)
        elif not (0.0 <= group["lr"] and 0.0 <= group["eps"] and 0.0 <= group["weight_decay"]
                  and all(0.0 <= b < 1.0 for b in group["betas"])):
            # torch.optim.AdamW's checks, written so that NaN fails them as it does there
            raise ValueError(f"invalid AdamW hyperparameters: lr={group['lr']}, eps={group['eps']}, "
                             f"betas={group['betas']}, weight_decay={group['weight_decay']}")
        elif group["foreach"] and group["fused"]:
            raise ValueError("AdamW group: `fused` and `foreach` cannot be `True` together")
        super().add_param_group(group)

    def state_dict(self) -> dict:
        """torch's state dict of this rank's state (parameters by index), each param group
        also recording the world size and the digest of its parameters' plan (``PLAN_KEYS``)."""
        sd = super().state_dict()
        world = _world_size(p for g in self.param_groups for p in g["params"])
        if world is not None:
            for saved, group in zip(sd["param_groups"], self.param_groups):
                saved.update(mf_world_size=world, mf_plan=_plan_digest(group["params"]))
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, once the state is known to fit this rank: the same
        groups (sizes, ``use_muon``), the same world size and plan where recorded, and every
        tensor of this rank's shape (momentum only where this rank holds the matrix). Else
        a ``ValueError`` naming the parameter, this rank and the shapes, before anything is
        loaded. The check reads the state dict only, so every rank decides alike where the
        world size or plan differs, those whose own tensors happen to fit included."""
        self._check_loadable(state_dict)
        groups = [{k: v for k, v in g.items() if k not in PLAN_KEYS} for g in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "param_groups": groups})

    def _check_loadable(self, state_dict: dict) -> None:
        saved_groups, state = state_dict["param_groups"], state_dict["state"]
        params = [p for g in self.param_groups for p in g["params"]]
        where = f"matrixfsdp.Muon.load_state_dict on rank {_rank_of(params)}"
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{where}: the state has {len(saved_groups)} parameter groups, this "
                             f"optimizer {len(self.param_groups)}. If this is {RESHARD_HINT}")
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"{where}: parameter group {i} has {len(saved['params'])} parameters "
                                 f"in the state, {len(group['params'])} here. If this is {RESHARD_HINT}")
            if bool(saved.get("use_muon", group["use_muon"])) != bool(group["use_muon"]):
                raise ValueError(f"{where}: parameter group {i} has use_muon={saved['use_muon']} in "
                                 f"the state, use_muon={group['use_muon']} here")
        world = _world_size(params)
        plan = None  # (saved world size, saved digest, this world size, this digest)
        for saved, group in zip(saved_groups, self.param_groups):
            if world is not None and "mf_world_size" in saved:
                digest = _plan_digest(group["params"])
                if (saved["mf_world_size"], saved.get("mf_plan")) != (world, digest):
                    plan = (saved["mf_world_size"], saved.get("mf_plan"), world, digest)
                    break
        bad = []  # (parameter, state key, saved shape, what this rank needs)
        for saved, group in zip(saved_groups, self.param_groups):
            muon = bool(group["use_muon"])
            for pid, p in zip(saved["params"], group["params"]):
                for key in _STATE_KEYS[muon]:
                    t = (state.get(pid) or {}).get(key)
                    if not isinstance(t, torch.Tensor):
                        continue
                    if muon and not p.numel():
                        bad.append((p, key, tuple(t.shape), _no_state(p)))
                    elif t.shape != p.shape:
                        bad.append((p, key, tuple(t.shape), str(tuple(p.shape))))
        if not bad and plan is None:
            return
        msg = [where + ":"]
        if bad:
            p, key, got, need = bad[0]
            more = f" ({len(bad) - 1} more tensors do not fit either)" if len(bad) > 1 else ""
            msg.append(f"parameter {_name(p)}: saved {key} has shape {got}, this rank's placement "
                       f"needs {need}{more}.")
        if plan is not None:
            msg.append(f"The state was saved at world size {plan[0]} (plan {plan[1]}), this optimizer "
                       f"runs at world size {plan[2]} (plan {plan[3]}).")
            if not bad:
                msg.append("This rank's own tensors happen to fit, but not the state as a whole: "
                           "momentum would be missing or on other matrices, so every rank refuses.")
            msg.append(f"This is {RESHARD_HINT}.")
        else:
            msg.append(f"This looks like {RESHARD_HINT}.")
        raise ValueError(" ".join(msg))

    @torch.no_grad()
    def init_state(self) -> None:
        """Create, for every trainable parameter this rank holds elements of and that has no
        state yet, the state its first step would create: a zero ``momentum_buffer`` (Muon),
        ``step`` 0 and zero ``exp_avg`` / ``exp_avg_sq`` (AdamW), as in ``_muon_step`` and
        ``_adamw_step``. Parameters are not touched. torch's ``get_state_dict`` gets the same
        from a step with zero gradients and lr 0; ``matrixfsdp.get_state_dict`` calls this so
        that a fresh optimizer has tensors to load a checkpoint into."""
        for group in self.param_groups:
            fused = group.get("fused")
            for p in group["params"]:
                if not p.requires_grad or not p.numel() or self.state.get(p) or not _steps_here(p):
                    continue
                state = self.state[p]
                if group["use_muon"]:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                else:
                    state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                                     else torch.tensor(0.0, dtype=_scalar_dtype()))
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr = float(group["lr"])
        for p in group["params"]:
            if p.grad is None or not p.numel():  # a non-owner's placeholder, or empty
                continue
            grad = p.grad
            if grad.is_sparse or torch.is_complex(p):
                raise RuntimeError(f"Muon does not support sparse or complex parameter {_name(p)}")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - group["momentum"])
            # The Nesterov update is written straight in the NS dtype into a buffer reused
            # across steps: the lerp is computed in full precision and rounded once on
            # store, bit for bit torch's ``grad.lerp(buf, m).bfloat16()``, minus one
            # full-precision pass and a fresh matrix-sized allocation per step.
            x = self._ns_input(grad, group["ns_dtype"])
            if group["nesterov"]:
                torch.lerp(grad, buf, group["momentum"], out=x)
            else:
                x.copy_(buf)
            update = _newton_schulz_(x, group["ns_coefficients"], group["ns_steps"], group["eps"])
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))

    def _adamw_step(self, group: dict) -> None:
        # foreach/fused None: torch's functional ``adam`` makes torch.optim.AdamW's default
        # choice itself (foreach where every tensor is on a foreach device, e.g. CUDA; the
        # per-tensor loop otherwise, e.g. CPU). The two differ in low-precision rounding.
        foreach, fused = group.get("foreach"), group.get("fused")
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None or not p.numel():  # nothing to update, so no state either
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"AdamW does not support sparse gradients ({_name(p)})")
            state = self.state[p]
            if not state:  # as torch.optim.Adam._init_group: fused keeps `step` on the device
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                                 else torch.tensor(0.0, dtype=_scalar_dtype()))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=foreach, capturable=False,
            differentiable=False, fused=fused, grad_scale=None, found_inf=None,
            has_complex=any(torch.is_complex(p) for p in params), decoupled_weight_decay=True,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def _world_size(params: Iterable[torch.Tensor]) -> int | None:
    """The world size the parameters are planned for (None: plain tensors, no plan)."""
    for p in params:
        root = root_of(p)
        if root is not None:  # HSDP: replicas x shard size
            return root.groups.replicas * root.groups.shard_size
    return None


def _rank_of(params: Iterable[torch.Tensor]) -> int:
    for p in params:
        root = root_of(p)
        if root is not None:
            return root.rank
    return dist.get_rank() if dist.is_initialized() else 0


def _plan_digest(params: Iterable[torch.Tensor]) -> str:
    """A short digest of where each parameter lives on every rank (name, shape, Muon or
    not, each rank's rows, and the world rank that steps a matrix, which under HSDP also
    names the replica): equal digests mean every rank holds and steps the same tensors."""
    h = hashlib.sha256()
    for p in params:
        pl = placement_of(p)
        key = (pl.spec.name, pl.spec.shape, pl.spec.muon, pl.owner) if pl is not None \
            else tuple(p.shape)
        h.update(repr(key).encode())
        if pl is not None:
            h.update(array("q", [i for r in pl.row_ranges for i in r]).tobytes())
    return h.hexdigest()[:16]


def _no_state(p: torch.Tensor) -> str:
    pl = placement_of(p)
    if pl is not None and pl.owner is not None:
        return (f"no state (this rank holds the empty placeholder {tuple(p.shape)}; the matrix "
                f"is owned by rank {pl.owner})")
    return f"no state (this rank holds none of it: {tuple(p.shape)})"


def _steps_here(p: torch.Tensor) -> bool:
    """HSDP: False for a matrix this rank holds but another replica steps (no state here)."""
    info = sharded_param(p)
    return info is None or info.steps_here()


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _as_list(params) -> list[torch.Tensor]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _check_planned_together(params: list[torch.Tensor]) -> None:
    """Catch an optimizer built before the root ``fully_shard``: some parameters sharded
    (or waiting to be), others outside every unit."""
    managed = [p for p in params if placement_of(p) is not None
               or pending_unit(p) is not None]
    plain = [p for p in params if placement_of(p) is None
             and pending_unit(p) is None]
    if managed and plain:
        unit = pending_unit(managed[0]) or sharded_param(managed[0]).unit
        where = unit.module
        raise ValueError(
            f"optimizer built before the root fully_shard: a parameter of shape "
            f"{tuple(plain[0].shape)} is outside every fully_shard unit while another "
            f"(in {type(where).__name__}) is sharded. Call "
            "matrixfsdp.fully_shard on every block and then on the root module, then build "
            "the optimizer from matrixfsdp.muon_param_groups(model)")


def _validate_muon_group(group: dict) -> None:
    # torch.optim.Muon's checks, written so that NaN fails them as it does there
    if not (0.0 <= group["lr"] and 0.0 <= group["momentum"] and 0.0 <= group["weight_decay"]):
        raise ValueError(f"invalid Muon hyperparameters: lr={group['lr']}, "
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


def muon_param_groups(model: nn.Module, *, lr: float = 1e-3, adamw_lr: float = 1e-3,
                      **options) -> list[dict]:
    """The two parameter groups of a planned model: Muon matrices (2-D, and 3-D expert
    stacks) and everything else. Frozen parameters (``requires_grad=False``) are in
    neither: they get no optimizer state and no weight decay.

    ``options`` starting with ``adamw_`` (``adamw_betas``, ``adamw_eps``,
    ``adamw_weight_decay``, ``adamw_foreach``, ``adamw_fused``) go to the AdamW group
    without the prefix; the rest (``weight_decay``, ``momentum``, ``ns_dtype``, ...) to the
    Muon group. Every rank gets the same groups (non-owners hold empty placeholders), so
    ``state_dict`` lines up.
    """
    root = get_root(model)
    muon, other = [], []
    for unit in root.units:
        for p in unit.sharded:
            if p.requires_grad:
                (muon if placement_of(p).spec.muon else other).append(p)
    muon_opts = {k: v for k, v in options.items() if not k.startswith("adamw_")}
    adamw_opts = {k[len("adamw_"):]: v for k, v in options.items() if k.startswith("adamw_")}
    return [dict(params=muon, use_muon=True, lr=lr, **muon_opts),
            dict(params=other, use_muon=False, lr=adamw_lr, **adamw_opts)]


# torch optimizers whose update of an element depends on other elements: right on a whole
# matrix (a Muon matrix on its owner), wrong on a row shard (Muon's Newton-Schulz,
# Adafactor's row/column statistics), or on any shard at all (L-BFGS's global dot products).
_ROW_SENSITIVE = tuple(getattr(torch.optim, n) for n in ("Muon", "Adafactor") if hasattr(torch.optim, n))
_GLOBAL = (torch.optim.LBFGS,)


def check_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, before it moves anything, an optimizer step that would compute on one rank's
    piece of a parameter and silently differ from one process: torch.optim.Muon or
    Adafactor on a row shard, L-BFGS on any shard."""
    if not isinstance(optimizer, _ROW_SENSITIVE + _GLOBAL):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            pl = placement_of(p)
            if pl is None or p.grad is None:
                continue
            if isinstance(optimizer, _GLOBAL) or tuple(p.shape) != pl.spec.shape:
                raise RuntimeError(
                    f"matrixfsdp: {type(optimizer).__name__} would step parameter "
                    f"'{pl.spec.name}' from this rank's piece {tuple(p.shape)} of the full "
                    f"{pl.spec.shape}, which differs from one process. Use matrixfsdp.Muon "
                    "(Muon on whole matrices, AdamW on shards) with matrixfsdp.muon_param_groups"
                    "(model), or an element-wise optimizer (AdamW, SGD, ...)")


def install_step_hook(root) -> None:
    """Register, for as long as ``root`` lives, an optimizer step pre-hook (torch's public
    registry, so it sees every optimizer): the step's HSDP bookkeeping
    (:meth:`~matrixfsdp.root.Root.mark_stepped`) and :func:`check_optimizer_step`. The
    handle is kept on the root; :meth:`~matrixfsdp.root.Root.close` removes it."""
    root_ref = weakref.ref(root)

    def hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        r = root_ref()
        if r is None:
            return
        r.before_step()  # unsharded copies kept past backward would go stale
        r.mark_stepped(p for group in optimizer.param_groups for p in group["params"])
        check_optimizer_step(optimizer)
    root.hooks.append(register_optimizer_step_pre_hook(hook))
    weakref.finalize(root, root.hooks[-1].remove)
