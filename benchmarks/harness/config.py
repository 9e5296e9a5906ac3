"""What a ``matrixfsdp bench`` run is: the systems it knows, the model presets, and every
setting of a run (:class:`BenchConfig`, saved verbatim into ``results.json``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from matrixfsdp.train.models import PRESETS as MODEL_PRESETS
from matrixfsdp.train.models import GPTConfig

SYSTEMS: tuple[str, ...] = ("fsdp2_adamw", "fsdp2_torch_muon", "fsdp2_dist_muon",
                            "fsdp2_muon_fsdp2", "matrixfsdp")
# Run only when asked for (--systems): SOAP on whole matrices, gathered (FSDP2) or on owners.
OPTIONAL_SYSTEMS: tuple[str, ...] = ("fsdp2_soap", "matrixfsdp_soap")
# HSDP mode (``--replicas R``): the systems that run on a 2-D (replicate, shard) mesh.
# DistMuon's HSDP support is an open torchtitan PR; muon-fsdp2 handles 1-D meshes only.
HSDP_SYSTEMS: tuple[str, ...] = ("fsdp2_adamw", "fsdp2_torch_muon", "matrixfsdp")
BASELINE = "fsdp2_adamw"  # the ratios' denominator for forward+backward, bytes and memory
MUON_REFERENCE = "fsdp2_torch_muon"  # torch's Muon: the reference semantics
PHASES: tuple[str, ...] = ("forward", "backward", "step")
# EXACT_BOUND: how far two Muon systems' parameters may end apart. They run the same math on
# the same data; only their summation orders differ, which bf16 Newton-Schulz (8 significant
# bits) turns into updates that differ by up to ~2^-8 of a step, fed back through later
# gradients. Measured: 6.6e-4 after 3 steps of test_bench's tiny run, 7.5e-4 to 8.2e-4
# after 8 steps of the cpu preset (docs/benchmarks.md). What a bug moves: skipping the Muon step
# moves parameters by 2.7e-2 (tiny run; ~9e-3 per step) and 2.4e-2 (cpu preset). 5e-3 is
# 6x the largest difference seen and 5x below what a skipped Muon step moves.
EXACT_BOUND = 5e-3
# Plus EXACT_ULPS roundings of the parameter dtype at each element's own size: nothing for
# fp32 (2.4e-7 |p|); bf16 parameters (the gpu preset) store 8 bits, and one rounding of a
# LayerNorm weight near 1.0 is already 7.8e-3.
EXACT_ULPS = 2
PG_TIMEOUT_S = 600

_RUN = {"cpu": dict(batch=8, dtype="float32"), "gpu": dict(batch=8, dtype="bfloat16")}
# the models are train/models.py's "bench-cpu" / "bench-gpu" (what `matrixfsdp plan` plans)
PRESETS: dict[str, dict[str, Any]] = {
    name: dict(layers=c.n_layers, d_model=c.d_model, heads=c.n_heads, mlp=c.d_mlp, seq=c.seq_len, **run)
    for name, run in _RUN.items() for c in [MODEL_PRESETS[f"bench-{name}"]]}


@dataclass
class BenchConfig:
    """Everything a run depends on; saved verbatim into ``results.json``."""

    world_size: int
    steps: int
    warmup: int
    systems: list[str]
    out: str
    preset: str
    layers: int
    d_model: int
    heads: int
    mlp: int
    seq: int
    batch: int  # sequences per rank per step
    dtype: str  # parameter dtype
    mp: str = "fp32"  # "bf16": MixedPrecisionPolicy(bf16 params, fp32 reduce) for every system
    replicas: int = 1  # > 1: HSDP, every system on a (replicas, world / replicas) mesh
    vocab: int = 256
    lr: float = 0.02  # Muon
    weight_decay: float = 0.1  # Muon
    momentum: float = 0.95
    adamw_lr: float = 3e-3
    adamw_weight_decay: float = 0.01
    adamw_betas: tuple[float, float] = (0.9, 0.999)
    adamw_eps: float = 1e-8
    seed: int = 0
    device_type: str = "cpu"
    timeout_s: float = PG_TIMEOUT_S  # process-group timeout, seconds
    backend: str = "gloo"

    @property
    def shard_size(self) -> int:
        return self.world_size // self.replicas

    def model_config(self):
        return GPTConfig(vocab_size=self.vocab, seq_len=self.seq, d_model=self.d_model,
                         n_heads=self.heads, n_layers=self.layers, d_mlp=self.mlp)
