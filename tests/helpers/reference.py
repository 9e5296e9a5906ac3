"""Single-process reference training with torch's own optimizers."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import nn

from matrixfsdp._compat import torch_muon_newton_schulz
from matrixfsdp.train.models import GPT, GPTConfig


class MHABlock(nn.Module):
    """A block built on torch's own nn.MultiheadAttention (reads in_proj_weight directly)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        # No in_proj_bias: softmax ignores a constant added to the keys, so the key bias's
        # true gradient is 0 and its computed one pure rounding noise, which Adam turns
        # into +-lr steps that no two summation orders agree on.
        self.attn = nn.MultiheadAttention(d, heads, bias=False, batch_first=True)
        self.fc = nn.Linear(d, 2 * d)

    def forward(self, x):
        h = self.norm(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + F.gelu(self.fc(x))[..., : x.shape[-1]]


class MHAModel(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(MHABlock(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        return self.head(x)

    def loss(self, idx, targets):
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(kind: str, cfg: GPTConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(cfg) if kind == "gpt" else MHAModel(cfg)


def linear_decay(step: int) -> float:
    return 1.0 - step / 20


def _ns_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz, with float32 in place of bfloat16 (test only)."""
    a, b, c = ns_coefficients
    x = grad.float().clone()
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        upd = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, upd, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


def reference_ns_fp32():
    """``torch.optim.Muon`` with its Newton-Schulz in float32 while entered (the references'
    NS; torch's runs in bf16 and has no option)."""
    return torch_muon_newton_schulz(_ns_fp32)


BLOCK_LISTS = ("layers", "h")  # the block lists: GPT, MHAModel, Llama, Qwen ("layers"); GPT-2 ("h")


def in_block(name: str) -> bool:
    """Whether ``name`` lies inside a transformer block: it passes through ``<list>.<index>.``
    for one of :data:`BLOCK_LISTS` (``layers.0.fc.weight``, ``model.layers.1.mlp.w``,
    ``transformer.h.0.attn.c_attn.weight``)."""
    parts = name.split(".")
    return any(a in BLOCK_LISTS and b.isdigit() for a, b in zip(parts, parts[1:-1]))


def is_muon_name(name: str, p: torch.Tensor, stacks: bool = False) -> bool:
    """The default MatrixFSDP rule, written independently of the planner (the one copy the
    tests share): 2-D weights inside blocks; with ``stacks``, 3-D expert stacks inside
    blocks too; never a conv weight."""
    if not in_block(name) or ".conv." in name:
        return False
    return p.dim() == 2 or (stacks and p.dim() == 3)


def is_muon_stack_name(name: str, p: torch.Tensor) -> bool:
    """:func:`is_muon_name` with expert stacks (the MoE models' default rule)."""
    return is_muon_name(name, p, stacks=True)


def muon_with_head(name: str, p: torch.Tensor) -> bool:
    """A custom rule (passed as muon_filter): the output head is a Muon matrix too."""
    return is_muon_name(name, p) or name == "head.weight"


def batches(steps: int, world_size: int, per_rank: int, seq: int, seed: int = 1):
    """Global batches; rank r reads rows [r*per_rank, (r+1)*per_rank)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (world_size * per_rank, seq + 1), generator=g)
            for _ in range(steps)]


def rank_slice(x: torch.Tensor, rank: int, per_rank: int, same_data: bool) -> torch.Tensor:
    return x[:per_rank] if same_data else x[rank * per_rank:(rank + 1) * per_rank]


def train_reference(cfg: GPTConfig, data, *, muon_kw: dict, adamw_kw: dict, ns_fp32: bool,
                    schedule=None, kind: str = "gpt", rule=is_muon_name,
                    clip: float | None = None) -> dict[str, torch.Tensor]:
    """torch.optim.Muon + torch.optim.AdamW on one process, over the global batches;
    ``clip``: max_norm for torch.nn.utils.clip_grad_norm_ after each backward."""
    model = build_model(kind, cfg)
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if rule(n, p)], **muon_kw)
    adamw = torch.optim.AdamW([p for n, p in named if not rule(n, p)], **adamw_kw)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (muon, adamw)] \
        if schedule else []
    ctx = reference_ns_fp32() if ns_fp32 else contextlib.nullcontext()
    with ctx:
        for x in data:
            model.loss(x[:, :-1], x[:, 1:]).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            for s in scheds:
                s.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- numeric bounds ------------------------------------------------------------------------
FP32_U = 2.0 ** -24  # fp32 unit roundoff (half an ulp at 1.0)
# PARITY_TOL: how far N ranks may drift from one process when both run fp32 NS. The two
# sum the same numbers in different orders (one process sums the global batch; N ranks sum
# their shards, then the reduce-scatter sums N partials), and another CPU's BLAS (AVX2,
# AVX-512, AMX) blocks every matmul's inner dimension differently again. Each fp32 matmul
# with inner dimension k <= 64 then differs by ~sqrt(k) * FP32_U ~ 5e-7 relative; NS runs 15
# of them (5 iterations x 3), so its output differs by ~15 * 5e-7 ~ 7e-6 relative, and a
# Muon step of size lr * scale <= 0.02 * sqrt(2) moves a parameter by <= 0.03 * 7e-6 ~ 2e-7
# differently. Over the tests' <= 10 steps: ~2e-6. Measured: up to 1e-6 on an Intel CPU
# with AMX (the old bound, just met), 1.19e-6 absolute on an AMD EPYC without AMX (a fresh
# clone; 7.6e-7 of |ours - ref| / (1 + |ref|) in this suite's run there). AdamW (eps >=
# 1e-6) adds ~lr * FP32_U. So 1e-5 (absolute plus relative) is 5x the estimate and 8x the
# largest difference seen, while a
# real bug moves parameters by a Muon step (lr-sized, >= 1e-3 per element) or more: a
# skipped step, a missing gradient average, a wrong owner, a matrix planned twice.
PARITY_TOL = 1e-5


def assert_params_close(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                        tol: float = PARITY_TOL, what: str = "") -> float:
    """``assert_close(rtol=tol, atol=tol)`` for every name in ``ref``, naming the parameter on
    failure; returns the worst ``|ours - ref| / (1 + |ref|)`` (the quantity ``tol`` bounds).
    With ``MF_TEST_DIFFS=<file>`` set, appends the test's id and that worst to the file."""
    worst = 0.0
    for n, p in ref.items():
        a, b = ours[n].detach(), p.detach()
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, n=n: f"{what}{n}: {m}")
        if b.numel():
            worst = max(worst, ((a.float() - b.float()).abs() / (1 + b.float().abs())).max().item())
    log_diff(worst, what)
    return worst


def log_diff(worst: float, what: str = "") -> None:
    """Append the current test's worst difference to ``$MF_TEST_DIFFS`` (if set)."""
    path = os.environ.get("MF_TEST_DIFFS")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            f.write(f"{test} {what} {worst:.3g}\n")


# NS_TOL: how far two fp32 Newton-Schulz runs on the same matrix may differ when their
# matmuls sum in different orders (batched bmm vs one mm per matrix, or another CPU's
# BLAS). Its output's entries are <= 1; 15 matmuls with inner dimension k <= 64 each add
# ~sqrt(k) * FP32_U ~ 5e-7 relative, so ~7e-6 in all. Measured: 1.43e-6 on an AMD EPYC
# (batched vs per-expert). 3e-5 is 4x the estimate; a wrong normalisation or transpose
# moves entries by O(0.1).
NS_TOL = 3e-5
