"""State dicts keyed by parameter name, as full (unsharded) tensors."""

from __future__ import annotations

import torch
from torch import nn

from .comm import gather_v
from .runtime import get_root


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter name -> full tensor (and buffers), on every rank.

    A collective: every rank must call it. Names are those of the unsharded model, so the
    result loads into a plain ``nn.Module`` with ``load_state_dict``.
    """
    root = get_root(model)
    out: dict[str, torch.Tensor] = {}
    for unit in root.units:
        lay = unit.layout
        flat = unit.local.new_empty(lay.numel)
        gather_v(unit.local, flat, lay.seg_sizes, root.group)
        for pl, pieces in zip(lay.placements, lay.pieces):
            spec = pl.spec
            full = flat.new_empty(spec.numel)
            rows = full.view(spec.rows, spec.row_numel)
            for pc in pieces:
                rows[pc.row_start:pc.row_stop].view(-1).copy_(flat[pc.offset:pc.offset + pc.numel])
            out[spec.name] = full.view(spec.shape)
    # The module's order and names, tied parameters under each of their names (as
    # ``model.state_dict()`` holds them).
    ordered = {name: out[root.aliases.get(name, name)]
               for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, buf in persistent_buffers(model):
        ordered[name] = buf.detach().clone()
    return ordered


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) for the buffers ``model.state_dict()`` holds: non-persistent ones
    (rotary ``inv_freq``, causal masks) are left out, as torch does."""
    return [(f"{prefix}.{name}" if prefix else name, buf)
            for prefix, mod in model.named_modules() for name, buf in mod._buffers.items()
            if buf is not None and name not in mod._non_persistent_buffers_set]


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into this rank's shards (no communication; every rank needs
    ``state``). Raises ``KeyError``/``ValueError`` naming a missing or misshapen entry."""
    root = get_root(model)
    for unit in root.units:
        for p in unit.sharded:
            spec = p._mf_placement.spec
            if spec.name not in state:
                raise KeyError(f"state dict has no entry for parameter '{spec.name}'")
            full = state[spec.name]
            if tuple(full.shape) != spec.shape:
                raise ValueError(f"parameter '{spec.name}': state dict has shape "
                                 f"{tuple(full.shape)}, the model {spec.shape}")
            start, stop = p._mf_placement.row_ranges[root.rank]
            rows = full.reshape(spec.rows, spec.row_numel)[start:stop]
            p.view(-1).copy_(rows.reshape(-1))
    buffers = dict(model.named_buffers())
    for name, buf in buffers.items():
        if name in state:
            buf.copy_(state[name])
