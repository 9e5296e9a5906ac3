"""torchtitan's own Trainer on MatrixFSDP, switched with one line, torchtitan unpatched.

Two forms::

    # torchtitan's config registry: the same names as torchtitan's own config functions
    torchrun ... -m torchtitan.train --module matrixfsdp.integrations.torchtitan --config llama3_8b

    # a config function of your own (torchtitan's ``Trainer.Config``)
    from .torchtitan import convert
    def my_config():
        return convert(my_torchtitan_config())

:func:`convert` returns the same config on MatrixFSDP: the model spec's parallelize function
is :func:`parallelize` (torchtitan's AC and compile, in torchtitan's order, then
``mf.fully_shard`` in place of torch's), and the optimizer is
:class:`MatrixOptimizersContainer`, which builds one ``mf.Muon`` from torchtitan's own param
groups: ``Muon`` / ``DistMuon`` groups become Muon groups with the same hyper-parameters
(DistMuon's ``BlockShard`` row blocks become per-head Muon, ``num_heads``), ``AdamW`` stays
AdamW. Which matrices are stepped whole on one owner (the plan's Muon matrices) is read off
the same param groups, first match wins, as torchtitan assigns them.

The config functions here (``llama3_debugmodel``, ``llama3_8b``, ...) are torchtitan's own,
converted, with Moonlight's Muon recipe (arXiv:2502.16982) over the matrices of the blocks:
``adjust_lr_fn="match_rms_adamw"``, so Muon takes the config's AdamW lr, weight decay and
schedule; embeddings, norms and the output head stay on AdamW.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..fully_shard import fully_shard
from ..optim.groups import ADAMW_DEFAULTS, MUON_DEFAULTS
from ..optim.muon import Muon
from ..optim.plan_stamp import PLAN_KEYS
from ..optim.state_dict_hooks import check_decoupled
from ..optim.watch import watch
from ..runtime.module import FSDPModule
from ..runtime.param import placement_of
from ..state.init import init_weights

try:  # torchtitan is optional: this module is only for its users
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, load_flat_optim_state_dict
    from torchtitan.distributed.flex_shard import BlockShard
except ImportError as e:  # pragma: no cover (torchtitan is a test dependency)
    raise ImportError("matrixfsdp.integrations.torchtitan needs torchtitan (tested with 0.3.0)") from e

__all__ = ["MatrixOptimizersContainer", "convert", "parallelize", "muon_optimizer"]

MUON_NAMES = ("Muon", "DistMuon")  # torchtitan's optimizer names that become Muon groups
# The matrices of a decoder's blocks (torchtitan's attention and feed-forward projections,
# fused or not, and MoE experts), as its param-group patterns match names (re.search).
BLOCK_MATRICES = r"(?:attention|feed_forward|moe)\.(?:.*\.)?w[\w]*(?:\.weight)?$"


# ---- the optimizer ------------------------------------------------------------------------
def _heads(fqn: str, layout: Any, shape: torch.Size) -> int | None:
    """DistMuon's compute layout of one matrix as ``mf.Muon``'s ``num_heads``: a
    ``BlockShard(dim=0, block_size=r)`` on any mesh axis steps each ``r`` rows as a matrix of
    its own, which is per-head Muon with ``rows / r`` heads; ``Owned``, ``Replicate`` and
    ``Shard(0)`` of an expert stack step whole matrices."""
    shardings = getattr(layout, "shardings_by_mesh_axis", {}) or {}
    blocks = {s.block_size for s in shardings.values() if isinstance(s, BlockShard) and s.dim == 0}
    bad = [s for s in shardings.values() if isinstance(s, BlockShard) and s.dim != 0]
    if bad or len(blocks) > 1:
        raise NotImplementedError(f"matrixfsdp: DistMuon compute layout of '{fqn}' ({layout}) "
                                  "splits it other than into row blocks of one size")
    if not blocks:
        return None
    r = blocks.pop()
    if shape[-2] % r:
        raise ValueError(f"matrixfsdp: DistMuon BlockShard(block_size={r}) of '{fqn}' does not "
                         f"divide its {shape[-2]} rows")
    return shape[-2] // r if shape[-2] // r > 1 else None


def _muon_group(group: dict, layouts: dict, name: str) -> list[dict]:
    """torchtitan's group (``params``, ``param_names``, its kwargs) as ``mf.Muon`` groups:
    one per head count, Muon's options only."""
    extra = sorted(k for k in group if k not in MUON_DEFAULTS and k not in
                   ("params", "param_names", "fused", "foreach"))
    if extra:
        raise ValueError(f"matrixfsdp: {name} group of '{group['param_names'][0]}' has option(s) "
                         f"{extra}, which Muon does not take")
    opts = {k: v for k, v in group.items() if k in MUON_DEFAULTS}
    if isinstance(opts.get("ns_dtype"), str):
        opts["ns_dtype"] = getattr(torch, opts["ns_dtype"])
    by_heads: dict[int | None, tuple[list, list]] = {}
    for p, fqn in zip(group["params"], group["param_names"]):
        shape = placement_of(p).spec.shape if placement_of(p) is not None else p.shape  # the whole
        heads = _heads(fqn, layouts[fqn], shape) if fqn in layouts else opts.get("num_heads")
        ps, ns = by_heads.setdefault(heads, ([], []))
        ps.append(p)
        ns.append(fqn)
    return [dict(params=ps, param_names=ns, use_muon=True, **{**opts, "num_heads": h})
            for h, (ps, ns) in by_heads.items()]


