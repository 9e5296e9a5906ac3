"""Pipeline parallelism's run: a rank's stages of one of torch's schedules (stages built as
torchtitan builds them, :mod:`helpers.pp_models`), sharded over the dp ranks by this library
and wrapped in ``mf.pipelining.PipelineStage``, and one process running torch.optim.Muon
(fp32 NS) + AdamW on the whole batch (integrations/test_pipelining.py; the planner's pipeline
counts in advisor/test_plan_model.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import pipelining as tp_pipelining

import matrixfsdp as mf
from helpers.parity import ADAMW, MUON, muon_groups
from helpers.pp_models import build_full, build_stage, loss_fn
from helpers.reference import assert_params_close, reference_ns_fp32
from helpers.tp_models import VOCAB

STEPS, PER, SEQ, CLIP = 2, 8, 8, 0.3  # PER rows per dp rank: divisible by 8 micro-batches
PP, DP = 2, 2

# name: (schedule class, stages per rank, V-shaped placement)
SCHEDULES = {
    "GPipe": (tp_pipelining.ScheduleGPipe, 1, False),
    "1F1B": (tp_pipelining.Schedule1F1B, 1, False),
    "Interleaved1F1B": (tp_pipelining.ScheduleInterleaved1F1B, 2, False),
    "LoopedBFS": (tp_pipelining.ScheduleLoopedBFS, 2, False),
    "InterleavedZeroBubble": (tp_pipelining.ScheduleInterleavedZeroBubble, 2, False),
    "ZBVZeroBubble": (tp_pipelining.ScheduleZBVZeroBubble, 2, True),
    "DualPipeV": (tp_pipelining.ScheduleDualPipeV, 2, True),
}


def is_muon(name: str, p: torch.Tensor) -> bool:
    return name.startswith("layers.") and p.dim() == 2


def pp_data(steps: int = STEPS, dp: int = DP) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (dp * PER, SEQ + 1), generator=g) for _ in range(steps)]


def pp_reference(data, model=None) -> dict[str, torch.Tensor]:
    """One process, the whole batch: the parameters after the last step."""
    model = model or build_full()
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_muon(n, p)], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named if not is_muon(n, p)], **ADAMW)
    with reference_ns_fp32():
        for x in data:
            logits = model(x[:, :-1])
            loss_fn(logits, x[:, 1:]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            for opt in (muon, adamw):
                opt.step()
                opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def stage_ids(pp_rank: int, pp: int, per_rank: int, v_shape: bool) -> list[int]:
    n = pp * per_rank
    if per_rank == 1:
        return [pp_rank]
    return [pp_rank, n - 1 - pp_rank] if v_shape else [pp_rank + k * pp for k in range(per_rank)]


class PipelineRun:
    """One rank's stages of one schedule, sharded over the dp ranks, and their optimizer."""

    def __init__(self, mesh, name: str, n_mb: int, *, scale_grads: bool = True,
                 reshard_after_forward: bool | None = None, stage_cls=None, seed: int = 0,
                 per_part_optimizers: bool = False, unused: bool = True, tp_plan=None,
                 dp_dims: tuple[str, ...] = ("dp",)):
        cls, per_rank, v_shape = SCHEDULES[name]
        pp = mesh["pp"].size()
        self.mesh, self.n_stages = mesh, pp * per_rank
        self.ids = stage_ids(mesh["pp"].get_local_rank(), pp, per_rank, v_shape)
        self.modules = [build_stage(s, self.n_stages, seed) for s in self.ids]
        for m, s in zip(self.modules, self.ids):  # no forward uses it: never stepped, as in torch
            if unused:
                setattr(m, f"unused{s}", nn.Linear(4, 4))
        self.unused = [getattr(m, f"unused{s}").weight.detach().clone() if unused else None
                       for m, s in zip(self.modules, self.ids)]
        for m in self.modules:
            if tp_plan is not None:
                tp_plan(m, mesh["tp"])
            for block in m.layers.values():
                mf.fully_shard(block, mesh=mesh[dp_dims], reshard_after_forward=reshard_after_forward)
            mf.fully_shard(m, mesh=mesh[dp_dims], reshard_after_forward=reshard_after_forward)
        self.dp_mesh = mesh[dp_dims]
        stage_cls = stage_cls or mf.pipelining.PipelineStage
        stages = [stage_cls(m, s, self.n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
                  for m, s in zip(self.modules, self.ids)]
        # one optimizer for every stage on this rank, or one per stage (torchtitan's)
        self.part_opts = [mf.Muon(muon_groups(m, MUON, ADAMW, torch.float32)) for m in self.modules] \
            if per_part_optimizers else []
        self.opts = self.part_opts or [
            mf.Muon([g for m in self.modules for g in muon_groups(m, MUON, ADAMW, torch.float32)])]
        lf = loss_fn if scale_grads else (lambda out, y: loss_fn(out, y) / n_mb)
        self.schedule = cls(stages[0] if per_rank == 1 else stages, n_microbatches=n_mb,
                            loss_fn=lf, scale_grads=scale_grads)

    def step(self, x: torch.Tensor) -> None:
        coord = self.dp_mesh.get_coordinate()  # this rank's rows: its place in the dp dims
        dp = coord[0] * self.dp_mesh.shape[1] + coord[1] if len(coord) == 2 else coord[0]
        x = x[dp * PER:(dp + 1) * PER]
        args = (x[:, :-1],) if 0 in self.ids else ()
        kwargs = dict(target=x[:, 1:], losses=[]) if self.n_stages - 1 in self.ids else {}
        with reference_ns_fp32():
            self.schedule.step(*args, **kwargs)
            # torchtitan's clipping: every stage's parameters, the norm summed over pp
            mf.clip_grad_norm_([p for m in self.modules for p in m.parameters()], CLIP,
                               pp_mesh=self.mesh["pp"])
            for opt in self.opts:
                opt.step()
        for opt in self.opts:
            opt.zero_grad()

    def check(self, ref: dict[str, torch.Tensor], what: str) -> None:
        for m, s, unused in zip(self.modules, self.ids, self.unused):
            full = mf.full_state_dict(m)
            if unused is not None:
                assert torch.equal(full.pop(f"unused{s}.weight"), unused), what
                full.pop(f"unused{s}.bias")
            assert_params_close(full, {n: ref[n] for n in full}, what=what)
