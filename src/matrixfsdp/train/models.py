"""A small decoder-only transformer (GPT-style, byte vocabulary) for the demo, the tests
and the benchmark, and the shapes of well-known large models for planning on meta."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 256
    d_model: int = 384
    n_heads: int = 6
    n_kv_heads: int | None = None  # grouped-query attention when < n_heads
    n_layers: int = 8
    d_mlp: int = 1536
    fused_qkv: bool = False
    norm_bias: bool = True
    mlp_bias: bool = False
    gated_mlp: bool = False  # SwiGLU: w1, w3 (gate/up) and w2 (down), as in Llama


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = d // cfg.n_heads
        self.d_kv = self.head_dim * self.n_kv_heads
        if cfg.fused_qkv:
            self.qkv = nn.Linear(d, d + 2 * self.d_kv, bias=False)
        else:
            self.q = nn.Linear(d, d, bias=False)
            self.k = nn.Linear(d, self.d_kv, bias=False)
            self.v = nn.Linear(d, self.d_kv, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.qk_clip = None  # set by matrixfsdp.QKClip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split([D, self.d_kv, self.d_kv], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        # heads counted from the width (-1): under tensor parallelism a rank holds its own
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.qk_clip is not None:  # matrixfsdp.QKClip: this step's largest logits per head
            self.qk_clip.observe(self, q, k)
        gqa = self.n_kv_heads != self.n_heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gated = cfg.gated_mlp
        self.fc = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        if self.gated:
            self.gate = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        self.proj = nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate(x)) * self.fc(x) if self.gated else F.gelu(self.fc(x))
        return self.proj(h)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model, bias=cfg.norm_bias)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model, bias=cfg.norm_bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Embedding -> blocks -> final norm -> untied head. ``forward(idx)`` gives logits;
    ``loss(idx, targets)`` the mean cross-entropy."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model, bias=cfg.norm_bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed(idx) + self.pos(pos)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# Shapes of published models, for planning on the meta device (no weights involved).
PRESETS: dict[str, GPTConfig] = {
    "llama3-8b": GPTConfig(vocab_size=128256, seq_len=8192, d_model=4096, n_heads=32,
                           n_kv_heads=8, n_layers=32, d_mlp=14336, gated_mlp=True, norm_bias=False),
    "llama3-70b": GPTConfig(vocab_size=128256, seq_len=8192, d_model=8192, n_heads=64,
                            n_kv_heads=8, n_layers=80, d_mlp=28672, gated_mlp=True, norm_bias=False),
    "llama3-405b": GPTConfig(vocab_size=128256, seq_len=8192, d_model=16384, n_heads=128,
                             n_kv_heads=8, n_layers=126, d_mlp=53248, gated_mlp=True, norm_bias=False),
    # ``matrixfsdp bench --preset cpu | gpu``'s models (benchmarks/harness/config.py reads them here)
    "bench-cpu": GPTConfig(vocab_size=256, seq_len=256, d_model=384, n_heads=6, n_layers=8, d_mlp=1536),
    "bench-gpu": GPTConfig(vocab_size=256, seq_len=2048, d_model=2048, n_heads=16, n_layers=16,
                           d_mlp=8192),
    # The MatrixFSDP paper's benchmark: 32 layers, hidden 4096, MLP 16384, 32 heads.
    "paper": GPTConfig(vocab_size=32000, seq_len=1024, d_model=4096, n_heads=32, n_layers=32,
                       d_mlp=16384, norm_bias=False),
}
