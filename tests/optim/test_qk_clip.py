"""QK-clip (Kimi K2's MuonClip rule) on the owners, against one process implementing the
same rule with the full score matrix: at 2 and 4 ranks with different data per rank (the
maxima are the maxima over every rank's batch) and under HSDP, GQA included, with q/k
scaled up at init so logits exceed tau; no collective inside the optimizer step; and a
transformers Llama through the attention function QKClip registers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.collectives import Collectives
from helpers.parity import ADAMW, MUON, muon_groups
from helpers.rank_pool import spawn
from helpers.reference import PARITY_TOL, assert_params_close, is_muon_name, reference_ns_fp32
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.train.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_mlp=48,
                seq_len=16)
STEPS, GLOBAL, TAU, ALPHA = 3, 8, 18.0, 0.5  # logits 17-22 at init: some heads clip, some not


def _build():
    torch.manual_seed(0)
    model = GPT(CFG)
    with torch.no_grad():  # sharper attention: logits over tau
        for block in model.layers:
            block.attn.q.weight.mul_(4)
            block.attn.k.weight.mul_(4)
    return model


def _data():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, CFG.vocab_size, (GLOBAL, CFG.seq_len + 1), generator=g)
            for _ in range(STEPS)]


def _loss(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def _reference(data):
    """One process, the whole batch, torch's optimizers; the rule written out with the full
    score matrix of every head. Returns the parameters and the clipped heads per step."""
    model = _build()
    H, G = CFG.n_heads, CFG.n_kv_heads
    seen = {}

    def hook(attn, inp, out):
        h = inp[0]
        B, T, _ = h.shape
        q = attn.q(h).view(B, T, H, -1).transpose(1, 2)
        k = attn.k(h).view(B, T, G, -1).transpose(1, 2).repeat_interleave(H // G, dim=1)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        seen[attn] = s.amax(dim=(0, 2, 3)).detach()

    for block in model.layers:
        block.attn.register_forward_hook(hook)
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_muon_name(n, p)], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named if not is_muon_name(n, p)], **ADAMW)
    clipped = []
    with reference_ns_fp32():
        for x in data:
            _loss(model, x).backward()
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            n = 0
            with torch.no_grad():
                for attn, s in seen.items():
                    eta = torch.clamp(TAU / s, max=1.0)
                    hd = attn.q.weight.shape[0] // H
                    for h in range(H):
                        attn.q.weight[h * hd:(h + 1) * hd] *= eta[h] ** ALPHA
                    for g in range(G):
                        shared = eta[g * (H // G):(g + 1) * (H // G)].min()
                        attn.k.weight[g * hd:(g + 1) * hd] *= shared ** (1 - ALPHA)
                    n += int((eta < 1).sum())
            clipped.append(n)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, clipped


def _ours(rank, world, mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    data = _data()
    ref, clipped = _reference(data)
    assert 0 < clipped[0] < CFG.n_layers * CFG.n_heads, clipped  # the rule has work to do
    model = _build()
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    opt = mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32))
    clip = mf.QKClip(model, tau=TAU, alpha=ALPHA, optimizer=opt)
    per = GLOBAL // world
    counted = Collectives()
    for i, x in enumerate(data):
        with counted.during("forward", i == 0):  # gathers, and the heads' maxima reduced
            loss = _loss(model, x[rank * per:(rank + 1) * per])
        loss.backward()
        with counted.during("step"):
            opt.step()  # QK-clip runs in its post-hook
        opt.zero_grad()
    inside, other = counted["step"], counted["forward"]
    assert inside == 0 and other > 0, (inside, other)
    assert len(clip.last_max) == CFG.n_layers
    assert_params_close(mf.full_state_dict(model), ref, tol=PARITY_TOL, what=f"{mesh_shape} ")


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "hsdp-2x2"])
def test_qk_clip_equals_the_rule_on_one_process(mesh_shape):
    """GQA GPT, q/k scaled up so some heads' logits exceed tau: each rank sees its own
    rows of the batch, the per-head maxima are reduced over all ranks in forward, and after
    3 steps of mf.Muon + QKClip every parameter is within 1e-5 of one process applying the
    rule to the whole batch; no collective runs inside optimizer.step()."""
    spawn(_ours, math.prod(mesh_shape), mesh_shape)


def test_max_logits_matches_the_full_score_matrix():
    """The blocked maxima equal the full matrix's, with GQA, causal and a boolean mask."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8)
    full = (q @ k.repeat_interleave(2, dim=1).mT) / math.sqrt(8)
    causal = full.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), -math.inf)
    assert torch.allclose(mf.max_logits(q, k, block=3), causal.amax(dim=(0, 2, 3)))
    mask = torch.rand(2, 1, 10, 10) > 0.5
    mask[..., 0] = True
    expect = full.masked_fill(~mask, -math.inf).amax(dim=(0, 2, 3))
    assert torch.allclose(mf.max_logits(q, k, causal=False, mask=mask, block=4), expect)


def _qwen():
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # q and k (with their biases) sharper: logits over tau
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(22)
    return model


QWEN_TAU = 18.0
BLOCKS = {f"model.layers.{i}.self_attn.{w}_proj.weight": h for i in range(2)
          for w, h in (("q", 4), ("k", 2), ("v", 2))}


