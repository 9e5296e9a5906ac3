"""torchtitan's trainer pieces the one line replaces: its decoders' ``pipelining_fn``, building
the library's pipeline stage (:func:`pipeline_llm`), and its ``Trainer``, subclassed for its
clip under expert parallelism (``MatrixTrainer``). Part of
:mod:`matrixfsdp.integrations.torchtitan`, the one line's module."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .pipelining import PipelineStage

__all__ = ["pipeline_llm", "trainer_class", "on_matrix_trainer"]


def pipeline_llm(model: nn.Module, *, parallel_dims: Any, training: Any, parallelism: Any,
                 compile_config: Any, ac_config: Any, dump_folder: str, device: torch.device,
                 model_config: Any, parallelize_fn: Callable[..., nn.Module],
                 loss_fn: Callable[..., Any]) -> tuple[Any, list[nn.Module], bool, bool]:
    """torchtitan's ``pipelining_fn`` for a decoder (its ``pipeline_llm``), building
    :class:`matrixfsdp.integrations.pipelining.PipelineStage` (torch's class and signature,
    taught MatrixFSDP's units) in place of torch's: the same stages, parts and schedule,
    through torchtitan's own helpers (its split into parts, the pp rank's stage indices,
    its mesh callback, its schedule), each part ``parallelize_fn``'d before its stage is
    built (a stage takes a sharded part: the part is its root). Returns torchtitan's
    ``(schedule, model_parts, has_first_stage, has_last_stage)``. It follows torchtitan
    0.3.0's ``pipeline_llm`` step for step through that version's private helpers (the
    version the Makefile installs): a torchtitan that renames them fails here by name, and
    ``tests/integrations/test_torchtitan_nd.py`` compares the result with torchtitan's own
    pipeline run."""
    from torchtitan.distributed import pipeline_parallel as tpp

    pp_mesh = parallel_dims.get_mesh("pp")
    virtual, layers, first, last = tpp._get_pipeline_metadata(parallel_dims, parallelism,
                                                               model_config)
    names = parallelism.module_fqns_per_model_part or tpp._generate_llm_fqn_per_model_part(
        virtual, layers, first, last)
    get_mesh = tpp._build_get_mesh_callback(parallel_dims)
    stages, parts = [], []
    for index in tpp._get_pp_rank_to_stage_indices_mapping(
            pp_mesh.get_local_rank(), pp_mesh.size(), parallelism.pipeline_parallel_schedule,
            len(names)):
        part = parallelize_fn(tpp._split_module(model, names[index]), parallel_dims=parallel_dims,
                              training=training, parallelism=parallelism,
                              compile_config=compile_config, ac_config=ac_config,
                              dump_folder=dump_folder)
        stages.append(PipelineStage(part, index, len(names), device, group=pp_mesh.get_group("pp"),
                                    get_mesh=get_mesh))
        parts.append(part)
    schedule = tpp._build_pipeline_schedule(parallelism=parallelism,
                                            local_batch_size=training.local_batch_size,
                                            stages=stages, loss_fn=loss_fn)
    return (schedule, parts, any(s.is_first for s in stages), any(s.is_last for s in stages))


# ---- the trainer ------------------------------------------------------------------------------
class _ClipWithoutEPSplit:
    """torchtitan's ``ParallelDims`` as ``Trainer.train_step`` reads it, but for its clip's
    ``ep_enabled``: False, so that torchtitan's ``clip_grad_norm_`` takes its path for one
    list of gradients (:class:`MatrixTrainer`). Everything else is the trainer's own."""

    ep_enabled = False

    def __init__(self, dims: Any):
        self._dims = dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dims, name)


@functools.cache
def trainer_class() -> type:
    """:class:`MatrixTrainer`, made on first use: torchtitan's trainer module imports what
    only its GPU paths need, so this module does not import it at its own import."""
    from torchtitan.trainer import Trainer

    class MatrixTrainer(Trainer):
        """torchtitan's ``Trainer``, subclassed through its ``Config`` as torchtitan's own
        trainers are (``config.build()`` builds it): the same trainer, but for one thing under
        expert parallelism. torchtitan's ``clip_grad_norm_`` then splits the gradients into
        the experts' and the rest (``_clip_grad_norm_with_ep``), asserting that every
        parameter and gradient is a DTensor, which MatrixFSDP's shards are not (each Muon
        matrix lives whole on one rank: a plain tensor there, an empty one elsewhere). Its
        path for one list is exact on them: the norms of a list of MatrixFSDP gradients
        reduce over every rank of the model, each element, expert or dense, counted once
        (docs/torchtitan.md). So under EP ``train_step`` runs as torchtitan's with the clip
        told ``ep_enabled=False``; nothing else changes."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Trainer.Config):
            pass

        def train_step(self, data_iterator: Any) -> Any:
            dims = self.parallel_dims
            if not dims.ep_enabled:
                return super().train_step(data_iterator)
            self.parallel_dims = _ClipWithoutEPSplit(dims)
            try:
                return super().train_step(data_iterator)
            finally:
                self.parallel_dims = dims

    MatrixTrainer.__module__ = "matrixfsdp.integrations.torchtitan"
    return MatrixTrainer


def on_matrix_trainer(config: Any) -> Any:
    """``config`` as :class:`MatrixTrainer`'s config (the same fields), if it is torchtitan's
    own ``Trainer.Config``; a config of another trainer (a subclass) is left to it."""
    trainer = trainer_class()
    base = trainer.__mro__[1].Config
    if type(config) is not base:
        return config
    return trainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                             if f.init})
