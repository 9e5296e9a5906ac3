"""The tests' small MoE (torchtitan's GroupedExperts shapes) and expert parallelism for it:
the bench's (:mod:`benchmarks.parallel.ep_model`: experts ``Shard(0)`` DTensors over ``ep``,
computed on ``.to_local()``, dense "soft" routing with an all-gather / reduce-scatter token
dispatch over ep), at a tiny size."""

from __future__ import annotations

from benchmarks.parallel.ep_model import MoEConfig, MoEModel, apply_ep
from benchmarks.parallel.ep_model import build_moe as _build_moe

TINY = MoEConfig(d_model=16, hidden=24, experts=4, vocab=64, layers=2)
VOCAB = TINY.vocab

__all__ = ["TINY", "VOCAB", "MoEModel", "apply_ep", "build_moe"]


def build_moe(seed: int = 0, config: MoEConfig = TINY) -> MoEModel:
    return _build_moe(seed, config)
