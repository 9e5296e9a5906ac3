"""torchtitan's pipeline split of the tests' Llama (tp_models.py): a stage is the full
model with the layers of other stages deleted, the embedding only on the first stage and
the final norm and output head only on the last, so every name keeps its place in the
full model's state dict (``layers.2.attention.wq.weight`` on whichever stage holds it)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from benchmarks.parallel.tp_model import LlamaConfig
from helpers.tp_models import VOCAB, build_llama

PP_CONFIG = LlamaConfig(d_model=32, heads=4, ffn=64, layers=4, vocab=VOCAB)


class LlamaStage(nn.Module):
    """Layers ``layers`` of ``full`` (its own modules, not copies), with the embedding if
    ``first`` and the norm and head if ``last``."""

    def __init__(self, full: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = full.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in layers})
        self.norm = full.norm if last else None
        self.output = full.output if last else None

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for block in self.layers.values():
            x = block(x)
        return x if self.output is None else self.output(self.norm(x))


def build_full(seed: int = 0) -> nn.Module:
    return build_llama(seed, PP_CONFIG)


def build_stage(stage: int, num_stages: int, seed: int = 0) -> LlamaStage:
    """Stage ``stage`` of ``num_stages`` (layers split evenly), initialised as the full model
    built from ``seed``."""
    per = PP_CONFIG.layers // num_stages
    return LlamaStage(build_full(seed), range(stage * per, (stage + 1) * per),
                      stage == 0, stage == num_stages - 1)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
