"""Per-head Muon's reference: torch.optim.Muon over each attention head's row block as a
parameter of its own, on one process (optim/test_per_head.py, optim/test_qk_clip.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helpers.parity import ADAMW, MUON
from helpers.reference import is_muon_name, reference_ns_fp32


def lm_loss(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))


def per_head_reference(model: nn.Module, data, blocks: dict[str, int], *, after_step=None,
               loss=None) -> dict[str, torch.Tensor]:
    """torch.optim.Muon over each head block as a parameter of its own (the rest whole),
    torch.optim.AdamW over everything else; one process, fp32 NS. ``after_step``: called
    after each step (optim/test_qk_clip.py's rule)."""
    loss = loss or lm_loss
    named = dict(model.named_parameters())
    split = {n: [nn.Parameter(b.clone()) for b in named[n].detach().chunk(h)]
             for n, h in blocks.items()}
    whole = [p for n, p in named.items() if is_muon_name(n, p) and n not in split]
    muon = torch.optim.Muon(whole + [b for bs in split.values() for b in bs], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named.items() if not is_muon_name(n, p)], **ADAMW)
    with reference_ns_fp32(), torch.no_grad():
        for x in data:
            with torch.enable_grad():
                loss(model, x).backward()
            for n, bs in split.items():
                for b, g in zip(bs, named[n].grad.chunk(len(bs))):
                    b.grad = g.clone()
            muon.step()
            adamw.step()
            for n, bs in split.items():
                named[n].copy_(torch.cat([b.detach() for b in bs]))
            for opt in (muon, adamw):
                opt.zero_grad()
            model.zero_grad()
            if after_step is not None:
                after_step()
                for n, bs in split.items():  # the blocks follow what the rule changed
                    for b, w in zip(bs, named[n].detach().chunk(len(bs))):
                        b.copy_(w)
    return {n: p.detach().clone() for n, p in named.items()}
