"""The tests' Llama-shaped model and torchtitan's tensor-parallel plan for it: the bench's
(:mod:`benchmarks.parallel.tp_model`: heads inferred with ``view(..., -1, hd)`` so a tp rank
computes its own; ColwiseParallel q/k/v/w1/w3, RowwiseParallel wo/w2 and embedding,
ColwiseParallel head, optional sequence parallelism), at a tiny size."""

from __future__ import annotations

import torch

from benchmarks.parallel.tp_model import Llama as _Llama
from benchmarks.parallel.tp_model import LlamaConfig, apply_tp

TINY = LlamaConfig(d_model=32, heads=4, ffn=64, layers=2, vocab=64)
VOCAB = TINY.vocab

__all__ = ["TINY", "VOCAB", "Llama", "apply_tp", "build_llama"]


def Llama(config: LlamaConfig = TINY) -> _Llama:  # noqa: N802 (the tests build it like a class)
    return _Llama(config)


def build_llama(seed: int = 0, config: LlamaConfig = TINY) -> _Llama:
    torch.manual_seed(seed)
    return Llama(config)
