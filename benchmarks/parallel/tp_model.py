"""The model of ``matrixfsdp bench --tp`` (:mod:`.tp`): tests/helpers/tp_models.py's Llama with
torchtitan's TP plan, sized by a config, and the bench's config."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

SYSTEMS = ("matrixfsdp", "fsdp2_tp")
KINDS = ("gather", "reduce")  # what a collective is for (the table's columns)
MIB = 2 ** 20


# ---- the model: tests/helpers/tp_models.py's Llama, sized by a config --------------------------------
@dataclass(frozen=True)
class LlamaConfig:
    d_model: int = 256
    heads: int = 4
    ffn: int = 512
    layers: int = 4
    vocab: int = 512
    kv_heads: int | None = None  # grouped-query attention (Llama 3's 8): None, as many as heads


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.head_dim = c.d_model // c.heads
        kv = (c.kv_heads or c.heads) * self.head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(c.d_model, n, bias=False)  # in this order:
                                              for n in (c.d_model, kv, kv, c.d_model))  # the init
        self.gqa = kv != c.d_model

    def forward(self, x):
        b, t, _ = x.shape  # heads inferred (-1): a tp rank computes its own
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(c.d_model, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.d_model, bias=False)
        self.w3 = nn.Linear(c.d_model, c.ffn, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(c.d_model), nn.RMSNorm(c.d_model)
        self.attention, self.feed_forward = Attention(c), FeedForward(c)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """torchtitan's Llama layout (no rotary embedding): embedding, blocks of attention
    (q/k/v/o) and a SwiGLU MLP (w1/w2/w3) with RMSNorms, final norm, output head."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab, c.d_model)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.d_model)
        self.output = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))

    def loss(self, idx, targets):
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, self.config.vocab).float(), targets.reshape(-1))


def apply_tp(model: Llama, tp_mesh, sequence_parallel: bool = False) -> Llama:
    """torchtitan's Llama TP plan on ``tp_mesh``: ColwiseParallel q/k/v/w1/w3, RowwiseParallel
    wo/w2, a RowwiseParallel embedding, a ColwiseParallel head (loss on replicated logits);
    with sequence parallelism, SequenceParallel norms and PrepareModuleInput around attention
    and the MLP."""

    sp = sequence_parallel
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=Shard(1) if sp else Replicate()),
        **({"norm": SequenceParallel()} if sp else {}),
        "output": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                  output_layouts=Replicate()),
    })
    for block in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        }
        if sp:
            seq = (Shard(1),), (Replicate(),)
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=seq[0], desired_input_layouts=seq[1]),
                "feed_forward": PrepareModuleInput(input_layouts=seq[0],
                                                   desired_input_layouts=seq[1]),
            })
        parallelize_module(block, tp_mesh, plan)
    return model


@dataclass
class TPBenchConfig:
    """Everything a run depends on; saved verbatim into ``tp.json``."""

    grids: list[tuple[int, int]] = field(default_factory=lambda: [(2, 2), (4, 2)])  # (dp, tp)
    model: LlamaConfig = field(default_factory=LlamaConfig)
    seq: int = 64
    batch: int = 2  # sequences per data-parallel rank per step
    warmup: int = 1
    sequence_parallel: bool = False
    seed: int = 0
    out: str = "runs/bench_tp"
    timeout: float = 600.0  # process-group timeout, seconds


