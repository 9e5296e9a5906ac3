"""Pipeline parallelism over stages sharded by MatrixFSDP: a (pp, dp) mesh of 2 x 2 ranks,
torchtitan's split of the model into 4 stages (2 per pipeline rank, looped), torch's
ScheduleInterleaved1F1B, Muon on the owners, the whole model's gradient norm clipped.

    torchrun --nproc-per-node 4 examples/pipelining.py      # CPU: gloo
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import ScheduleInterleaved1F1B  # or any other schedule

import matrixfsdp as mf
from matrixfsdp.train.models import GPT, GPTConfig

PP, DP, STAGES_PER_RANK, MICRO_BATCHES = 2, 2, 2, 4
N_STAGES = PP * STAGES_PER_RANK
CFG = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=4, d_mlp=128)


class Stage(nn.Module):
    """torchtitan's split: the full model's own modules for stage ``s`` (its share of the
    layers; the embeddings only on the first stage, norm and head only on the last), so
    every parameter keeps its name in the full model (``layers.2.mlp.fc.weight``)."""

    def __init__(self, full: GPT, s: int):
        super().__init__()
        per = len(full.layers) // N_STAGES
        first, last = s == 0, s == N_STAGES - 1
        self.embed, self.pos = (full.embed, full.pos) if first else (None, None)
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in range(s * per, (s + 1) * per)})
        self.norm, self.head = (full.norm, full.head) if last else (None, None)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.layers.values():
            x = block(x)
        return x if self.head is None else self.head(self.norm(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
pp_rank = mesh["pp"].get_local_rank()
my_stages = [pp_rank + k * PP for k in range(STAGES_PER_RANK)]  # looped: 0, 2 and 1, 3
parts = []
for s in my_stages:
    torch.manual_seed(0)  # the same full model on every rank; each keeps its stage's modules
    parts.append(Stage(GPT(CFG), s))
for part in parts:  # FSDP2's recipe, over the data-parallel ranks of this stage
    for block in part.layers.values():
        mf.fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    mf.fully_shard(part, mesh=mesh["dp"], reshard_after_forward=False)
stages = [mf.pipelining.PipelineStage(part, s, N_STAGES, torch.device("cpu"),
                                      group=mesh["pp"].get_group())
          for part, s in zip(parts, my_stages)]  # torch's class and signature, taught our modules
opt = mf.Muon([g for part in parts for g in mf.muon_param_groups(part, lr=0.02, adamw_lr=3e-3)])
schedule = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)

first, last = 0 in my_stages, N_STAGES - 1 in my_stages
data = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # one batch per dp rank
x = torch.randint(0, 256, (8, 33), generator=data)
for step in range(3):
    losses = []
    if first and last:
        schedule.step(x[:, :-1], target=x[:, 1:], losses=losses)
    elif first:
        schedule.step(x[:, :-1])
    elif last:
        schedule.step(target=x[:, 1:], losses=losses)
    else:
        schedule.step()
    norm = mf.clip_grad_norm_([p for part in parts for p in part.parameters()], 1.0,
                              pp_mesh=mesh["pp"])  # the whole model's norm, on every rank
    opt.step()  # no collective: one reduce per stage happened at the schedule's end
    opt.zero_grad()
    if last:
        print(f"dp rank {mesh['dp'].get_local_rank()} step {step + 1}: loss "
              f"{torch.stack(losses).mean().item():.3f}, grad norm {norm.item():.3f}")
dist.destroy_process_group()
mf.exit_rank()  # leave without interpreter finalization: design.md, "Leaving a rank"
