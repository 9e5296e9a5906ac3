"""The model of ``matrixfsdp bench --ep`` (:mod:`.ep`), also tests/helpers/ep_models.py's: a small MoE
with torchtitan's GroupedExperts shapes, expert parallelism for it, and the bench's config.

Experts hold ``w1 (E, H, D)``, ``w2 (E, D, H)``, ``w3 (E, H, D)``; :func:`apply_ep` makes them
DTensors ``Shard(0)`` over the ``ep`` mesh (torchtitan's ``ExpertParallel._partition_fn``),
and the forward computes on ``.to_local()`` (as GroupedExperts does). Routing is dense
("soft" MoE: every token to every expert, weighted by the router's probabilities), so the
dispatch over ep is an all-gather of the tokens and a reduce-scatter of the outputs, with
autograd (torch's functional collectives): the layout of the experts, which is what the
runtime handles, is exactly torchtitan's; only the token dispatch is simpler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from matrixfsdp._compat import functional_collectives as funcol

SYSTEMS = ("matrixfsdp", "fsdp2_ep")


@dataclass(frozen=True)
class MoEConfig:
    d_model: int = 16
    hidden: int = 24  # each expert's SwiGLU width
    experts: int = 4
    vocab: int = 64
    layers: int = 2


class GroupedExperts(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        E, H, D = c.experts, c.hidden, c.d_model
        self.w1 = nn.Parameter(torch.randn(E, H, D) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, H) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, H, D) * D ** -0.5)
        self.ep_group = None  # set by apply_ep

    def forward(self, x, probs):
        """``x`` (T, D) tokens, ``probs`` (T, E_local): the sum over this rank's experts."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1, self.w2, self.w3))
        h = F.silu(torch.einsum("td,ehd->eth", x, w1)) * torch.einsum("td,ehd->eth", x, w3)
        out = torch.einsum("eth,edh->etd", h, w2)
        return torch.einsum("etd,te->td", out, probs)


class MoE(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.config = c
        self.router = nn.Linear(c.d_model, c.experts, bias=False)
        self.experts = GroupedExperts(c)

    def forward(self, x):
        b, t, D = x.shape
        x = x.reshape(b * t, D)
        probs = self.router(x).softmax(-1)
        g = self.experts.ep_group
        if g is None:
            return self.experts(x, probs).view(b, t, D)
        ep, k = dist.get_world_size(g), dist.get_rank(g)
        local = self.config.experts // ep
        xs = _waited(funcol.all_gather_tensor_autograd(x, 0, g))  # every ep rank's tokens
        ps = _waited(funcol.all_gather_tensor_autograd(probs, 0, g))[:, k * local:(k + 1) * local]
        out = self.experts(xs, ps)  # this rank's experts on all of them
        mine = _waited(funcol.reduce_scatter_tensor_autograd(out, "sum", 0, g))  # over experts
        return mine.view(b, t, D)


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (einsum reads it through views)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class Block(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.norm = nn.RMSNorm(c.d_model)
        self.attn = nn.Linear(c.d_model, c.d_model, bias=False)  # a dense matrix per block
        self.moe = MoE(c)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.moe(self.norm(x))


class MoEModel(nn.Module):
    """Embedding, blocks of (a dense matrix, an MoE of GroupedExperts), head."""

    def __init__(self, c: MoEConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        return self.head(x)

    def loss(self, idx, targets):
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, self.config.vocab), targets.reshape(-1))


def build_moe(seed: int = 0, config: MoEConfig | None = None) -> MoEModel:
    torch.manual_seed(seed)
    return MoEModel(config or MoEConfig())


def apply_ep(model: MoEModel, ep_mesh) -> MoEModel:
    """Every block's experts: DTensors ``Shard(0)`` over ``ep_mesh`` (this rank keeps
    ``experts / ep`` of them), as torchtitan's ExpertParallel partitions GroupedExperts."""
    for block in model.layers:
        experts = block.moe.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(
                name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)])))
        experts.ep_group = ep_mesh.get_group()
    return model


@dataclass
class EPBenchConfig:
    """Everything a run of ``matrixfsdp bench --ep`` depends on; saved into ``ep.json``."""

    grids: list[tuple[int, int]] = field(default_factory=lambda: [(2, 2), (4, 2)])  # (d, ep)
    model: MoEConfig = field(default_factory=lambda: MoEConfig(
        d_model=128, hidden=256, experts=8, vocab=512, layers=4))
    seq: int = 64
    batch: int = 2  # sequences per data-parallel rank (of dp x ep) per step
    warmup: int = 1
    seed: int = 0
    out: str = "runs/bench_ep"
    timeout: float = 600.0  # process-group timeout, seconds