def _adamw_group(group: dict, name: str) -> dict:
    if name == "Adam" and group.get("weight_decay", 0):
        raise NotImplementedError(
            f"matrixfsdp: an Adam group with weight_decay={group['weight_decay']} (L2 in the "
            f"gradient) for '{group['param_names'][0]}': matrixfsdp.Muon steps AdamW (decoupled "
            "decay); use optimizer_name='AdamW', or Adam with weight_decay=0 (the same update)")
    extra = sorted(k for k in group if k not in ADAMW_DEFAULTS and k not in ("params", "param_names"))
    if extra:
        raise ValueError(f"matrixfsdp: {name} group of '{group['param_names'][0]}' has option(s) "
                         f"{extra}, which AdamW does not take")
    return dict(group, use_muon=False)


# torch's own group keys, which a checkpoint of torch.optim.Muon / AdamW (FSDP2) holds:
# torchtitan's flat optimizer state keeps these only, so that it loads either way
_TORCH_KEYS = {True: set(MUON_DEFAULTS) - {"ns_dtype", "num_heads", "batch_ns"},
               False: set(ADAMW_DEFAULTS) | {"decoupled_weight_decay"}}
_SCHEDULER_KEYS = {"initial_lr"}


class MatrixOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer``, building ``matrixfsdp.Muon`` from its param
    groups (one per model part): ``Muon`` / ``DistMuon`` groups as Muon groups (DistMuon's
    per-matrix ``compute_sharding_by_fqn`` row blocks as ``num_heads``), ``AdamW`` (and
    ``Adam`` without weight decay) as AdamW groups. Its flat, FQN-keyed state holds the
    group keys torch's own ``Muon`` / ``AdamW`` hold, so a checkpoint crosses to and from
    torchtitan on FSDP2; this library's own group options (``ns_dtype``, ``num_heads``,
    ``batch_ns``) come from the config on load."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        impl = self._build_impl_kwargs(config)
        self._impl = impl  # torchtitan gives every group these (fused, foreach): saved as such
        self.optimizers, self.model_parts = [], model_parts
        all_params = []
        for model in model_parts:
            by_name, _ = self._build_param_groups(model, config.param_groups, impl)
            groups = []
            for name, opt_groups in by_name.items():
                if name in MUON_NAMES:
                    layouts = config.optimizer_factory_kwargs_by_name.get(name, {}).get(
                        "compute_sharding_by_fqn", {})
                    groups += [g for og in opt_groups for g in _muon_group(og, layouts, name)]
                elif name in ("AdamW", "Adam"):
                    groups += [_adamw_group(og, name) for og in opt_groups]
                else:
                    raise NotImplementedError(
                        f"matrixfsdp: optimizer '{name}' in torchtitan's param groups: "
                        f"MatrixOptimizersContainer builds {', '.join(MUON_NAMES)} (Muon on whole "
                        "matrices) and AdamW; for another optimizer on the matrices use "
                        "mf.matrix_optimizer (docs/optimizers.md)")
            self.optimizers.append(Muon(groups))
            all_params += [p for g in groups for p in g["params"]]
        self._validate_params(all_params)
        self._post_init(all_params)
        # it steps its mf.Muon, which checks its own groups: the container's own step
        # pre-hook does the step's bookkeeping only
        watch(self, checks_itself=True)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for opt in self.optimizers:
            opt.init_state()
            flat = get_flat_optim_state_dict(opt)
            for g in opt.param_groups:
                keep = _TORCH_KEYS[bool(g["use_muon"])] | _SCHEDULER_KEYS
                drop = [k for k in (*g, *PLAN_KEYS) if k not in keep]
                for fqn in g["param_names"]:
                    for key in drop:
                        flat.pop(f"param_groups.{fqn}.{key}", None)
                    if g["use_muon"]:
                        flat.update({f"param_groups.{fqn}.{k}": v for k, v in self._impl.items()})
            out.update(flat)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for opt in self.optimizers:
            opt.init_state()
            flat = dict(state_dict)
            for g in opt.param_groups:
                fqn = g["param_names"][0]
                saved = flat.get(f"param_groups.{fqn}.decoupled_weight_decay")
                check_decoupled({"decoupled_weight_decay": saved}, g,
                                f"matrixfsdp: torchtitan checkpoint, the group of '{fqn}'")
                for key, value in g.items():  # this library's own options: from the config
                    if key not in ("params", "param_names"):
                        flat.setdefault(f"param_groups.{fqn}.{key}", value)
            load_flat_optim_state_dict(opt, flat)


