"""What the layout search needs to know about a model, from its parameter specs alone, and
the model as each layout's runtime sees it: tensor-parallel specs, pipeline stages.

* **Compute.** Forward FLOPs per token: ``2 x`` every block matrix's elements, plus
  causal attention ``2 x seq x d_model`` per block, plus the output head (the root's
  largest 2-D parameter, ``vocab x d_model``) once. Backward is twice the forward;
  activation checkpointing recomputes the blocks' forward once more.
* **Activations** (bf16): per token and block, every block matrix's input and output
  (``in + out`` elements; norms, residuals and the MLP's activation function are covered by
  the inputs counted once per matrix); with activation checkpointing, the block's input
  (``d_model``) per block plus one block's full activations while it is recomputed. The
  logits: ``vocab`` per token in bf16 and again in fp32 for the loss. Tensor parallelism
  (with sequence parallelism, torchtitan's plan) divides all of them by ``tp``.
* **Tensor parallelism** (torchtitan's Llama plan as :mod:`matrixfsdp.runtime.tp` plans it):
  every block matrix is split ``tp`` ways and planned whole: the output projections
  (``wo``, ``w2``, ``o_proj``, ``down_proj``, ``proj``, ...: RowwiseParallel) along their
  columns, the others (ColwiseParallel) along their rows (the dim does not change bytes or
  memory, it decides how torch's Muon runs on the DTensor); the embedding and the head are
  split by vocabulary rows; every other parameter (norms, biases, a position embedding) is
  replicated over tp.
* **Pipeline stages** (torchtitan's split, docs/pipelining.md): the blocks in ``pp``
  contiguous stages, as even as possible (the first stages take one more); stage 0 also
  holds the root's embeddings (parameters named ``*emb*``, ``wte``, ``wpe``, ``pos``), the
  last stage the rest of the root (final norm, head). Each stage is a root of its own,
  sharded over the stage's data-parallel ranks.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch import nn

from ..layout.planner import collect_params
from ..layout.types import MuonFilter, ParamSpec

_EMBEDDING = re.compile(r"(^|[._])(emb|embed\w*|embeddings|wte|wpe|pos|tok_embeddings)([._]|$)")
# torchtitan's RowwiseParallel weights (the blocks' output projections): split along columns
_ROWWISE = re.compile(r"(^|\.)(wo|w2|o|o_proj|out_proj|proj|c_proj|down_proj|dense_4h_to_h)"
                      r"\.weight$")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its specs (unit 0 its root), unit names, how many blocks."""

    specs: tuple[ParamSpec, ...]
    unit_names: tuple[str, ...]
    blocks: int
    first: bool
    last: bool


