"""dp x tp training of the tests' Llama (:mod:`helpers.tp_models`: torchtitan's TP plan),
then ``fully_shard`` over the dp dim, against one process running torch.optim.Muon (fp32 NS)
+ AdamW with torch's clipping on the whole batch (runtime/test_tp.py, and the grouped
path's TP case in runtime/test_nccl_path.py)."""

from __future__ import annotations

import torch

import matrixfsdp as mf
from helpers.collectives import Collectives
from helpers.parity import ADAMW, MUON, muon_groups
from helpers.reference import reference_ns_fp32
from helpers.tp_models import VOCAB, build_llama

STEPS, PER, SEQ, CLIP = 3, 2, 16, 0.5


def is_muon(name: str, p: torch.Tensor) -> bool:
    return name.startswith("layers.") and p.dim() == 2


def tp_data(dp: int, steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (dp * PER, SEQ + 1), generator=g) for _ in range(steps)]


def tp_reference(data, save_at: int | None = None):
    """One process: torch.optim.Muon (fp32 NS) + AdamW, torch's clipping; the parameters
    after every step."""
    model = build_llama()
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_muon(n, p)], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named if not is_muon(n, p)], **ADAMW)
    after = []
    with reference_ns_fp32():
        for x in data:
            model.loss(x[:, :-1], x[:, 1:]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return after


def tp_shard(model, dp_mesh):
    for block in model.layers:
        mf.fully_shard(block, mesh=dp_mesh)
    return mf.fully_shard(model, mesh=dp_mesh)


def tp_optimizer(model):
    return mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32))


def tp_train(model, opt, data, dp_rank, counted: Collectives):
    """Steps over ``data``, this dp rank's rows; collectives counted in the steps and in the
    first forward (``counted["step"]``, ``counted["forward"]``)."""
    for x in data:
        x = x[dp_rank * PER:(dp_rank + 1) * PER]
        with counted.during("forward", not counted["forward"]):
            loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        mf.clip_grad_norm_(model.parameters(), CLIP)
        with counted.during("step"):
            opt.step()
        opt.zero_grad()
