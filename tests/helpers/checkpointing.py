"""The checkpoint tests' run: the parity tests' odd-shaped GPT sharded over N ranks with
mf.Muon (Muon + AdamW) and a linear-decay schedule, trained on rows of one global batch
(state/test_checkpoint.py, state/test_async_save.py, state/test_torch_state_dict.py), and
torch.optim.Muon (fp32 NS) + AdamW on one process over the same global batches, its full
state snapshotted by name."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from helpers.parity import ADAMW, MUON, ODD
from helpers.reference import batches, build_model, is_muon_name, linear_decay, reference_ns_fp32
from matrixfsdp.train.models import GPTConfig

SEQ = 16
GLOBAL = 12  # sequences per step, divisible by 4, 2 and 3: every world size sees the same batch
PHASES = [(4, 3), (2, 3), (3, 2)]  # (world size, steps): save at 4, load at 2, save, load at 3
ALL_STEPS = sum(n for _, n in PHASES) + 1  # one more step after the chain, at 1 rank / in torch


def tie_and_freeze(model):
    """The head tied to the embedding, the position embedding frozen."""
    model.head.weight = model.embed.weight
    model.pos.weight.requires_grad_(False)
    return model


def build_sharded(world, *, mp=None, ns_dtype=torch.float32, seed=0, adamw=ADAMW, tweak=None):
    """(model, optimizer, schedule) on a 1-D mesh of ``world`` ranks; ``tweak`` changes the
    model before it is sharded (:func:`tie_and_freeze`)."""
    model = build_model("gpt", GPTConfig(**ODD), seed=seed)
    if tweak is not None:
        model = tweak(model)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh, mp_policy=mp)
    mf.fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = mf.Muon(mf.muon_param_groups(model, **MUON, ns_dtype=ns_dtype, adamw_lr=adamw["lr"],
                                       adamw_betas=adamw["betas"], adamw_eps=adamw["eps"],
                                       adamw_weight_decay=adamw["weight_decay"]))
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, linear_decay)


def checkpoint_state(model, opt, sched):
    """What a checkpoint holds: ``mf.get_state_dict`` and the schedule's state."""
    return {**mf.get_state_dict(model, opt), "sched": sched.state_dict()}


def load_state(model, opt, sched, path):
    """The checkpoint at ``path`` (dcp.load) into the model, optimizer and schedule."""
    state = checkpoint_state(model, opt, sched)
    dcp.load(state, checkpoint_id=str(path))
    mf.set_state_dict(model, opt, state)
    sched.load_state_dict(state["sched"])


def train_steps(model, opt, sched, data, steps, rank, world):
    """The steps ``steps`` of ``data`` (global batches of GLOBAL rows), on this rank's rows."""
    per_rank = GLOBAL // world
    for i in steps:
        x = data[i][rank * per_rank:(rank + 1) * per_rank]
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def reference_snapshots(snapshot_after):
    """torch.optim.Muon (fp32 NS) + AdamW on one process over the global batches; full state
    by name after each step count in ``snapshot_after``."""
    model = build_model("gpt", GPTConfig(**ODD))
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_muon_name(n, p)], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named if not is_muon_name(n, p)], **ADAMW)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, linear_decay) for o in (muon, adamw)]
    snaps = {}
    with reference_ns_fp32():
        for i, x in enumerate(batches(ALL_STEPS, 1, GLOBAL, SEQ)):
            model.loss(x[:, :-1], x[:, 1:]).backward()
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
            for s in scheds:
                s.step()
            if i + 1 in snapshot_after:
                snaps[i + 1] = dict(
                    model={n: p.detach().clone() for n, p in named},
                    state={n: {k: v.clone() for k, v in o.state[p].items()} for n, p in named
                           for o in (muon, adamw) if p in o.state},
                    lr=[g["lr"] for g in muon.param_groups + adamw.param_groups])
    return snaps