def muon_optimizer(adamw: OptimizersContainer.Config, *, muon_pattern: str = BLOCK_MATRICES,
                   **muon_kwargs: Any) -> MatrixOptimizersContainer.Config:
    """Moonlight's Muon + AdamW split over a config's AdamW groups: parameters matching
    ``muon_pattern`` (torchtitan's regex, searched in the parameter name; default: the
    blocks' projection matrices) get Muon with ``adjust_lr_fn="match_rms_adamw"`` and the
    AdamW groups' lr and weight decay (overridden by ``muon_kwargs``); the rest keep ``adamw``."""
    base = next((g for g in adamw.param_groups if g.optimizer_name == "AdamW"), None)
    if base is None:
        raise ValueError("matrixfsdp: muon_optimizer needs a config with an AdamW group")
    kw = base.optimizer_kwargs
    muon = dict(lr=kw.get("lr", MUON_DEFAULTS["lr"]), weight_decay=kw.get("weight_decay", 0.1),
                adjust_lr_fn="match_rms_adamw", **muon_kwargs)
    return MatrixOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=muon_pattern, optimizer_name="Muon",
                                       optimizer_kwargs=muon), *adamw.param_groups],
        implementation=adamw.implementation,
        optimizer_factory_kwargs_by_name=dict(adamw.optimizer_factory_kwargs_by_name))


# ---- the parallelize function ----------------------------------------------------------------
def _muon_filter(groups: list[tuple[str, bool]]) -> Callable[[str, torch.Tensor], bool]:
    """torchtitan's first-match assignment of parameter names to param groups, as the plan's
    ``muon_filter``: a parameter is a Muon matrix iff its first matching group is Muon."""
    compiled = [(re.compile(p), muon) for p, muon in groups]

    def is_muon(fqn: str, p: torch.Tensor) -> bool:
        return p.dim() in (2, 3) and next((m for pat, m in compiled if pat.search(fqn)), False)
    return is_muon


def _unsupported(parallel_dims: Any, parallelism: Any, training: Any) -> str | None:
    checks = [("pipeline parallelism", parallel_dims.pp_enabled),
              ("context parallelism", parallel_dims.cp_enabled),
              ("expert parallelism", parallel_dims.ep_enabled),
              ("training.enable_cpu_offload", training.enable_cpu_offload),
              ("parallelism.enable_fsdp_symm_mem", getattr(parallelism, "enable_fsdp_symm_mem", False))]
    return next((what for what, on in checks if on), None)