def _full_logits_attention(name: str, model) -> dict:
    """Switch transformers ``model`` to an attention function of this test's own that
    records each call's largest logit per q head from the full score matrix (transformers'
    q and k after rotary, k heads repeated for GQA), then runs SDPA; returns the record."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    seen = {}

    def attention(module, query, key, value, attention_mask, **kwargs):
        k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        s = query @ k.transpose(-1, -2) * kwargs["scaling"]
        T = s.shape[-1]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        seen[module] = s.amax(dim=(0, 2, 3)).detach()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    return seen


def _hf_reference(model, data, blocks, after_step):
    """One process: torch.optim.Muon (per head block where ``blocks`` says) + AdamW."""
    from helpers.per_head import per_head_reference
    return per_head_reference(model, data, blocks, after_step=after_step,
                      loss=lambda m, x: m(input_ids=x, labels=x).loss)


def _hf_ours(rank, world, model, ref, tau, **options):
    """``model`` sharded at ``world`` ranks with mf.Muon and QKClip over the same data as
    the reference; some heads (not all) clipped at the first step; within PARITY_TOL."""
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 64, (4, 16), generator=g) for _ in range(STEPS)]
    mf.shard_model(model, mesh=init_device_mesh("cpu", (world,)))
    opt = mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32, **options))
    clip = mf.QKClip(model, tau=tau, alpha=ALPHA, optimizer=opt)
    over = []
    for x in data:
        model(input_ids=x[rank * 2:(rank + 1) * 2], labels=x[rank * 2:(rank + 1) * 2]).loss.backward()
        opt.step()
        opt.zero_grad()
        over.append(sum(int((s > tau).sum()) for s in clip.last_max.values()))
    assert 0 < over[0] < 8, over  # some heads clipped at the first step, not all
    assert_params_close(mf.full_state_dict(model), ref(data), tol=PARITY_TOL,
                        what=f"{type(model).__name__} ")


def _qwen_reference(data):
    """torch.optim.Muon on every head block of q/k/v as its own parameter, the rest whole,
    AdamW elsewhere; the rule by hand on the full score matrix's maxima."""
    model = _qwen()
    seen = _full_logits_attention("test_full_logits", model)

    def after_step():
        with torch.no_grad():
            for attn, s in seen.items():
                eta = torch.clamp(QWEN_TAU / s, max=1.0)
                fq = (eta ** ALPHA).repeat_interleave(attn.head_dim)
                fk = (eta.view(2, 2).amin(1) ** (1 - ALPHA)).repeat_interleave(attn.head_dim)
                for proj, f in ((attn.q_proj, fq), (attn.k_proj, fk)):
                    proj.weight.mul_(f[:, None])
                    proj.bias.mul_(f)
    return _hf_reference(model, data, BLOCKS, after_step)


def _qwen_ours(rank, world):
    _hf_ours(rank, world, _qwen(), _qwen_reference, QWEN_TAU, per_head=True)


def test_transformers_qwen2_per_head_with_qk_clip():
    """transformers Qwen2 (GQA, q/k biases) at 2 ranks: per_head=True finds q/k/v from the
    attention modules, QKClip reports logits through its registered attention function and
    scales weights and biases; equal to one process running torch.optim.Muon per head block
    and the rule on the full score matrix."""
    spawn(_qwen_ours, 2)


def _deepseek():
    import transformers
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        max_position_embeddings=32, use_cache=False, tie_word_embeddings=False)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # sharper attention: logits over tau
        for layer in model.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(MLA_SCALE)
            layer.self_attn.kv_b_proj.weight.mul_(MLA_SCALE)
    return model


MLA_SCALE, MLA_TAU = 12.0, 2.4  # logits 1.8-3.3 at init: 2 of 8 heads over tau


def _mla_reference(data):
    """Whole matrices: torch.optim.Muon + AdamW; Kimi K2's MLA rule by hand on the full
    score matrix's maxima (rope part included)."""
    model = _deepseek()
    seen = _full_logits_attention("test_mla_logits", model)
    nope, rope, v = 8, 4, 8

    def after_step():
        with torch.no_grad():
            for attn, s in seen.items():
                eta = torch.clamp(MLA_TAU / s, max=1.0)[:, None, None]
                q = attn.q_b_proj.weight.view(4, nope + rope, -1)
                q[:, :nope] *= eta ** ALPHA
                q[:, nope:] *= eta
                kv = attn.kv_b_proj.weight.view(4, nope + v, -1)
                kv[:, :nope] *= eta ** (1 - ALPHA)
    return _hf_reference(model, data, {}, after_step)


def _mla_ours(rank, world):
    _hf_ours(rank, world, _deepseek(), _mla_reference, MLA_TAU)


def test_transformers_deepseek_v3_mla_qk_clip():
    """transformers DeepseekV3 (multi-head latent attention, q LoRA) at 2 ranks: QKClip
    scales each clipped head's q no-rope rows by eta^alpha, q rope rows by eta and the kv
    up-projection's k rows by eta^(1 - alpha), the shared rope key untouched (Kimi K2's
    rule); equal to one process applying it by hand to the full score matrix's maxima."""
    spawn(_mla_ours, 2)
