"""Muon on whole owned matrices and AdamW on even shards, in one ``torch.optim.Optimizer``.

Every Muon matrix lives whole on its owner, whose gradient is already the full average
over ranks, so ``step()`` is local: no collective of any kind. On other ranks the matrix
is an empty placeholder (its gradient empty), which the step skips; momentum therefore
lives only on the owner. An expert stack ``(experts, m, n)`` is held as a ``(k, m, n)``
tensor of k whole experts per rank; its NS runs batched over those k experts, each
normalised and orthogonalised on its own, exactly as k separate matrices. AdamW is
element-wise, so it runs unchanged on row shards.

Every option ``torch.optim.Muon`` and ``torch.optim.AdamW`` have behaves as there (a Tensor
lr, named parameters, AdamW's ``amsgrad`` and ``maximize``, a ``step`` loaded as a Python
float) or is refused (``capturable``, ``differentiable``, unknown keys: ``optim_groups``).
A scheduler that cycles momentum (OneCycleLR / CyclicLR ``cycle_momentum``) writes
``momentum`` into every group, as for an optimizer whose defaults have ``momentum``: Muon
groups use it as Muon's momentum, AdamW groups as beta1, which is what two torch optimizers
(Muon and AdamW) would each get from their own scheduler.

The state-dict checks (same world size and plan) are in ``optim_state``; other
optimizers under MatrixFSDP (``matrix_params``, the element-wise guard) in ``matrix_optim``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch.optim.adam import adam as _adam

from ..runtime.module import plan_params
from ..runtime.param import sharded_param
from ..runtime.tp import TPSplit
from .groups import (
    ADAMW_DEFAULTS,
    MUON_DEFAULTS,
    check_adamw_group,
    check_muon_group,
    check_options,
    check_planned_together,
    muon_param_groups,
    split_named,
    warn_adamw_only,
)
from .newton_schulz import newton_schulz_, newton_schulz_split_, zeropower_via_newtonschulz
from .plan_stamp import PLAN_KEYS, check_loadable, plan_digest, world_size
from .plan_stamp import param_name as _name
from .policy import check_same_optimizer
from .watch import watch

__all__ = ["MUON_DEFAULTS", "STATE_KEYS", "Muon", "adjusted_lr",
           "muon_param_groups", "zeropower_via_newtonschulz"]

# Optimizer state per parameter, by kind: what ``_muon_step`` / ``_adamw_step`` keep
# (AdamW with ``amsgrad`` also ``max_exp_avg_sq``).
STATE_KEYS = {True: ("momentum_buffer",), False: ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")}


def _apply(p: torch.Tensor, update: torch.Tensor, lr, group: dict, shape) -> None:
    """torch.optim.Muon's decoupled weight decay, then the orthogonalised update at the
    matrix shape's adjusted lr."""
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape))


# batch_ns: at most this many elements of same-shape matrices go through one batched NS
# (64 MiB of bf16 input; NS's temporaries grow with it)
BATCH_NS_NUMEL = 1 << 25


def adjusted_lr(lr: float | torch.Tensor, adjust_lr_fn: str | None,
                shape: torch.Size) -> float | torch.Tensor:
    """Muon's per-matrix lr: "original" ``lr*sqrt(max(1, m/n))``, "match_rms_adamw"
    ``0.2*lr*sqrt(max(m, n))``, with ``(m, n)`` the last two dims (one expert of a
    ``(k, m, n)`` stack). Needs the whole matrix's shape, never a shard's."""
    m, n = shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, m / n))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(m, n))
    else:
        raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}")
    return lr * ratio  # as torch rounds it: the ratio first (a 0-d Tensor lr stays one)


