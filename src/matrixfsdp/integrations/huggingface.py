"""Hugging Face models in one call: the repeated blocks become units, then the root.

Nothing here imports ``transformers``: a model is recognised by what it carries
(``_no_split_modules``, the class names of the blocks that must not be split, which every
transformers model declares), so any ``nn.Module`` works with explicit ``block_types``.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..fully_shard import fully_shard
from ..layout.types import MuonFilter
from ..runtime.mixed_precision import MixedPrecisionPolicy
from ..runtime.module import default_mesh


def _blocks(model: nn.Module, block_types: Iterable[type | str] | None) -> list[nn.Module]:
    if block_types is None:
        names = set(getattr(model, "_no_split_modules", None) or ())
        if not names:
            layers = getattr(getattr(model, "model", None), "layers", None)
            if layers is None:
                raise ValueError(
                    f"matrixfsdp.shard_model: {type(model).__name__} declares no "
                    "_no_split_modules and has no model.layers; pass block_types=[...]")
            return list(layers)
        block_types = names
    types = tuple(t for t in block_types if isinstance(t, type))
    names = {t for t in block_types if isinstance(t, str)}
    found = [m for m in model.modules() if m is not model
             and (isinstance(m, types) or type(m).__name__ in names)]
    if not found:
        raise ValueError(f"matrixfsdp.shard_model: no module of {sorted(map(str, block_types))} "
                         f"in {type(model).__name__}")
    return found


def shard_model(model: nn.Module, mesh: DeviceMesh | None = None,
                mp_policy: MixedPrecisionPolicy | None = None,
                block_types: Iterable[type | str] | None = None, *,
                reshard_after_forward: bool | None = None,
                muon_filter: MuonFilter | None = None, debug: bool = False) -> nn.Module:
    """``fully_shard`` every repeated block of ``model``, then ``model`` itself.

    Blocks: instances of ``block_types`` (classes or class names; default: the model's
    ``_no_split_modules``, as transformers models declare them, else ``model.model.layers``),
    innermost first. Everything outside the blocks (embeddings, final norm, head, tied or
    not) belongs to the root unit. ``muon_filter`` and ``debug`` go to the root call, as
    with ``fully_shard``. Returns ``model``.
    """
    blocks = _blocks(model, block_types)
    mesh = mesh or default_mesh()
    for block in reversed(blocks):  # modules() is pre-order: reversed, nested blocks first
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mp_policy)
    return fully_shard(model, mesh=mesh, mp_policy=mp_policy, muon_filter=muon_filter,
                       debug=debug)