@dataclass
class ModelShapes:
    """A model's specs (unit 0 the root) and the sizes the time and memory models use."""

    specs: list[ParamSpec]
    unit_names: list[str]
    d_model: int
    vocab: int  # rows of the output head (0: none found)
    block_matmul: list[int]  # per block unit: elements of its matrices
    block_act: list[int]  # per block unit: activation elements per token (in + out)

    @property
    def blocks(self) -> int:
        return len(self.unit_names) - 1

    @property
    def n_params(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def has_experts(self) -> bool:
        return any(s.is_experts for s in self.specs)

    def forward_flops_per_token(self, seq: int, block_range: range | None = None,
                                head: bool = True) -> tuple[float, float]:
        """(blocks', head's) forward FLOPs per token (module docstring)."""
        blocks = block_range if block_range is not None else range(self.blocks)
        f = sum(2 * self.block_matmul[b] + 2 * seq * self.d_model for b in blocks)
        return float(f), float(2 * self.vocab * self.d_model if head else 0)


def _block_sizes(specs: Sequence[ParamSpec], n_units: int) -> tuple[list[int], list[int]]:
    matmul, act = [0] * n_units, [0] * n_units
    for s in specs:
        if s.unit and len(s.shape) >= 2 and s.muon:
            matmul[s.unit] += s.numel
            act[s.unit] += sum(s.matrix_shape) * (s.shape[0] if s.is_experts else 1)
    return matmul[1:], act[1:]


def model_shapes(specs: Sequence[ParamSpec], unit_names: Sequence[str]) -> ModelShapes:
    specs = list(specs)
    mins = [min(s.matrix_shape) for s in specs if s.unit and s.muon]
    d_model = collections.Counter(mins).most_common(1)[0][0] if mins else 0
    root2d = [s for s in specs if s.unit == 0 and len(s.shape) == 2]
    vocab = max((s.rows for s in root2d), default=0)
    matmul, act = _block_sizes(specs, len(unit_names))
    return ModelShapes(specs, list(unit_names), d_model, vocab, matmul, act)


def shapes_of(model: nn.Module, units: Sequence[nn.Module],
              muon_filter: MuonFilter | None = None) -> ModelShapes:
    """A model's :class:`ModelShapes`, collected as ``fully_shard`` collects (``units``: the
    modules it is called on before the root)."""
    unit_set = {id(m) for m in units} | {id(model)}
    named = [(n, m) for n, m in model.named_modules() if id(m) in unit_set]
    collected = collect_params(named, lambda m: id(m) in unit_set, muon_filter)
    return model_shapes(collected.specs, [n or "<root>" for n, _ in named])


def tp_specs(shapes: ModelShapes, tp: int) -> list[ParamSpec] | None:
    """The specs as the planner sees them under ``tp``-way tensor parallelism (module
    docstring), or None where the model cannot be split so (an expert stack, a matrix
    neither of whose dims ``tp`` divides, a vocabulary ``tp`` does not divide)."""
    if tp == 1:
        return list(shapes.specs)
    if shapes.has_experts or (shapes.vocab and shapes.vocab % tp):
        return None
    out = []
    for s in shapes.specs:
        if s.muon and len(s.shape) == 2:
            dim = 1 if _ROWWISE.search(s.name) else 0
            if s.shape[dim] % tp:
                return None
            out.append(replace(s, tp=tp, tp_dim=dim))
        elif s.unit == 0 and len(s.shape) == 2 and s.rows == shapes.vocab:
            out.append(replace(s, shape=(s.rows // tp, *s.shape[1:])))
        else:
            out.append(s)
    return out


def stage_blocks(blocks: int, pp: int) -> list[range]:
    """Block indices (0-based) of each of ``pp`` stages, the first stages one longer."""
    base, extra = divmod(blocks, pp)
    out, at = [], 0
    for s in range(pp):
        n = base + (s < extra)
        out.append(range(at, at + n))
        at += n
    return out


def stages(specs: Sequence[ParamSpec], unit_names: Sequence[str], pp: int) -> list[Stage]:
    """The ``pp`` pipeline stages of a model (module docstring); ``pp`` = 1: the model."""
    if pp == 1:
        return [Stage(tuple(specs), tuple(unit_names), len(unit_names) - 1, True, True)]
    out = []
    for k, blocks in enumerate(stage_blocks(len(unit_names) - 1, pp)):
        first, last = k == 0, k == pp - 1
        mine = []
        for s in specs:
            if s.unit == 0:
                embedding = bool(_EMBEDDING.search(s.name))
                if (first and embedding) or (last and not embedding):
                    mine.append(s)
            elif s.unit - 1 in blocks:
                mine.append(replace(s, unit=s.unit - blocks.start))
        names = ("<root>", *(unit_names[b + 1] for b in blocks))
        out.append(Stage(tuple(mine), names, len(blocks), first, last))
    return out


def distinct(stage_list: Sequence[Stage]) -> dict[tuple, list[int]]:
    """Stages that plan alike (same block count and shapes, same root role): key -> indices."""
    groups: dict[tuple, list[int]] = {}
    for i, st in enumerate(stage_list):
        key = (st.first, st.last, tuple((s.shape, s.unit, s.muon, s.tp) for s in st.specs))
        groups.setdefault(key, []).append(i)
    return groups


def activation_bytes(shapes: ModelShapes, blocks: range, tokens: int, tp: int,
                     checkpointed: bool | int, in_flight: float, head: bool) -> float:
    """Activation bytes one rank of a stage holds at its peak (module docstring).

    ``checkpointed``: how many of the stage's blocks, its first ones, recompute their
    forward in backward (True: all, False: none). Per micro-batch in flight a checkpointed
    block keeps its input, any other block its full activations; the peak is that sum over
    the micro-batches in flight, or, where larger, one checkpointed block's recompute: its
    full activations beside the inputs of the checkpointed blocks before it (the blocks
    after it are freed by then) and the other micro-batches' sums."""
    d = shapes.d_model
    k = len(blocks) if checkpointed is True else int(checkpointed)
    acts = [shapes.block_act[b] for b in blocks]
    kept = k * d + sum(acts[k:])  # one micro-batch's, per token
    peak = kept * in_flight
    if k:
        peak = max(peak, (in_flight - 1) * kept + max(i * d + acts[i] for i in range(k)))
    logits = 6.0 * shapes.vocab if head else 0.0
    return math.ceil(tokens * (2.0 * peak + logits) / tp)


def fewest_checkpointed(budget: float, shapes: ModelShapes, blocks: range, tokens: int,
                        tp: int, in_flight: float, head: bool) -> int | None:
    """The fewest of a stage's blocks to checkpoint (its first ones) so that its activations
    fit ``budget`` bytes; None where checkpointing every block does not fit. Beyond one, the
    more checkpointed, the less held, so a bisection finds it."""
    def need(k: int) -> float:
        return activation_bytes(shapes, blocks, tokens, tp, k, in_flight, head)
    n = len(blocks)
    if need(0) <= budget:
        return 0
    if not n or need(n) > budget:
        return None
    lo, hi = 1, n  # need(hi) fits
    while lo < hi:
        mid = (lo + hi) // 2
        if need(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo
