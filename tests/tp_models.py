"""A Llama-shaped model and torchtitan's tensor-parallel plan for it (tests only).

The model is written as torchtitan writes Llama (heads inferred with ``view(..., -1, hd)``,
so a tp rank computes its own heads), and the plan is torchtitan's
``apply_tp`` for Llama 3: ColwiseParallel q/k/v/w1/w3, RowwiseParallel wo/w2, a
RowwiseParallel embedding, a ColwiseParallel output head, and with sequence parallelism
SequenceParallel norms and PrepareModuleInput around attention and the MLP.
"""

from __future__ import annotations

import torch
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

D, HEADS, VOCAB, LAYERS, FFN = 32, 4, 64, 2, 64


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, D // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, FFN, bias=False)
        self.w2 = nn.Linear(FFN, D, bias=False)
        self.w3 = nn.Linear(D, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(D)
        self.output = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))

    def loss(self, idx, targets):
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def build_llama(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama()


def apply_tp(model: Llama, tp_mesh, sequence_parallel: bool = False) -> Llama:
    """torchtitan's Llama TP plan on ``tp_mesh`` (loss on replicated logits)."""
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
                "feed_forward": PrepareModuleInput(input_layouts=seq[0], desired_input_layouts=seq[1]),
            })
        parallelize_module(block, tp_mesh, plan)
    return model
