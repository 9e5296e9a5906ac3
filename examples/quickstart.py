"""MatrixFSDP in one script: a transformers Llama (a tiny config, random weights, nothing
downloaded) sharded with whole Muon matrices on owner ranks, trained a few steps with
exact Muon + AdamW, its plan printed, and a checkpoint written that loads at any world size.

    torchrun --nproc-per-node 2 examples/quickstart.py      # CPU: gloo
    torchrun --nproc-per-node 8 examples/quickstart.py      # one GPU per rank: NCCL
"""
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy  # torch's own policy class

import matrixfsdp as mf

cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per rank, before NCCL starts
dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_*
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
mesh = init_device_mesh(device.type, (world,))

torch.manual_seed(0)  # every rank builds the same model
config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, use_cache=False)
model = transformers.LlamaForCausalLM(config).to(device)
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in model.model.layers:
    mf.fully_shard(block, mesh=mesh, mp_policy=mp)  # one communication unit per block
mf.fully_shard(model, mesh=mesh, mp_policy=mp)      # root: embeddings, final norm, head
# or, for any transformers model, in one call: mf.shard_model(model, mesh=mesh, mp_policy=mp)

# Muon (torch.optim.Muon's math) on the blocks' matrices, AdamW on everything else
opt = mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=3e-3))
data = torch.Generator().manual_seed(rank)  # each rank its own batch
x = torch.randint(0, 256, (4, 33), generator=data).to(device)
for step in range(5):
    loss = model(input_ids=x, labels=x).loss  # transformers shifts the labels itself
    loss.backward()
    norm = mf.clip_grad_norm_(model.parameters(), 1.0)  # the global norm (torch's is per rank here)
    opt.step()   # no collective: each owner steps its whole matrices
    opt.zero_grad()
    if rank == 0:
        print(f"step {step + 1}: loss {loss.item():.3f} (rank 0's batch), grad norm {norm.item():.3f}")
if rank == 0:
    print(mf.plan_report(model))  # who owns what, Newton-Schulz balance, bytes

state = mf.get_state_dict(model, opt)  # {"model", "optim"}, by parameter name
dcp.save(state, checkpoint_id="runs/quickstart/step_5")  # each rank writes its own pieces
dist.destroy_process_group()
mf.exit_rank()  # leave without interpreter finalization: design.md, "Leaving a rank"
