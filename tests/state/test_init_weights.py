"""init_weights: a model built on the meta device and sharded equals, bit for bit, the same
model initialised on one process from the same seed, at 1-4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.rank_pool import spawn
from helpers.reference import MHAModel
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import matrixfsdp as mf
from matrixfsdp.train.models import GPT, GPTConfig

# Row counts divisible by none of 2, 3, 4: uneven row splits everywhere.
ODD = dict(vocab_size=257, d_model=35, n_heads=5, n_layers=2, d_mlp=55, seq_len=17)
ODD_GATED = dict(ODD, gated_mlp=True, mlp_bias=True, fused_qkv=True, n_kv_heads=1, norm_bias=False)
LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
SEED = 1234


def _shard(model: nn.Module, blocks, mesh) -> nn.Module:
    for block in blocks:
        mf.fully_shard(block, mesh=mesh)
    return mf.fully_shard(model, mesh=mesh)


def _assert_same(model: nn.Module, ref: nn.Module, what: str) -> None:
    """Parameters through full_state_dict (gathered), buffers as every rank holds them."""
    full = mf.full_state_dict(model)
    expected = dict(ref.named_parameters())
    assert [n for n in full if n in expected] == list(expected), what
    bad = [n for n, t in expected.items() if not torch.equal(full[n], t)]
    buffers = dict(model.named_buffers())
    assert list(buffers) == [n for n, _ in ref.named_buffers()], what
    bad += [n for n, t in ref.named_buffers() if not torch.equal(buffers[n], t)]
    assert not bad, f"{what}: {bad} differ from the single-process init"


def _gpt_checks(mesh, kind: str, cfg: GPTConfig) -> None:
    torch.manual_seed(SEED)
    ref = GPT(cfg) if kind == "gpt" else MHAModel(cfg)
    with torch.device("meta"):
        model = GPT(cfg) if kind == "gpt" else MHAModel(cfg)
    _shard(model, model.layers, mesh)
    torch.manual_seed(SEED)
    mf.init_weights(model)
    assert not any(u.needs_init for u in mf.get_root(model).units)
    _assert_same(model, ref, f"{kind} {cfg}")
    if kind == "gpt":
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
        assert torch.equal(model(x), ref(x)), "logits differ"


def _reset(m: nn.Module) -> None:
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()


def _tied_checks(mesh) -> None:
    """Tied embedding and head (one shard registered at two places): each init writes it,
    the last one wins, as in the same loop on one process with the tie in place."""
    cfg = GPTConfig(**ODD)
    ref = GPT(cfg)
    ref.head.weight = ref.embed.weight
    torch.manual_seed(SEED)
    for m in ref.modules():
        _reset(m)
    with torch.device("meta"):
        model = GPT(cfg)
    model.head.weight = model.embed.weight
    _shard(model, model.layers, mesh)
    torch.manual_seed(SEED)
    mf.init_weights(model, _reset)
    assert model.head.weight is model.embed.weight
    _assert_same(model, ref, "tied")
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(x), ref(x)), "logits differ (tied)"


def _hf_checks(mesh, tie: bool) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**LLAMA, tie_word_embeddings=tie)
    x = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))

    def build():
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        assert model.model.rotary_emb.inv_freq.is_meta
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
        return _shard(model, model.model.layers, mesh)

    # Default: the order from_config uses, so the result equals from_config's (with a tie:
    # lm_head's init is drawn and dropped, the embedding's values stay, as tie_weights does).
    torch.manual_seed(SEED)
    ref = AutoModelForCausalLM.from_config(cfg)
    model = build()
    torch.manual_seed(SEED)
    mf.init_weights(model)
    _assert_same(model, ref, f"from_config order, tie={tie}")  # rotary buffers included
    assert torch.equal(model(x).logits, ref(x).logits), "logits differ (from_config order)"

    # init_fn=model._init_weights: model.modules() order.
    ref = LlamaForCausalLM(cfg)
    torch.manual_seed(SEED + 1)
    for m in ref.modules():
        ref._init_weights(m)
    model = build()
    torch.manual_seed(SEED + 1)
    mf.init_weights(model, init_fn=model._init_weights)
    _assert_same(model, ref, f"_init_weights in modules() order, tie={tie}")
    assert torch.equal(model(x).logits, ref(x).logits), "logits differ (_init_weights)"


def _moe_checks(mesh) -> None:
    """Expert stacks (E, m, n), spread over the ranks by whole experts (4 experts: uneven at
    3 ranks): Qwen2-MoE from meta equals from_config."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    cfg = Qwen2MoeConfig(**{k: v for k, v in LLAMA.items() if k != "intermediate_size"},
                         intermediate_size=48, moe_intermediate_size=24,
                         shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                         tie_word_embeddings=False)
    torch.manual_seed(SEED)
    ref = AutoModelForCausalLM.from_config(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    mf.shard_model(model, mesh=mesh)
    assert any(pl.spec.is_experts for pl in mf.plan_of(model).placements.values())
    torch.manual_seed(SEED)
    mf.init_weights(model)
    _assert_same(model, ref, "Qwen2-MoE from_config order")


def _checks(mesh) -> None:
    _gpt_checks(mesh, "gpt", GPTConfig(**ODD))
    _gpt_checks(mesh, "gpt", GPTConfig(**ODD_GATED))
    _gpt_checks(mesh, "mha", GPTConfig(vocab_size=61, d_model=24, n_heads=4, n_layers=2, seq_len=17))
    _tied_checks(mesh)
    _hf_checks(mesh, tie=False)
    _hf_checks(mesh, tie=True)
    _moe_checks(mesh)


def _worker(rank: int, world_size: int) -> None:
    """Every world size from 2 to ``world_size`` in one launch: a mesh over ranks [0, n)
    for each n (the other ranks wait), so the ranks import torch and transformers once."""
    torch.set_num_threads(1)
    for n in range(2, world_size + 1):
        mesh = DeviceMesh("cpu", list(range(n)))  # every rank takes part in creating it
        if rank < n:
            _checks(mesh)
        dist.barrier()


def test_equals_single_process_init_one_rank(world1):
    _checks(init_device_mesh("cpu", (1,)))


def test_equals_single_process_init_two_to_four_ranks():
    spawn(_worker, 4)


# ---- errors (one rank) -------------------------------------------------------------------
class Scale(nn.Module):
    """A parameter of its own and no reset_parameters."""

    def __init__(self, n: int):
        super().__init__()
        self.g = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.g


class WithBuffer(nn.Linear):
    def __init__(self, n: int):
        super().__init__(n, n)
        self.register_buffer("scale", torch.ones(n))  # reset_parameters leaves it alone


def _meta_sharded(make) -> nn.Module:
    with torch.device("meta"):
        model = make()
    mesh = init_device_mesh("cpu", (1,))
    for m in model:
        mf.fully_shard(m, mesh=mesh)
    return mf.fully_shard(model, mesh=mesh)


def test_forward_refused_until_initialised(world1):
    model = _meta_sharded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3)))
    with pytest.raises(RuntimeError, match="init_weights"):
        model(torch.ones(2, 4))
    mf.init_weights(model)
    assert model(torch.ones(2, 4)).shape == (2, 3)


