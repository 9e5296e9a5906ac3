"""What FSDP2 users do beyond the plain loop, each exact against torch on one process:
tied weights, frozen parameters, activation checkpointing, a block called several times,
two forwards before one backward, several backward passes before one step."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers.rank_pool import spawn
from helpers.reference import assert_params_close, batches, rank_slice, reference_ns_fp32
from helpers.reference import is_muon_name as is_muon
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import matrixfsdp as mf
from matrixfsdp.train.models import GPT, GPTConfig

STEPS, PER_RANK, SEQ = 4, 2, 16
CFG = dict(vocab_size=256, d_model=35, n_heads=5, n_layers=2, d_mlp=55, seq_len=17)
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)
FROZEN = ("embed.weight", "layers.0.attn.q.weight", "layers.1.norm1.bias")


class FeatureGPT(GPT):
    """The demo GPT with the habits under test: each block may run ``repeat`` times
    (weight sharing through reuse) and under torch's activation checkpointing."""

    def __init__(self, cfg: GPTConfig, ckpt: str | None = None, repeat: int = 1):
        super().__init__(cfg)
        self.ckpt, self.repeat = ckpt, repeat
        if ckpt and ckpt.startswith("inside_"):
            # transformers' way: the block's own forward is checkpointed, so module hooks
            # stay outside and the recompute runs in backward without them.
            for block in self.layers:
                block.forward = _checkpointed(block.forward, ckpt == "inside_reentrant")

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed(idx) + self.pos(pos)
        for block in self.layers:
            for _ in range(self.repeat):
                if self.ckpt is None or self.ckpt.startswith("inside_"):
                    x = block(x)
                else:
                    x = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
        return self.head(self.norm(x))


def _checkpointed(forward, reentrant: bool):
    def run(*args):
        return checkpoint(forward, *args, use_reentrant=reentrant)
    return run


def build(case, seed=0):
    torch.manual_seed(seed)
    model = FeatureGPT(GPTConfig(**CFG), ckpt=case.get("ckpt"), repeat=case.get("repeat", 1))
    if case.get("tie"):
        model.head.weight = model.embed.weight
    for name, p in model.named_parameters():
        if name in case.get("frozen", ()):
            p.requires_grad_(False)
    return model


def loss_fn(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def backward(model, x, how):
    """One step's forward/backward on batch ``x``, in the way named by ``how``."""
    if how == "plain":
        loss_fn(model, x).backward()
    elif how == "two_forwards":  # two forwards, then one backward through both
        a, b = x.chunk(2)
        (0.5 * (loss_fn(model, a) + loss_fn(model, b))).backward()
    elif how == "two_backwards":  # the same graph backpropagated twice
        loss = loss_fn(model, x)
        loss.backward(retain_graph=True)
        loss.backward()
    elif how == "separate_losses":  # two losses of one forward, backpropagated separately
        logits = model(x[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        ce.backward(retain_graph=True)
        (1e-3 * logits.float().pow(2).mean()).backward()
    else:
        raise ValueError(how)


def _worker(rank, world_size, case, out_path):
    model = build(case)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh, reshard_after_forward=case.get("reshard"))
    mf.fully_shard(model, mesh=mesh)
    opt = mf.Muon(mf.muon_param_groups(model, **MUON, ns_dtype=torch.float32,
                                       adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"],
                                       adamw_eps=ADAMW["eps"],
                                       adamw_weight_decay=ADAMW["weight_decay"]))
    stats = mf.comm_stats(model)
    # Frozen parameters do not travel in the gradient reduce (as in FSDP2): its payload is
    # the trainable parameters alone, each counted once (tied ones once): whole matrices as
    # they are, row-sharded ones padded to world_size chunks of ceil(rows / world_size) rows,
    # and one flag per trainable parameter in every rank's chunk (which ranks had a gradient);
    # plus the 64-byte alignment gaps between matrices reduced together to one owner (under
    # 16 elements each, far less than any frozen matrix).
    plan = mf.plan_of(model).placements
    named = [(n, p) for n, p in build(case).named_parameters() if p.requires_grad]
    trainable = sum(p.numel() if plan[n].spec.muon else
                    -(-p.shape[0] // world_size) * world_size * p[0].numel()
                    for n, p in named) + world_size * len(named)
    gaps = 4 * 16 * sum(1 for n, _ in named if plan[n].spec.muon)
    for x in batches(STEPS, world_size, PER_RANK, SEQ):
        stats.reset()
        backward(model, rank_slice(x, rank, PER_RANK, False), case.get("how", "plain"))
        if case.get("how", "plain") == "plain":
            moved = stats.phase()["reduce"]
            assert 4 * trainable <= moved < 4 * trainable + gaps, (moved, 4 * trainable)
        for p in model.parameters():
            if not p.requires_grad:
                assert p.grad is None, "a frozen parameter got a gradient"
        opt.step()
        opt.zero_grad()
    frozen_state = [k for p in model.parameters() if not p.requires_grad for k in opt.state.get(p, {})]
    assert not frozen_state, "a frozen parameter got optimizer state"
    state = mf.full_state_dict(model)
    if rank == 0:
        torch.save(state, out_path)


def reference(case, world_size):
    model = build(case)
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_muon(n, p)], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named if not is_muon(n, p)], **ADAMW)
    with reference_ns_fp32():
        for x in batches(STEPS, world_size, PER_RANK, SEQ):
            backward(model, x, case.get("how", "plain"))
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


CASES = {
    "tied_head": (dict(tie=True), 3),
    "frozen": (dict(frozen=FROZEN), 2),
    "ckpt_nonreentrant": (dict(ckpt="nonreentrant"), 2),
    "ckpt_reentrant": (dict(ckpt="reentrant"), 2),
    "ckpt_reentrant_no_reshard": (dict(ckpt="reentrant", reshard=False), 3),
    "ckpt_nonreentrant_no_reshard": (dict(ckpt="nonreentrant", reshard=False), 3),
    "ckpt_inside_nonreentrant": (dict(ckpt="inside_nonreentrant"), 2),
    "ckpt_inside_reentrant": (dict(ckpt="inside_reentrant"), 3),
    "ckpt_inside_no_reshard": (dict(ckpt="inside_nonreentrant", reshard=False), 2),
    "block_called_twice": (dict(repeat=2), 2),
    "two_forwards_one_backward": (dict(how="two_forwards"), 2),
    "two_backward_passes": (dict(how="two_backwards"), 2),
    "separate_losses": (dict(how="separate_losses", tie=True), 4),
    # 8 ranks, more than the 6 matrices of a block: tied head, frozen parameters, a block
    # reused and checkpointed, together.
    "all_at_8_ranks": (dict(tie=True, frozen=FROZEN[1:], repeat=2, ckpt="inside_nonreentrant"), 8),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch(name, tmp_path):
    """fp32 NS on both sides, different data per rank: within PARITY_TOL of torch.optim.Muon +
    torch.optim.AdamW on one process over the global batch (as in test_parity)."""
    case, world_size = CASES[name]
    torch.set_num_threads(1)
    out = os.path.join(tmp_path, "out.pt")
    spawn(_worker, world_size, case, out)
    ours, ref = torch.load(out), reference(case, world_size)
    assert list(ours) == list(ref), "names differ from the plain model's"
    assert_params_close(ours, ref)
    if case.get("frozen"):
        init = dict(build(case).named_parameters())
        for n in case["frozen"]:
            assert torch.equal(ours[n], init[n]), f"frozen {n} changed"
    if case.get("tie"):
        assert torch.equal(ours["head.weight"], ours["embed.weight"])
