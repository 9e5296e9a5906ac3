"""What a model's state dict holds, walked once, and the check that a saved state fits it.

Every state-dict function of this library (``get_state_dict`` / ``set_state_dict``,
``full_state_dict``, ``load_full_checkpoint``, ``load_checkpoint``) reads the model through
:func:`state_entries` and compares names through :func:`check_names`, so they agree on
what a model holds and say the same thing when a checkpoint does not fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

_SHOWN = 5  # names listed in an error


@dataclass
class StateEntry:
    """One name of ``model.state_dict()``: the tensor, and where it is registered."""

    name: str
    tensor: torch.Tensor
    module: nn.Module
    attr: str
    is_param: bool


def state_entries(model: nn.Module) -> list[StateEntry]:
    """What ``model.state_dict()`` holds, in its order: parameters (tied ones under every
    name) and persistent buffers (non-persistent ones such as rotary ``inv_freq`` left out,
    as torch does), walked as ``Module.state_dict`` walks them."""
    out: list[StateEntry] = []

    def visit(mod: nn.Module, prefix: str) -> None:
        for attr, p in mod._parameters.items():
            if p is not None:
                out.append(StateEntry(prefix + attr, p, mod, attr, True))
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set:
                out.append(StateEntry(prefix + attr, b, mod, attr, False))
        for name, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.")
    visit(model, "")
    return out


def _listed(names: list[str]) -> str:
    return f"{names[:_SHOWN]}" + (", ..." if len(names) > _SHOWN else "")


def check_names(model_names: Iterable[str], saved: Iterable[str], where: str) -> None:
    """Raise ``ValueError`` when the names a checkpoint (``where``) holds differ from the
    model's, in either direction (a model of another depth or width, or another model)."""
    model_names, saved = set(model_names), set(saved)
    missing, unexpected = sorted(model_names - saved), sorted(saved - model_names)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"the model has {len(missing)} names the checkpoint lacks ({_listed(missing)})")
    if unexpected:
        parts.append(f"the checkpoint has {len(unexpected)} names the model lacks "
                     f"({_listed(unexpected)})")
    raise ValueError(f"matrixfsdp: {where} does not fit the model: " + "; ".join(parts)
                     + ". It was saved from another model (another depth, width or naming)")
