"""torch.distributed.pipelining with stages sharded by :func:`~matrixfsdp.fully_shard`.

torch's schedules drive data parallelism through the stage: ``PipelineStage`` keeps the
gradients of every micro-batch unreduced and reduces them once, after the step's last
backward, but only for torch's own ``FSDPModule`` (it reaches into FSDP2's param groups to
do so), and its split backward (zero-bubble schedules: input gradients first, weight
gradients later) hands autograd ``submod.parameters()``, which between calls are this
library's shards, not the tensors the graph holds. :class:`PipelineStage` is torch's
class, same signature, with those places taught this library's model:

* every backward keeps its gradients on the unsharded parameters, unreduced, as FSDP2's
  no-sync does (``set_requires_gradient_sync(False)``), and keeps the units gathered
  (``set_reshard_after_backward(False)``, as torch does for FSDP2), from the step's first
  forward on: a loss that runs backward passes of its own between the schedule's forward
  and backward (torchtitan's ``ChunkedLossWrapper`` on the last stage, chunk by chunk
  through ``lm_head``) keeps its gradients with the others;
* the split backward's two passes see the unsharded parameters (registered on the module
  for the length of the call), so the weight pass accumulates where the graph points;
* the first step's metadata inference (torch runs one real forward and backward to learn
  the shapes, and clears FSDP2's gradients after it) leaves no gradient either;
* ``perform_reduce_grad`` (the schedule's REDUCE_GRAD, after the last weight pass) puts the
  user's settings back and reduces every gradient of the step to its owner, once; then
  torch scales the shards' gradients by the micro-batch count.

An optimizer step while a stage still holds its gradients (a schedule that never reduced)
raises (:meth:`~matrixfsdp.runtime.root.Root.check_grads_reduced`); torch's own
``PipelineStage`` over this library's module is refused at its first forward
(:func:`~matrixfsdp.runtime.unit.refuse_torch_pipeline_stage`), before anything moves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import pipelining

from .. import _compat
from ..runtime.module import FSDPModule, get_root
from ..runtime.unit import ShardedState

__all__ = ["PipelineStage"]


class PipelineStage(pipelining.PipelineStage):
    """torch's :class:`torch.distributed.pipelining.PipelineStage` for a ``submodule``
    sharded by :func:`matrixfsdp.fully_shard` (the stage's root: every unit of the stage
    inside it). The same arguments; any other ``submodule`` behaves exactly as under
    torch's class. Use it with any of torch's schedules (docs/pipelining.md)."""

    sees_matrixfsdp = True  # torch's own stage is refused at the module's forward (unit.py)

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device, *args: Any, **kwargs: Any):
        self._root = None
        if isinstance(submodule, FSDPModule):
            self._root = get_root(submodule)
            if self._root.module is not submodule:
                raise ValueError(
                    f"matrixfsdp: pipeline stage {stage_index}: {type(submodule).__name__} is a "
                    f"unit inside the model rooted at {type(self._root.module).__name__}; a stage "
                    "must be its own root: call fully_shard on the stage module last")
        _compat.check_stage_metadata_inference(type(self))
        super().__init__(submodule, stage_index, num_stages, device, *args, **kwargs)
        self._user_flags: list[tuple[bool, bool]] | None = None  # while gradients are held

    def _hold_grads(self) -> None:
        """The step's first backward: no reduce and no reshard until perform_reduce_grad."""
        root = self._root
        if self._user_flags is None:
            self._user_flags = [(u.requires_gradient_sync, u.reshard_after_backward)
                                for u in root.units]
            for u in root.units:
                u.requires_gradient_sync = u.reshard_after_backward = False
            root.grads_held_by = f"pipeline stage {self.stage_index}"

    def _release_grads(self) -> None:
        root = self._root
        if self._user_flags is not None:
            for u, (sync, reshard) in zip(root.units, self._user_flags):
                u.requires_gradient_sync, u.reshard_after_backward = sync, reshard
            self._user_flags = None
            root.grads_held_by = None

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        # From the step's first forward: a loss that runs backward passes of its own before
        # the schedule's first backward (torchtitan's ChunkedLossWrapper calls lm_head and
        # its backward chunk by chunk inside the loss) keeps its gradients with the others
        if self._root is not None and self.has_backward:
            self._hold_grads()
        return super().forward_one_chunk(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if self._root is None:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self._hold_grads()
        if backward_type == "full":  # autograd.backward: the units' hooks see it all
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # The split passes read self.submod.parameters() for the tensors to differentiate:
        # let them find the unsharded parameters the graph was built on.
        units = self._root.units
        for u in units:
            u.register(u.unsharded)
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        finally:
            for u in units:
                if u.sharded_state is not ShardedState.PINNED:
                    u.register(u.sharded)

    def _discard_inference_grads(self) -> None:
        # torch infers the stage's metadata from one real forward and backward at the first
        # step, then clears the gradients of FSDP2's modules: a loss that runs backward
        # passes of its own (torchtitan's ChunkedLossWrapper through lm_head) leaves
        # gradients here too, of inputs that are no micro-batch's
        if self._root is not None:
            self._root.discard_grads()

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self._root is not None:
            self._release_grads()
            self._root.finish_grads()  # every gradient of the step to its owner, once
        super().perform_reduce_grad(grad_scale_factor)  # then torch scales the shards' .grad


# after torch's cleanup of the first step's metadata inference (a private method of torch's)
_compat.after_stage_metadata_inference(PipelineStage, PipelineStage._discard_inference_grads)
