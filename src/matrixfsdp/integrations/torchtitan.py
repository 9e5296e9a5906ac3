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
the same param groups, first match wins, as torchtitan assigns them. The model spec's
``pipelining_fn`` (torchtitan's ``pipeline_llm``) becomes :func:`pipeline_llm` (the library's
pipeline stage), and the trainer ``MatrixTrainer`` (torchtitan's, but for its clip under
expert parallelism). Expert and context parallelism are torchtitan's own, applied by
:func:`parallelize` (docs/torchtitan.md).

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
from ..runtime.module import FSDPModule
from ..state.init import init_weights
from .torchtitan_optim import (
    BLOCK_MATRICES,
    MUON_NAMES,
    MatrixOptimizersContainer,
    OptimizersContainer,
    muon_optimizer,
)
from .torchtitan_trainer import on_matrix_trainer, pipeline_llm, trainer_class

# MatrixTrainer is made on first use (module __getattr__): torchtitan's trainer module is
# imported then, not with this one
__all__ = ["MatrixOptimizersContainer", "MatrixTrainer", "convert", "parallelize",  # noqa: F822
           "pipeline_llm", "muon_optimizer", "BLOCK_MATRICES", "MUON_NAMES"]

# ---- the parallelize function ----------------------------------------------------------------
def _muon_filter(groups: list[tuple[str, bool]]) -> Callable[[str, torch.Tensor], bool]:
    """torchtitan's first-match assignment of parameter names to param groups, as the plan's
    ``muon_filter``: a parameter is a Muon matrix iff its first matching group is Muon."""
    compiled = [(re.compile(p), muon) for p, muon in groups]

    def is_muon(fqn: str, p: torch.Tensor) -> bool:
        return p.dim() in (2, 3) and next((m for pat, m in compiled if pat.search(fqn)), False)
    return is_muon