class _InitOnShards:
    """The root's ``init_states`` (what torchtitan's ``init_weights`` calls): each module's
    own torchtitan init (its ``param_init`` table, or ``reset_parameters``) on full tensors,
    through ``mf.init_weights``, so every rank keeps the rows one process's init gives
    (torchtitan's fused-QKV init copies a full tensor in: on a rank that does not own the
    matrix, the shard is empty)."""

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        from torchtitan.protocols.module import Module

        def own(m: nn.Module) -> None:
            if isinstance(m, Module):
                m._init_self_parameters()
                _init_buffers(m, buffer_device)
            elif m._parameters and callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
        init_weights(self, init_fn=own)


def _init_buffers(m: nn.Module, buffer_device: torch.device | None) -> None:
    """torchtitan's ``_init_self_buffers`` of one module, its tensor-parallel buffers (a
    RoPE cache under TP) DTensors again afterwards, as torchtitan's own ``init_states`` keeps
    them: the init recomputes a buffer whole, which goes back to its placements."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    placed = {name: (b.device_mesh, b.placements) for name, b in m._buffers.items()
              if isinstance(b, DTensor)}
    m._init_self_buffers(buffer_device=buffer_device)
    for name, (mesh, placements) in placed.items():
        new = m._buffers.get(name)
        if new is not None and not isinstance(new, DTensor):
            m.register_buffer(name, distribute_tensor(new, mesh, list(placements)),
                              persistent=name not in m._non_persistent_buffers_set)


def parallelize(model: nn.Module, *, parallel_dims: Any, training: Any, parallelism: Any,
                compile_config: Any, ac_config: Any, dump_folder: str,
                muon_groups: tuple[tuple[str, bool], ...] = (),
                tp_ownership: str = "auto") -> nn.Module:
    """torchtitan's ``parallelize_fn`` for a decoder (``tok_embeddings``, ``layers``,
    ``norm``, ``lm_head``), on MatrixFSDP: torchtitan's tensor parallelism
    (``model.parallelize``, as its ``parallelize_llama``), activation checkpointing, then
    compile (each block in place; refused with TP), then ``mf.fully_shard`` on the
    embedding, every block, the output head (a unit
    of its own: torchtitan's ``ChunkedLossWrapper`` calls it outside the model's forward) and
    the root, over torchtitan's data-parallel mesh (``fsdp``, or ``dp_replicate x fsdp``
    for HSDP), with its mixed precision and reshard policy. Gradients are summed, not
    averaged (divide factor 1, as torchtitan sets for FSDP2: its loss is divided by the
    global token count). ``muon_groups``: ``(pattern, is_muon)`` of the optimizer's param
    groups in order (:func:`convert` binds them), which decide the plan's Muon matrices;
    ``tp_ownership``: ``fully_shard``'s, who owns a tp-split matrix."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy

    what = _unsupported(parallel_dims, parallelism, training)
    if what is not None:
        raise NotImplementedError(f"matrixfsdp.integrations.torchtitan: {what} is not supported "
                                  "yet (data parallelism, FSDP or HSDP, with tensor parallelism, "
                                  "AC and compile is)")
    compiled = compile_config.enable and "model" in compile_config.components
    if parallel_dims.tp_enabled:
        if compiled:
            raise NotImplementedError(
                "matrixfsdp.integrations.torchtitan: compile (--compile.enable) with tensor "
                "parallelism: on torch 2.13 a compiled block fed the TP plan's pending "
                "collective results computes wrong gradients (1e-4 off one process, measured; "
                "docs/compile.md); train TP runs eagerly")
        model.parallelize(parallel_dims)  # torchtitan's own TP (its modules' sharding_config)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compiled:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    mesh = parallel_dims.get_mesh(names)
    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                              reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
                              cast_forward_inputs=False)
    reshard = get_fsdp_reshard_after_forward_policy(parallelism.fsdp_reshard_after_forward, False)
    last = parallelism.fsdp_reshard_after_forward == "always"
    tied = getattr(model, "enable_weight_tying", False)
    if not tied:  # tied: the embedding and the head share one parameter: both in the root
        if getattr(model, "tok_embeddings", None) is not None:
            fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    if not tied and getattr(model, "lm_head", None) is not None:
        fully_shard(model.lm_head, mesh=mesh, mp_policy=mp, reshard_after_forward=last)
        # ChunkedLossWrapper runs forward and backward of each chunk in turn: kept gathered
        # between them (the optimizer step reshards), one gather per step, as torchtitan
        # arranges for FSDP2's lm_head
        model.lm_head.set_reshard_after_backward(last)
    fully_shard(model, mesh=mesh, mp_policy=mp, muon_filter=_muon_filter(list(muon_groups)),
                tp_ownership=tp_ownership)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    model.__class__ = _with_init_on_shards(type(model))
    return model