class Muon(torch.optim.Optimizer):
    """Muon for the ``use_muon=True`` groups, AdamW for the ``use_muon=False`` ones.

    Muon groups take ``torch.optim.Muon``'s options and defaults (lr, weight_decay,
    momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn) plus ``ns_dtype``
    (bf16 like torch; float32 for tight checks) and ``num_heads`` (per-head Muon: the rows
    of each matrix split into ``num_heads`` equal blocks, each stepped exactly as
    ``torch.optim.Muon`` steps a parameter of the block's shape: its own NS and lr
    adjustment). A Muon parameter may be 2-D or a 3-D ``(experts, m, n)`` stack, which is
    stepped as ``experts`` separate matrices.
    AdamW groups take ``torch.optim.AdamW``'s (lr, betas, eps, weight_decay, amsgrad,
    maximize, foreach, fused; ``capturable`` and ``differentiable`` only False);
    constructor defaults for them are the ``adamw_`` keywords. With ``foreach`` and
    ``fused`` both None (the default) the kernel is the one ``torch.optim.AdamW`` picks for
    these tensors' device, so the result equals its default path bit for bit. A group's own
    values win, as in every torch optimizer; a key that is no option of its kind is refused.
    """

    # Every default is read from MUON_DEFAULTS / ADAMW_DEFAULTS (optim/groups.py), their one
    # home; tests/optim/test_muon_vs_torch.py checks those against torch.optim.Muon's and AdamW's own.
    def __init__(self, params: Iterable[dict], *,
                 lr: float | torch.Tensor = MUON_DEFAULTS["lr"],
                 weight_decay: float = MUON_DEFAULTS["weight_decay"],
                 momentum: float = MUON_DEFAULTS["momentum"],
                 nesterov: bool = MUON_DEFAULTS["nesterov"],
                 ns_coefficients: tuple[float, float, float] = MUON_DEFAULTS["ns_coefficients"],
                 eps: float = MUON_DEFAULTS["eps"],
                 ns_steps: int = MUON_DEFAULTS["ns_steps"],
                 adjust_lr_fn: str | None = MUON_DEFAULTS["adjust_lr_fn"],
                 ns_dtype: torch.dtype = MUON_DEFAULTS["ns_dtype"],
                 num_heads: int | None = MUON_DEFAULTS["num_heads"],
                 batch_ns: bool = MUON_DEFAULTS["batch_ns"],
                 adamw_lr: float | torch.Tensor = ADAMW_DEFAULTS["lr"],
                 adamw_betas: tuple[float, float] = ADAMW_DEFAULTS["betas"],
                 adamw_eps: float = ADAMW_DEFAULTS["eps"],
                 adamw_weight_decay: float = ADAMW_DEFAULTS["weight_decay"],
                 adamw_amsgrad: bool = ADAMW_DEFAULTS["amsgrad"],
                 adamw_maximize: bool = ADAMW_DEFAULTS["maximize"],
                 adamw_foreach: bool | None = ADAMW_DEFAULTS["foreach"],
                 adamw_capturable: bool = ADAMW_DEFAULTS["capturable"],
                 adamw_differentiable: bool = ADAMW_DEFAULTS["differentiable"],
                 adamw_fused: bool | None = ADAMW_DEFAULTS["fused"]):
        self._kind_defaults = {
            True: dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                       ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                       adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype, num_heads=num_heads,
                       batch_ns=batch_ns),
            False: dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                        weight_decay=adamw_weight_decay, amsgrad=adamw_amsgrad,
                        maximize=adamw_maximize, foreach=adamw_foreach,
                        capturable=adamw_capturable, differentiable=adamw_differentiable,
                        fused=adamw_fused),
        }
        assert self._kind_defaults[True].keys() == MUON_DEFAULTS.keys()
        assert self._kind_defaults[False].keys() == ADAMW_DEFAULTS.keys()
        self._ns_buffers: dict[tuple, torch.Tensor] = {}  # (shape, dtype, device) -> NS input
        groups = list(params)
        if not groups or not all(isinstance(g, dict) for g in groups):
            raise ValueError("matrixfsdp.Muon takes parameter groups (dicts) with a 'use_muon' "
                             "flag; build them with matrixfsdp.muon_param_groups(model)")
        check_planned_together([p for g in groups for p in split_named(g["params"])[0]])
        super().__init__(groups, {})
        self.defaults = {**self._kind_defaults[True],
                         **{f"adamw_{k}": v for k, v in self._kind_defaults[False].items()}}
        check_same_optimizer(self)  # every rank's groups alike, before any step
        warn_adamw_only(self.param_groups)  # a model with no Muon matrix says so
        self.register_load_state_dict_pre_hook(_checked_for_load)
        # its step pre-hook and torch's state-dict behaviour on a sharded model; a subclass
        # may step otherwise, so it goes through the element-wise check (register_elementwise)
        watch(self, checks_itself=type(self) is Muon, initial_state=_init_state)

    def _ns_input(self, like: torch.Tensor, dtype: torch.dtype,
                  device: torch.device | None = None) -> torch.Tensor:
        """A buffer of ``like``'s shape in ``dtype`` (on ``device``, default ``like``'s),
        kept across steps: the NS input."""
        device = like.device if device is None else device
        key = (tuple(like.shape), dtype, device)
        if key not in self._ns_buffers:
            self._ns_buffers[key] = torch.empty(like.shape, dtype=dtype, device=device)
        return self._ns_buffers[key]

    def add_param_group(self, param_group: dict) -> None:
        if "use_muon" not in param_group:
            raise ValueError("every matrixfsdp.Muon parameter group needs 'use_muon': True "
                             "(Muon) or False (AdamW)")
        use_muon = bool(param_group["use_muon"])
        check_options(param_group, use_muon, f"matrixfsdp.Muon parameter group {len(self.param_groups)}")
        group = dict(param_group)
        tensors, names = split_named(group["params"])
        tensors = plan_params(tensors)
        group["params"] = tensors if names is None else list(zip(names, tensors))
        for k, v in self._kind_defaults[use_muon].items():
            group.setdefault(k, v)
        (check_muon_group if use_muon else check_adamw_group)({**group, "params": tensors})
        super().add_param_group(group)

    def state_dict(self) -> dict:
        """torch's state dict of this rank's state (parameters by index), each param group
        also recording the world size and the digest of its parameters' plan (``PLAN_KEYS``).
        ``ns_dtype`` is saved by name ("float32"; torch's state-dict helpers take no dtype
        objects), and read back by either."""
        sd = super().state_dict()
        world = world_size(p for g in self.param_groups for p in g["params"])
        for saved, group in zip(sd["param_groups"], self.param_groups):
            if isinstance(saved.get("ns_dtype"), torch.dtype):
                saved["ns_dtype"] = str(saved["ns_dtype"]).removeprefix("torch.")
            if world is not None:
                saved.update(mf_world_size=world, mf_plan=plan_digest(group["params"]))
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, once the state is known to fit this rank: the same
        groups (sizes, ``use_muon``), the same world size and plan where recorded, and every
        tensor of this rank's shape (momentum only where this rank holds the matrix). Else
        a ``ValueError`` naming the parameter, this rank and the shapes, before anything is
        loaded. The check reads the state dict only, so every rank decides alike where the
        world size or plan differs, those whose own tensors happen to fit included. It runs
        as a load pre-hook, after the one that turns ``RowShard`` s into this rank's pieces
        (``state_dict()`` holds them on a sharded model)."""
        super().load_state_dict(state_dict)

    def __setstate__(self, state: dict) -> None:
        """As ``torch.optim.AdamW``: an AdamW ``step`` loaded as a Python number becomes the
        0-d tensor the step expects."""
        super().__setstate__(state)
        for group in self.param_groups:
            if group.get("use_muon", True):
                continue
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not torch.is_tensor(st["step"]):
                    st["step"] = _step_tensor(float(st["step"]), p, group)

    @torch.no_grad()
    def init_state(self) -> None:
        """Create, for every trainable parameter this rank holds elements of and that has no
        state yet, the state its first step would create (``_init_state``). Parameters are
        not touched. torch's ``get_state_dict`` gets the same from a step with zero
        gradients and lr 0; ``matrixfsdp.get_state_dict`` calls this so that a fresh
        optimizer has tensors to load a checkpoint into."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.numel() and not self.state.get(p) and _steps_here(p):
                    _init_state(self.state[p], p, group)

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
        lr = _scalar(group["lr"])
        batches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        sliced: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p in stepped(group):
            grad = p.grad
            if grad.is_sparse or torch.is_complex(p):
                raise RuntimeError(f"Muon does not support sparse or complex parameter {_name(p)}")
            state = self.state[p]
            if "momentum_buffer" not in state:
                _init_state(state, p, group)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - group["momentum"])
            split = _tp_split(p)
            if split is not None:  # a slice of a matrix its tp group owns: NS over the group
                sliced.setdefault((tuple(p.shape), split), []).append((p, grad))
                continue
            if group["batch_ns"] and p.dim() == 2 and not group["num_heads"]:
                batches.setdefault((tuple(p.shape), p.device), []).append((p, grad))
                continue
            # The Nesterov update is written straight in the NS dtype into a buffer reused
            # across steps: the lerp is computed in full precision and rounded once on
            # store, bit for bit torch's ``grad.lerp(buf, m).bfloat16()``, minus one
            # full-precision pass and a fresh matrix-sized allocation per step.
            x = self._ns_input(grad, group["ns_dtype"])
            self._nesterov(x, grad, buf, group)
            if group["num_heads"]:  # per-head: each row block its own matrix, one batched NS
                x = x.view(-1, x.shape[-2] // group["num_heads"], x.shape[-1])
            update = newton_schulz_(x, group["ns_coefficients"], group["ns_steps"], group["eps"])
            _apply(p, update.reshape(p.shape), lr, group, x.shape)
        for (shape, _), items in batches.items():
            for chunk, xs in self._batched_inputs(items, shape, group):
                update = newton_schulz_(xs, group["ns_coefficients"], group["ns_steps"],
                                         group["eps"])
                for u, (p, _) in zip(update, chunk):
                    _apply(p, u, lr, group, shape)
        for (shape, split), items in sliced.items():
            self._split_step(items, shape, split, group, lr)

    def _split_step(self, items: list[tuple[torch.Tensor, torch.Tensor]], shape: tuple[int, ...],
                    split: TPSplit, group: dict, lr) -> None:
        """The Muon update of slices of matrices their tp group owns (every tp rank of the
        group steps its slices of the same matrices, in the same order): the NS runs over
        the group, batched over same-shaped matrices (:func:`newton_schulz_split_`); the lr
        adjustment is the whole matrix's. Per-head Muon: each head's rows are a matrix of
        their own, whole in a row slice (their NS is this rank's alone) or sliced by
        columns like the matrix (their NS over the group)."""
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        heads = group["num_heads"]
        if heads:
            rows = split.shape[0] // heads
            if split.dim == 0 and shape[0] % rows:
                raise NotImplementedError(
                    f"matrixfsdp.Muon: per-head Muon of '{_name(items[0][0])}' {split.shape} "
                    f"({heads} heads of {rows} rows) whose tp slices of {shape[0]} rows split a "
                    "head; use tp_ownership=\"rank\" for it, or a tp size that divides the heads")
        for chunk, xs in self._batched_inputs(items, shape, group):
            if not heads:
                update = newton_schulz_split_(xs, *ns, split.shape, split.dim, split.all_reduce)
                for u, (p, _) in zip(update, chunk):
                    _apply(p, u, lr, group, split.shape)
                continue
            for x, (p, _) in zip(xs, chunk):  # per-head: a batch of heads each
                h = x.view(-1, rows, x.shape[-1])
                if split.dim == 0:  # whole heads in this row slice
                    u = newton_schulz_(h, *ns)
                else:
                    u = newton_schulz_split_(h, *ns, (rows, split.shape[1]), 1, split.all_reduce)
                _apply(p, u.reshape(p.shape), lr, group, (rows, split.shape[1]))

    def _batched_inputs(self, items: list[tuple[torch.Tensor, torch.Tensor]], shape: tuple[int, ...],
                        group: dict) -> Iterator[tuple[list, torch.Tensor]]:
        """Same-shaped ``(param, grad)`` pairs in chunks of at most ``BATCH_NS_NUMEL``
        elements, each with its batched NS input (the Nesterov lerp of every pair, in the
        group's NS dtype)."""
        per = max(1, BATCH_NS_NUMEL // math.prod(shape))
        for at in range(0, len(items), per):
            chunk = items[at:at + per]
            xs = self._ns_input(torch.empty((len(chunk), *shape), device="meta"),
                                group["ns_dtype"], chunk[0][1].device)
            for x, (p, grad) in zip(xs, chunk):
                self._nesterov(x, grad, self.state[p]["momentum_buffer"], group)
            yield chunk, xs

    @staticmethod
    def _nesterov(x: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, group: dict) -> None:
        """The NS input into ``x`` (its dtype): torch.optim.Muon's Nesterov lerp, or the
        momentum buffer."""
        if group["nesterov"]:
            torch.lerp(grad, buf, group["momentum"], out=x)
        else:
            x.copy_(buf)

    def _adamw_step(self, group: dict) -> None:
        # foreach/fused None: torch's functional ``adam`` makes torch.optim.AdamW's default
        # choice itself (foreach where every tensor is on a foreach device, e.g. CUDA; the
        # per-tensor loop otherwise, e.g. CPU). The two differ in low-precision rounding.
        if "momentum" in group:  # a momentum-cycling scheduler's beta1 (module docstring)
            group["betas"] = (group["momentum"], *group["betas"][1:])
        amsgrad = group["amsgrad"]
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
        for p in stepped(group):  # the others: nothing to update here, so no state either
            if p.grad.is_sparse:
                raise RuntimeError(f"AdamW does not support sparse gradients ({_name(p)})")
            state = self.state[p]
            if not state or (amsgrad and "max_exp_avg_sq" not in state):
                _init_state(state, p, group)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if amsgrad:
                max_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _adam(
            params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, foreach=group["foreach"],
            capturable=False, differentiable=False, fused=group["fused"], grad_scale=None,
            found_inf=None, has_complex=any(torch.is_complex(p) for p in params),
            decoupled_weight_decay=True, amsgrad=amsgrad, beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group["maximize"])




def _checked_for_load(opt: Muon, state_dict: dict) -> dict:
    """``Muon.load_state_dict``'s check (``check_loadable``), then the state without the
    plan stamps (a load pre-hook)."""
    check_loadable(opt, state_dict, STATE_KEYS)
    groups = [{k: _dtype(v) if k == "ns_dtype" else v for k, v in g.items() if k not in PLAN_KEYS}
              for g in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


def _dtype(v: object) -> object:
    """A saved ``ns_dtype``: a dtype, or its name as ``state_dict`` writes it."""
    dtype = getattr(torch, v, None) if isinstance(v, str) else v
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"matrixfsdp.Muon.load_state_dict: ns_dtype {v!r} is no torch dtype")
    return dtype


def _step_tensor(value: float, p: torch.Tensor, group: dict) -> torch.Tensor:
    """AdamW's ``step`` as torch.optim.Adam keeps it (fused: float32 on the device)."""
    if group.get("fused"):
        return torch.tensor(value, dtype=torch.float32, device=p.device)
    return torch.tensor(value, dtype=_scalar_dtype())


def _init_state(state: dict, p: torch.Tensor, group: dict) -> None:
    """The state a parameter's first step creates (as torch.optim.Muon / Adam._init_group):
    a zero ``momentum_buffer`` (Muon); ``step`` 0, zero ``exp_avg`` / ``exp_avg_sq`` and,
    with ``amsgrad``, ``max_exp_avg_sq`` (AdamW). Keys already there are kept."""
    def zeros() -> torch.Tensor:
        return torch.zeros_like(p, memory_format=torch.preserve_format)
    if group["use_muon"]:
        state.setdefault("momentum_buffer", zeros())
        return
    if "step" not in state:
        state["step"] = _step_tensor(0.0, p, group)
        state["exp_avg"], state["exp_avg_sq"] = zeros(), zeros()
    if group.get("amsgrad"):
        state.setdefault("max_exp_avg_sq", zeros())


def stepped(group: dict) -> Iterator[torch.Tensor]:
    """The parameters of ``group`` a step updates on this rank: those with elements here and
    a gradient, but for a matrix another HSDP replica steps (its copy here holds zeros); a
    non-owner's placeholder holds an empty gradient."""
    return (p for p in group["params"] if p.grad is not None and p.numel() and _steps_here(p))


def _tp_split(p: torch.Tensor) -> TPSplit | None:
    info = sharded_param(p)
    return None if info is None else info.tp_split


def _steps_here(p: torch.Tensor) -> bool:
    """HSDP: False for a matrix this rank holds but another replica steps (no state here)."""
    info = sharded_param(p)
    return info is None or info.steps_here()


def _scalar(x: float | torch.Tensor) -> float | torch.Tensor:
    """A hyperparameter as torch's optimizers read it: a 1-element tensor as a 0-d tensor
    (a Tensor lr stays a tensor), a number as it is."""
    return x.squeeze() if isinstance(x, torch.Tensor) and x.dim() != 0 else x


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