def _unsupported(parallel_dims: Any, parallelism: Any, training: Any) -> str | None:
    checks = [("expert parallelism with tensor parallelism",
               parallel_dims.ep_enabled and parallel_dims.tp_enabled),
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
    ``norm``, ``lm_head``; DeepSeek-V3's ``mtp_layers`` are blocks too), or one pipeline
    part of it, on MatrixFSDP: torchtitan's context parallelism (``apply_cp_to_forward``,
    unchanged), its tensor and expert parallelism (``model.parallelize``, as its
    ``parallelize_llama`` / ``parallelize_qwen3``: routed experts DTensors ``Shard(0)`` over
    ``ep``), activation checkpointing, then compile (each block in place; refused with TP),
    then ``mf.fully_shard`` on the embedding, each MoE block's routed experts over
    torchtitan's ``efsdp`` mesh (a unit of their own), every block, the output head (a unit
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
                                  "yet (data parallelism, FSDP or HSDP, with tensor, expert, "
                                  "pipeline or context parallelism, AC and compile is)")
    compiled = compile_config.enable and "model" in compile_config.components
    if parallel_dims.tp_enabled:
        if compiled:
            raise NotImplementedError(
                "matrixfsdp.integrations.torchtitan: compile (--compile.enable) with tensor "
                "parallelism: on torch 2.13 a compiled block fed the TP plan's pending "
                "collective results computes wrong gradients (1e-4 off one process, measured; "
                "docs/compile.md); train TP runs eagerly")
    if parallel_dims.cp_enabled:
        # torchtitan's own CP, unchanged, before its TP as torchtitan orders them (each
        # inner attention's forward wrapped); torchtitan's fsdp mesh, over which the blocks
        # are sharded below, is dp_shard x cp: each matrix's gradient sums the cp ranks' too
        from torchtitan.distributed.context_parallel import apply_cp_to_forward
        apply_cp_to_forward([block.attention.inner_attention for block in model.layers.values()],
                            parallel_dims.get_mesh("cp"))
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        # torchtitan's own TP and EP (its modules' sharding_config): under EP the routed
        # experts become DTensors Shard(0) over ``ep``, each rank holding its experts whole
        model.parallelize(parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compiled:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    mesh = parallel_dims.get_mesh(names)
    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                              reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
                              cast_forward_inputs=False)
    reshard = get_fsdp_reshard_after_forward_policy(parallelism.fsdp_reshard_after_forward,
                                                    parallel_dims.pp_enabled)
    last = parallelism.fsdp_reshard_after_forward == "always"
    tied = getattr(model, "enable_weight_tying", False)
    if not tied:  # tied: the embedding and the head share one parameter: both in the root
        if getattr(model, "tok_embeddings", None) is not None:
            fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    experts_mesh = None
    if parallel_dims.ep_enabled:  # the routed experts' FSDP mesh: torchtitan's efsdp
        experts_mesh = parallel_dims.get_mesh(
            ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"])
    for block in _blocks(model):
        experts = _routed_experts(block)
        if experts is not None and experts_mesh is not None:
            # a unit of its own on efsdp (dp_shard x cp / ep), as torchtitan's
            # shard_placement_fn gives FSDP2's experts their own mesh: each expert whole on
            # one rank of it, beside the other ep ranks' experts
            fully_shard(experts, mesh=experts_mesh, mp_policy=mp, reshard_after_forward=reshard)
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


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder's blocks, in order: ``layers``, then DeepSeek-V3's MTP layers (torchtitan
    shards those as blocks too)."""
    mtp = getattr(model, "mtp_layers", None)
    return [*model.layers.values(), *(mtp if mtp is not None else [])]


def _routed_experts(block: nn.Module) -> nn.Module | None:
    """A MoE block's routed experts (torchtitan's ``GroupedExperts``, the grouped-GEMM child
    holding the 3-D stacks), or None."""
    if not getattr(block, "moe_enabled", False):
        return None
    routed = getattr(block.moe, "routed_experts", None)
    return getattr(routed, "inner_experts", None)


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
    if _is_titan_pipeline_llm(spec.pipelining_fn):
        spec.pipelining_fn = pipeline_llm
    config.parallelism.spmd_backend = "partial_dtensor"
    return on_matrix_trainer(config)


def __getattr__(name: str) -> Any:
    if name == "MatrixTrainer":
        return trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_titan_pipeline_llm(fn: Any) -> bool:
    """Whether ``fn`` is torchtitan's own ``pipeline_llm`` (the decoders' pipelining_fn)."""
    try:
        from torchtitan.distributed.pipeline_parallel import pipeline_llm as titan
    except ImportError:  # pragma: no cover
        return False
    return fn is titan


# ---- torchtitan's config functions, on MatrixFSDP ---------------------------------------------
def _registered(name: str, module: str, adapt: Callable[[Any], Any] | None = None,
                note: str = "") -> Callable[[], Any]:
    def config_fn() -> Any:
        import importlib
        config = getattr(importlib.import_module(module), name)()
        if adapt is not None:
            config = adapt(config)
        config.optimizer = muon_optimizer(config.optimizer)
        return convert(config)
    config_fn.__name__ = config_fn.__qualname__ = name
    config_fn.__doc__ = (f"torchtitan's ``{name}`` ({module}) on MatrixFSDP, with Muon on the "
                         f"blocks' matrices (:func:`muon_optimizer`).{note}")
    return config_fn


def _float8_named(name: str, module: str) -> Callable[[], Any]:
    """torchtitan's config function ``name``, whose float8 converter (torchtitan's
    ``Float8LinearConverter``, built with the config) needs a GPU: where it cannot be built
    (no CUDA SM89+ / ROCm MI300+, or no torchao), refused naming float8 and what it needs."""
    import importlib
    titan = getattr(importlib.import_module(module), name)

    def build() -> Any:
        try:
            return titan()
        except (ImportError, ValueError) as e:
            if "float8" not in str(e).lower():
                raise
            raise NotImplementedError(
                f"matrixfsdp.integrations.torchtitan: {name} trains its linear layers in float8 "
                "(torchtitan's Float8LinearConverter), which needs an NVIDIA SM89+ or AMD MI300+ "
                f"GPU and torchao; here: {e}") from e
    return build


def _compile_off(config: Any) -> Any:
    """Compile off: under tensor parallelism :func:`parallelize` refuses it (on torch 2.13 a
    compiled block fed the TP plan's pending collectives computes wrong gradients)."""
    config.compile.enable = False
    return config


# torchtitan's llama3 configs (its float8 / nvfp4 / varlen variants need CUDA kernels); 70B
# and 405B set tensor parallelism (torchtitan's tp 8; the planner advises tp 4 at 70B:
# --parallelism.tensor_parallel_degree 4), 405B float8 (a GPU's) and, as torchtitan ships it,
# compile, here off
_LLAMA3 = "torchtitan.models.llama3.config_registry"
for _name in ("llama3_debugmodel", "llama3_debugmodel_ce_loss", "llama3_8b", "llama3_70b"):
    globals()[_name] = _registered(_name, _LLAMA3)
    __all__.append(_name)


def llama3_405b() -> Any:
    """torchtitan's ``llama3_405b`` on MatrixFSDP, with Muon on the blocks' matrices
    (:func:`muon_optimizer`): tensor parallelism 8, float8 linears (they need an NVIDIA
    SM89+ or AMD MI300+ GPU and torchao: elsewhere refused, naming float8), compile off
    (refused with tensor parallelism; torchtitan's own config compiles)."""
    config = _compile_off(_float8_named("llama3_405b", _LLAMA3)())
    config.optimizer = muon_optimizer(config.optimizer)
    return convert(config)


__all__.append("llama3_405b")

# torchtitan's MoE configs: routed experts as Muon matrices (each whole on one owner; under
# --parallelism.expert_parallel_degree N on torchtitan's ep and efsdp meshes)
for _name, _module in (("qwen3_moe_debug", "torchtitan.models.qwen3.config_registry"),
                       ("qwen3_30b_a3b", "torchtitan.models.qwen3.config_registry"),
                       ("deepseek_v3_debugmodel", "torchtitan.models.deepseek_v3.config_registry"),
                       ("deepseek_v3_debugmodel_mtp", "torchtitan.models.deepseek_v3.config_registry"),
                       ("deepseek_v3_16b", "torchtitan.models.deepseek_v3.config_registry")):
    globals()[_name] = _registered(_name, _module)
    __all__.append(_name)