def test_module_without_reset_parameters(world1):
    model = _meta_sharded(lambda: nn.Sequential(nn.Linear(4, 4), Scale(4)))
    with pytest.raises(ValueError, match=r"not initialised: 1\.g"):
        mf.init_weights(model)
    assert any(u.needs_init for u in mf.get_root(model).units)

    def init_fn(m):
        if isinstance(m, Scale):
            nn.init.ones_(m.g)
        elif isinstance(m, nn.Linear):
            m.reset_parameters()

    mf.init_weights(model, init_fn)
    assert torch.equal(model[1].g, torch.ones(4))


def test_partial_write_or_read(world1):
    model = _meta_sharded(lambda: nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="only part of parameter '0.weight'"):
        mf.init_weights(model, lambda m: m.weight[:1].zero_() if isinstance(m, nn.Linear) else None)
    with pytest.raises(ValueError, match="read its previous value"):  # NaN * 2 is NaN
        mf.init_weights(model, lambda m: m.weight.mul_(2) if isinstance(m, nn.Linear) else None)


def test_write_to_another_modules_parameter(world1):
    model = _meta_sharded(lambda: nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4)))

    def init_fn(m):
        if isinstance(m, nn.Sequential) and len(m) == 1:  # the parent writes its child's weight
            m[0].weight.normal_()

    with pytest.raises(NotImplementedError, match="another module"):
        mf.init_weights(model, init_fn)


def test_meta_buffer_left_unset(world1):
    model = _meta_sharded(lambda: nn.Sequential(WithBuffer(4)))
    with pytest.raises(ValueError, match="0.scale are still on the meta device"):
        mf.init_weights(model)

    def init_fn(m):
        if isinstance(m, WithBuffer):
            m.reset_parameters()
            m.scale.fill_(2.0)

    mf.init_weights(model, init_fn)
    assert torch.equal(model[0].scale, torch.full((4,), 2.0))


def test_needs_the_root(world1):
    model = _meta_sharded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="root module"):
        mf.init_weights(model[0])
