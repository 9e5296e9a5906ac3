"""The planner tests' small model (GQA heads, a gated MLP) and its shapes as the search reads
them: built on the meta device, the blocks its units."""

from __future__ import annotations

import torch

from matrixfsdp.advisor.model_shapes import shapes_of
from matrixfsdp.train.models import GPT, GPTConfig

GiB = 2**30
CFG = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=6, d_mlp=48,
                gated_mlp=True, seq_len=8)


def gpt_shapes(cfg: GPTConfig = CFG):
    """``shapes_of`` a :class:`~matrixfsdp.train.models.GPT` of ``cfg``, its blocks as units."""
    with torch.device("meta"):
        model = GPT(cfg)
    return shapes_of(model, list(model.layers))
