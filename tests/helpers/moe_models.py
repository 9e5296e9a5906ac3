"""The tests' MoE models, experts as 3-D ``(experts, m, n)`` parameters: a hand-written one
(:class:`MoELM`: einsum and bmm over the stacks) and transformers' Qwen2-MoE, with their data
and the reference: torch.optim.Muon on every expert as a 2-D parameter of its own
(runtime/test_moe.py; HSDP's expert case in runtime/test_hsdp.py; the checkpoint chain's
expert stacks in state/test_checkpoint.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helpers.reference import is_muon_stack_name as is_muon_ref
from helpers.reference import reference_ns_fp32

STEPS, PER_RANK, SEQ, VOCAB = 3, 2, 8, 256
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)  # eps: see helpers.parity


# ---- models ------------------------------------------------------------------------------
class MoEBlock(nn.Module):
    """Pre-norm block: a causal grouped conv (3-D weight, stays AdamW) and a top-k MoE whose
    experts are two hand-written 3-D parameters, used through einsum and bmm."""

    def __init__(self, d: int, d_ff: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.norm1 = nn.LayerNorm(d)
        self.conv = nn.Conv1d(d, d, 3, groups=2, padding=2)  # weight (d, d/2, 3)
        self.norm2 = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d_ff, d) / d**0.5)  # (E, out, in)
        self.w_out = nn.Parameter(torch.randn(experts, d, d_ff) / d_ff**0.5)

    def forward(self, x):
        T = x.shape[1]
        x = x + self.conv(self.norm1(x).transpose(1, 2))[..., :T].transpose(1, 2)
        h = self.norm2(x)
        probs = self.router(h).softmax(-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, idx, top)  # (B, T, E), 0 off the top-k
        u = F.gelu(torch.einsum("btd,efd->ebtf", h, self.w_in))  # every expert, every token
        y = torch.bmm(u.flatten(1, 2), self.w_out.mT)  # (E, B*T, d)
        return x + torch.einsum("ebtd,bte->btd", y.view(*u.shape[:3], -1), gates)


class MoELM(nn.Module):
    def __init__(self, d: int = 16, d_ff: int = 24, experts: tuple[int, ...] = (5, 3)):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(MoEBlock(d, d_ff, e, min(2, e)) for e in experts)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         moe_intermediate_size=24, shared_expert_intermediate_size=40,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                         max_position_embeddings=64)
    return Qwen2MoeForCausalLM(cfg)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MoELM() if kind == "hand" else qwen2_moe()


def blocks(model: nn.Module, kind: str):
    return model.layers if kind == "hand" else model.model.layers


def loss_fn(model: nn.Module, kind: str, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1]) if kind == "hand" else model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def global_batches(world_size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (world_size * PER_RANK, SEQ + 1), generator=g)
            for _ in range(STEPS)]


# ---- the reference: torch.optim.Muon on every expert as a 2-D parameter of its own --------
def train_reference(kind: str, data) -> tuple[dict, dict]:
    """One process on the global batches; each expert of a stack is a 2-D ``nn.Parameter``
    aliasing its slice (torch's Muon refuses 3-D), so torch updates the stack in place.
    Returns the parameters and every expert's momentum (name -> (E, m, n))."""
    model = build(kind)
    named = list(model.named_parameters())
    muon, adamw, slices = [], [], {}
    for n, p in named:
        if not is_muon_ref(n, p):
            adamw.append(p)
        elif p.dim() == 2:
            muon.append(p)
        else:
            slices[n] = (p, [nn.Parameter(p.data[e]) for e in range(p.shape[0])])
            muon += slices[n][1]
    opt_m = torch.optim.Muon(muon, **MUON)
    opt_a = torch.optim.AdamW(adamw, **ADAMW)
    with reference_ns_fp32():
        for x in data:
            loss_fn(model, kind, x).backward()
            for p, views in slices.values():
                for e, v in enumerate(views):
                    v.grad = p.grad[e]
            opt_m.step()
            opt_a.step()
            model.zero_grad(set_to_none=True)
    momentum = {n: torch.stack([opt_m.state[v]["momentum_buffer"] for v in views])
                for n, (_, views) in slices.items()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, momentum
