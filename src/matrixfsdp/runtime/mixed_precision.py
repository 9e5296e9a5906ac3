"""Mixed precision: torch's own ``MixedPrecisionPolicy``, resolved per unit.

What stays in the parameters' own dtype (the "master" copy, fp32 typically): the shards,
the gradients handed to the optimizer, and so the optimizer state (Muon momentum, AdamW
moments). What a policy changes, per unit, as in FSDP2:

* gather: this rank's segment is cast to ``param_dtype`` and gathered in it (half the
  bytes of fp32 for bf16), so forward and backward compute with ``param_dtype`` weights;
* reduce: the unsharded ``param_dtype`` gradients are cast to ``reduce_dtype`` (default:
  ``param_dtype``), averaged over the ranks in it, then cast to the parameters' dtype;
* inputs: floating-point tensors in the unit's forward arguments are cast to
  ``param_dtype`` when ``cast_forward_inputs`` (the default);
* outputs: floating-point outputs are cast to ``output_dtype`` when it is set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy


def tree_map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` inside lists, tuples, namedtuples and dicts
    (``ModelOutput`` included) replaced by ``fn(t)``; other leaves are kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(tree_map_tensors(fn, x) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map_tensors(fn, x) for x in obj)
    if isinstance(obj, dict):
        mapped = {k: tree_map_tensors(fn, v) for k, v in obj.items()}
        if type(obj) is dict:
            return mapped
        out = type(obj)(**mapped) if all(isinstance(k, str) for k in mapped) else type(obj)(mapped)
        return out
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (lists, tuples, dicts), in order."""
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    if isinstance(obj, dict):  # no rebuild needed just to look
        for v in obj.values():
            found += tensors_in(v)
        return found
    tree_map_tensors(visit, obj)
    return found


@dataclass(frozen=True)
class Precision:
    """A unit's dtypes: ``orig`` (shards, optimizer-facing grads), ``param`` (gather and
    compute), ``reduce`` (gradient averaging), ``output`` (None: leave outputs alone)."""

    orig: torch.dtype
    param: torch.dtype
    reduce: torch.dtype
    output: torch.dtype | None = None
    cast_inputs: bool = False

    @classmethod
    def resolve(cls, policy: MixedPrecisionPolicy | None, orig: torch.dtype) -> Precision:
        if policy is None:
            return cls(orig, orig, orig)
        param = policy.param_dtype or orig
        return cls(orig, param, policy.reduce_dtype or param, policy.output_dtype,
                   bool(policy.cast_forward_inputs) and param != orig)

    def cast_forward_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if not self.cast_inputs:
            return args, kwargs
        return tree_map_tensors(self._to_param, (args, kwargs))

    def cast_output(self, output: Any) -> Any:
        if self.output is None:
            return output
        dtype = self.output
        return tree_map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, output)

    def _to_param(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.param) if t.is_floating_point() else t