@functools.cache
def _with_init_on_shards(cls: type) -> type:
    return type(cls.__name__, (_InitOnShards, cls), {"__module__": cls.__module__})


# ---- the switch -------------------------------------------------------------------------------
def convert(config: Any, *, tp_ownership: str = "auto") -> Any:
    """``config`` (torchtitan's ``Trainer.Config``) on MatrixFSDP: a copy with the model
    spec's ``parallelize_fn`` replaced by :func:`parallelize` and the optimizer by
    :class:`MatrixOptimizersContainer` over the same param groups, options and factory
    arguments (DistMuon groups become Muon groups, AdamW stays AdamW). Its SPMD backend
    becomes ``"partial_dtensor"`` (DTensor for model-parallel axes only), the one whose
    data parallelism is a ``fully_shard`` call; everything else is left as it is.
    ``tp_ownership`` goes to ``fully_shard`` (under tensor parallelism, whether a tp-split
    matrix is owned by one tp rank, its tp group, or whichever is cheaper)."""
    config = copy.deepcopy(config)
    spec, opt = config.model_spec, config.optimizer
    if spec is None:
        raise ValueError("matrixfsdp.convert: the config has no model_spec")
    if not isinstance(opt, OptimizersContainer.Config):
        raise TypeError(f"matrixfsdp.convert: optimizer config {type(opt).__name__} is not "
                        "torchtitan's OptimizersContainer.Config")
    for g in opt.param_groups:
        if g.optimizer_name not in (*MUON_NAMES, "AdamW", "Adam"):
            raise NotImplementedError(f"matrixfsdp.convert: optimizer '{g.optimizer_name}' "
                                      f"(pattern {g.pattern!r}) has no MatrixFSDP form")
    fields = {f.name: getattr(opt, f.name) for f in dataclasses.fields(OptimizersContainer.Config)}
    config.optimizer = MatrixOptimizersContainer.Config(**fields)
    groups = tuple((g.pattern, g.optimizer_name in MUON_NAMES) for g in opt.param_groups)
    spec.parallelize_fn = functools.partial(parallelize, muon_groups=groups,
                                            tp_ownership=tp_ownership)
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


# ---- torchtitan's config functions, on MatrixFSDP ---------------------------------------------
def _registered(name: str, module: str) -> Callable[[], Any]:
    def config_fn() -> Any:
        import importlib
        config = getattr(importlib.import_module(module), name)()
        config.optimizer = muon_optimizer(config.optimizer)
        return convert(config)
    config_fn.__name__ = config_fn.__qualname__ = name
    config_fn.__doc__ = (f"torchtitan's ``{name}`` ({module}) on MatrixFSDP, with Muon on the "
                         "blocks' matrices (:func:`muon_optimizer`).")
    return config_fn


# torchtitan's llama3 configs (its float8 / nvfp4 / varlen variants need CUDA kernels)
_LLAMA3 = "torchtitan.models.llama3.config_registry"
for _name in ("llama3_debugmodel", "llama3_debugmodel_ce_loss", "llama3_8b", "llama3_70b",
              "llama3_405b"):
    globals()[_name] = _registered(_name, _LLAMA3)
    __all__.append(_name)
