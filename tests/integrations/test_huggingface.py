"""Hugging Face transformers models (code nobody here wrote), from tiny configs with random
init (nothing downloaded), sharded with ``mf.shard_model`` and trained exactly like
torch.optim.Muon + torch.optim.AdamW on one process."""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
from helpers.collectives import Collectives
from helpers.rank_pool import spawn
from helpers.reference import assert_params_close, batches, rank_slice, reference_ns_fp32
from helpers.reference import is_muon_name as is_muon
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import matrixfsdp as mf
from matrixfsdp.runtime.param import placement_of

transformers = pytest.importorskip("transformers")

STEPS, PER_RANK, SEQ = 4, 2, 16
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
# eps 1e-5: Adam's update has slope up to 1/eps at g ~ 0, and rows of the embedding that a
# batch barely touches have ~1e-8 gradients whose summation-order rounding eps = 1e-6
# still turned into 2e-6 (measured). See helpers.parity's ADAMW comment.
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.01)
# Sizes divisible by neither 2 nor 3 where the architecture allows (heads * head_dim).
SMALL = dict(vocab_size=256, hidden_size=40, intermediate_size=56, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             use_cache=False)


def build(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg)
    if kind == "llama_tied":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=True))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=False))
    if kind == "gpt2":  # ties lm_head to wte; Conv1D weights (in, out)
        cfg = transformers.GPT2Config(vocab_size=256, n_embd=40, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        return transformers.GPT2LMHeadModel(cfg)
    raise ValueError(kind)


def loss_of(model, x):
    return model(input_ids=x, labels=x).loss  # transformers shifts the labels itself


def _worker(rank, world_size, case, out_path):
    model = build(case["kind"])
    if case.get("ckpt"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": case["ckpt"] == "reentrant"})
    mesh = init_device_mesh("cpu", (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if case.get("bf16") else None
    mf.shard_model(model, mesh=mesh, mp_policy=mp)
    ns_dtype = torch.bfloat16 if case.get("bf16") else torch.float32
    opt = mf.Muon(mf.muon_param_groups(model, **MUON, ns_dtype=ns_dtype, adamw_lr=ADAMW["lr"],
                                       adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
                                       adamw_weight_decay=ADAMW["weight_decay"]))
    muon_names = sorted(placement_of(p).spec.name for g in opt.param_groups if g["use_muon"]
                        for p in g["params"])
    counted = Collectives()
    for i, x in enumerate(batches(STEPS, world_size, PER_RANK, SEQ)):
        with counted.during("forward", i == 0):
            loss = loss_of(model, rank_slice(x, rank, PER_RANK, case.get("same_data", False)))
        loss.backward()
        with counted.during("step"):
            opt.step()
        opt.zero_grad()
    inside = counted["step"]
    assert counted["forward"] > 0, "the profiler saw no collective in a forward"
    state = mf.full_state_dict(model)
    if rank == 0:
        torch.save({"params": state, "muon": muon_names, "step_collectives": inside}, out_path)


def reference(case, world_size):
    model = build(case["kind"])
    low = model
    if case.get("bf16"):  # parameters in bf16; buffers (rotary inv_freq) stay fp32, as in FSDP2
        low = copy.deepcopy(model)
        for p in low.parameters():
            p.data = p.data.to(torch.bfloat16)
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_muon(n, p)], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named if not is_muon(n, p)], **ADAMW)
    with contextlib.nullcontext() if case.get("bf16") else reference_ns_fp32():
        for x in batches(STEPS, world_size, PER_RANK, SEQ):
            x = x[:PER_RANK] if case.get("same_data") else x
            if low is not model:  # bf16 copy of the fp32 masters computes the gradients
                with torch.no_grad():
                    for p32, p16 in zip(model.parameters(), low.parameters()):
                        p16.copy_(p32)
            loss_of(low, x).backward()
            if low is not model:
                for p32, p16 in zip(model.parameters(), low.parameters()):
                    p32.grad, p16.grad = p16.grad.float(), None
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
    return model, {n: p.detach() for n, p in model.state_dict().items()}


CASES = {
    "llama": (dict(kind="llama"), 3),
    "qwen2": (dict(kind="qwen2"), 2),
    "gpt2_tied": (dict(kind="gpt2"), 2),
    "llama_tied_ckpt_reentrant": (dict(kind="llama_tied", ckpt="reentrant"), 2),
    "llama_ckpt": (dict(kind="llama", ckpt="nonreentrant"), 4),
    "llama_bf16_same_data": (dict(kind="llama", bf16=True, same_data=True), 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_model_matches_torch(name, tmp_path):
    """fp32 NS, different data per rank: within PARITY_TOL of one process (as test_parity);
    bf16 policy with equal data on 2 ranks: bit-identical. Every name of the plain model's
    state_dict (tied head included) is in full_state_dict and loads into the plain model."""
    case, world_size = CASES[name]
    torch.set_num_threads(1)
    out = os.path.join(tmp_path, "out.pt")
    spawn(_worker, world_size, case, out)
    ours = torch.load(out)
    plain, ref = reference(case, world_size)
    assert ours["step_collectives"] == 0
    assert ours["muon"] == sorted(n for n, p in plain.named_parameters() if is_muon(n, p))
    assert set(ours["params"]) == set(ref), set(ours["params"]) ^ set(ref)
    if case.get("bf16"):  # equal data on every rank: the same sums, bit for bit
        for n, p in ref.items():
            assert torch.equal(ours["params"][n], p), f"{n}: {(ours['params'][n] - p).abs().max()}"
    else:
        assert_params_close(ours["params"], ref)
    build(case["kind"], seed=1).load_state_dict(ours["params"])  # strict: loads into plain torch
