"""Tensor parallelism composed with the rest of the training stack, at dp 2 x tp 2.

Each case applies a TP plan (torchtitan's Llama plan from tp_models.py, or transformers'
own plan on its LlamaForCausalLM), then ``fully_shard`` over the dp dim, trains 3 steps
with clipping (``mf.clip_grad_norm_``, global over dp x tp), and is compared to one
process running torch.optim.Muon (fp32 NS) + AdamW on the whole batch, to PARITY_TOL
(tests/helpers/reference.py), with zero collectives inside ``optimizer.step()``:

* activation checkpointing with torch's ``checkpoint_wrapper`` on the blocks;
* no-sync micro-batches (``set_requires_gradient_sync(False)`` on the first of two): that
  backward moves no gradient;
* meta-device init (the TP plan applied on meta, then ``mf.init_weights``): the initial
  model is one process's bit for bit, also with a ``Shard(1)`` DTensor that is no Muon
  matrix (an embedding under ColwiseParallel);
* torch.optim.Muon on ``mf.matrix_optimizer`` + AdamW on ``mf.shard_params``: every Muon
  matrix is in exactly one rank's ``matrix_params``, whole;
* bf16 ``MixedPrecisionPolicy`` (fp32 reduce): against FSDP2 + TP with the same policy on
  the same ranks (the same bf16 TP compute; its full gradients stepped by torch.optim.Muon
  + AdamW on whole tensors), to PARITY_TOL; one process in bf16 cannot serve, as the TP
  split sums each RowwiseParallel matmul in two bf16 halves (measured 4.5e-3 from the fp32
  run on both sides, while the two sides agree to 6e-8);
* transformers' LlamaForCausalLM with its own plan (``base_model_tp_plan`` and the
  ``lm_head`` rule, resolved by transformers as ``from_pretrained(tp_plan="auto")`` does,
  applied by its ``apply_tensor_parallelism``: DTensor parameters, Shard(0) / Shard(1)).

And refused: ``torch.compile(model)`` around the whole TP root (or a compiled function
calling it), at the first forward on every rank, before anything is gathered; without TP
the same call compiles and gives one process's logits.

Not here: training with ``torch.compile`` per block (refused under TP: tests/runtime/test_tp.py), and
``from_pretrained(tp_plan="auto")``, which builds a mesh of its own over the whole world
(tp_size=2 on 4 ranks raises "The parallel mesh requires 2 processes"), so it cannot leave
the dp dim to fully_shard.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from helpers.collectives import Collectives
from helpers.parity import ADAMW, MUON, muon_groups
from helpers.rank_pool import spawn
from helpers.reference import assert_params_close, is_muon_name, reference_ns_fp32
from helpers.titan_hf import titan_hf_export
from helpers.tp_models import VOCAB, Llama, apply_tp, build_llama
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.runtime.param import sharded_param

STEPS, PER, SEQ, CLIP = 3, 2, 16, 0.5
BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# checkpoint_wrapper's prefix: matrixfsdp's state dicts keep it in the names (torch's
# state_dict and DCP's get_model_state_dict drop it); compared without it
WRAPPED = "_checkpoint_wrapped_module."


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2 * PER, SEQ + 1), generator=g) for _ in range(STEPS)]


def _build_hf(seed: int = 0):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2,
                                   intermediate_size=64, max_position_embeddings=SEQ + 1,
                                   tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _loss(model, x: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "loss"):
        return model.loss(x[:, :-1], x[:, 1:])
    return model(input_ids=x, labels=x, use_cache=False).loss  # HF shifts the labels itself


def _one_process(model, data, grads=None, after=None):
    """torch.optim.Muon (fp32 NS) on the 2-D weights inside the blocks + AdamW on the rest,
    torch's clipping, on ``model`` over the whole batches. ``grads(model, x)``, if given,
    puts the gradients on ``model`` in place of its own backward; ``after(model)`` runs
    after each step."""
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_muon_name(n, p)], **MUON)
    adamw = torch.optim.AdamW([p for n, p in named if not is_muon_name(n, p)], **ADAMW)
    with reference_ns_fp32():
        for x in data:
            if grads is None:
                _loss(model, x).backward()
            else:
                grads(model, x)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
            if after is not None:
                after(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def _reference(kind: str) -> dict[str, torch.Tensor]:
    return _one_process(_build_hf() if kind == "hf" else build_llama(), _data())


# ---- on the ranks ------------------------------------------------------------------------
def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _shard(model, dp_mesh, **kw):
    for block in model.layers:
        mf.fully_shard(block, mesh=dp_mesh, **kw)
    return mf.fully_shard(model, mesh=dp_mesh, **kw)


def _train(model, opts, dp_rank: int, micro: int = 1) -> tuple[int, int]:
    """3 steps on this dp rank's rows, ``micro`` micro-batches each (all but the last
    without gradient sync, which must then move no gradient); (collectives inside the
    steps, collectives of the first forward)."""
    stats = mf.comm_stats(model)
    counted = Collectives()
    for i, x in enumerate(_data()):
        for k, xm in enumerate(x[dp_rank * PER:(dp_rank + 1) * PER].chunk(micro)):
            sync = k == micro - 1
            if micro > 1:
                model.set_requires_gradient_sync(sync)
            stats.reset()
            with counted.during("forward", i == k == 0):
                loss = _loss(model, xm) / micro
            loss.backward()
            if not sync:  # gathers only: no reduce, no tp gradient hop
                assert set(stats.phase()) == {"gather"}, stats.summary()
                assert "tp_grad_" not in "".join(stats.calls), stats.summary()
        mf.clip_grad_norm_(model.parameters(), CLIP)
        with counted.during("step"):
            for o in opts:
                o.step()
        for o in opts:
            o.zero_grad()
    return counted["step"], counted["forward"]


def _save(out: str, model, counts, **extra) -> None:
    full = {n.replace(WRAPPED, ""): p for n, p in mf.full_state_dict(model).items()}
    if dist.get_rank() == 0:
        torch.save({"params": full, "counts": counts, **extra}, out)


def _colwise_embedding(tp_mesh):
    """A meta Llama whose embedding is a ColwiseParallel (Shard(1)) DTensor and no Muon
    matrix (torch's ColwiseParallel on nn.Embedding, transformers' "embedding_colwise"),
    with one block's MLP tp-split too."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    with torch.device("meta"):
        model = Llama()
    parallelize_module(model, tp_mesh, {"tok_embeddings": ColwiseParallel(output_layouts=Replicate()),
                                        "layers.0.feed_forward.w1": ColwiseParallel(),
                                        "layers.0.feed_forward.w2": RowwiseParallel()})
    return model


def _feature(rank, world, name, out):
    mesh = _mesh()
    dp_rank, micro, extra = mesh["dp"].get_local_rank(), 1, {}
    if name == "meta_init":  # the plan on meta, then fully_shard, then init_weights
        with torch.device("meta"):
            model = apply_tp(Llama(), mesh["tp"])
        # a Shard(1) DTensor parameter on meta first: its init must be the whole tensor's
        other = _shard(_colwise_embedding(mesh["tp"]), mesh["dp"])
        torch.manual_seed(0)
        mf.init_weights(other)
        extra["colwise_init"] = mf.full_state_dict(other)
        _shard(model, mesh["dp"])
        torch.manual_seed(0)
        mf.init_weights(model)
        extra["init"] = mf.full_state_dict(model)
    else:
        model = apply_tp(build_llama(), mesh["tp"])
        if name == "checkpoint_wrapper":  # torchtitan's order: TP, AC, fully_shard
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block)
        micro = 2 if name == "no_sync" else 1
        _shard(model, mesh["dp"])
    if name == "matrix_optimizer":
        mats = mf.matrix_optimizer(torch.optim.Muon, model, **MUON)
        adamw = torch.optim.AdamW(mf.shard_params(model), **ADAMW)
        mf.check_optimizer(adamw)  # its settings compared now, not at its first step
        opts = [mats, adamw]
        # each of the 14 Muon matrices whole in exactly one rank's matrix_params
        mats_here = mf.matrix_params(model)
        assert all(p.numel() == sharded_param(p).placement.spec.numel for p in mats_here)
        count = torch.tensor([len(mats_here)])
        dist.all_reduce(count)
        assert count.item() == 14, count.item()
        with reference_ns_fp32():  # torch's Muon, fp32 NS on the owners too
            counts = _train(model, opts, dp_rank, micro)
    else:
        opt = mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32))
        counts = _train(model, [opt], dp_rank, micro)
        if name == "torch_full_export":
            extra.update(_torch_export(model, opt, mesh))
            extra["titan_hf"] = titan_hf_export(model, os.path.dirname(out), STEPS)
    _save(out, model, counts, **extra)



def _torch_export(model, opt, mesh) -> dict:
    """torch's full export: get_model_state_dict / get_state_dict with full_state_dict (and
    cpu_offload: rank 0 only), every rank's equal to mf.full_state_dict; FSDP2 + TP's, after
    the same training, beside it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    full = StateDictOptions(full_state_dict=True)
    on_0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
    ours = mf.full_state_dict(model)
    everywhere = get_model_state_dict(model, options=full)
    assert all(torch.equal(everywhere[n], t) for n, t in ours.items()), "full_state_dict"
    msd, osd = get_state_dict(model, opt, options=on_0)
    if dist.get_rank():
        assert msd == {} and osd == {}
    else:
        assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in msd.values())
        assert all(torch.equal(msd[n], t) for n, t in ours.items()), "cpu_offload"
        mats = [n for n in ours if n.endswith("wq.weight")]
        assert all(tuple(osd["state"][n]["momentum_buffer"].shape) == tuple(ours[n].shape) for n in mats)
    from torch.distributed.fsdp import MixedPrecisionPolicy
    fsdp2 = _fsdp2_tp(mesh, MixedPrecisionPolicy(), export=True)
    return {"torch_full": msd, "fsdp2_full": fsdp2}


FEATURES = ("checkpoint_wrapper", "no_sync", "meta_init", "matrix_optimizer", "torch_full_export")


@pytest.mark.parametrize("name", FEATURES)
def test_feature_with_tp_matches_one_process(name, tmp_path):
    """dp 2 x tp 2 with one feature on top: within PARITY_TOL of one process after 3
    steps with clipping, no collective in any optimizer step."""
    out = str(tmp_path / "out.pt")
    spawn(_feature, 4, name, out)
    ours = torch.load(out)
    inside, other = ours["counts"]
    assert inside == 0 and other > 0, ours["counts"]
    if name == "meta_init":
        start = build_llama()
        for n, p in start.named_parameters():
            assert torch.equal(ours["init"][n], p), f"init of {n} differs from one process"
        for n, p in build_llama().named_parameters():  # same seed, same one-process model
            assert torch.equal(ours["colwise_init"][n], p), f"Shard(1) meta init: {n} differs"
    assert_params_close(ours["params"], _reference("llama"), what=f"{name}: ")
    if name == "torch_full_export":  # torch's full_state_dict, rank 0's, and FSDP2 + TP's
        assert_params_close(ours["torch_full"], _reference("llama"), what="torch's full export: ")
        assert_params_close(ours["fsdp2_full"], _reference("llama"), what="FSDP2 + TP's full export: ")
        hf = ours["titan_hf"]  # torchtitan's HF export: mf.full_state_dict's values exactly
        assert sorted(hf) == sorted(ours["params"]), sorted(set(hf) ^ set(ours["params"]))
        assert all(torch.equal(hf[n], t) for n, t in ours["params"].items())


# ---- bf16 mixed precision, against FSDP2 + TP ------------------------------------------------
def _fsdp2_tp(mesh, mp, export: bool = False):
    """FSDP2 + TP with policy ``mp``. Each step its full gradients go to a plain replica
    (the same on every rank), stepped as :func:`_one_process` steps, and the replica's new
    values back into the DTensor shards. Returns the replica after 3 steps (``export``:
    torch's ``get_model_state_dict(full_state_dict=True)`` of the FSDP2 + TP model)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    model = apply_tp(build_llama(), mesh["tp"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    dp_rank = mesh["dp"].get_local_rank()

    def grads(replica, x):
        _loss(model, x[dp_rank * PER:(dp_rank + 1) * PER]).backward()
        for p, q in zip(model.parameters(), replica.parameters()):
            q.grad = p.grad.full_tensor()
        model.zero_grad()

    def after(replica):
        with torch.no_grad():
            for p, q in zip(model.parameters(), replica.parameters()):
                p.to_local().copy_(distribute_tensor(q, p.device_mesh, p.placements).to_local())

    replica = _one_process(build_llama(), _data(), grads, after)
    if export:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return replica


def _bf16(rank, world, out):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mesh = _mesh()
    mp = MixedPrecisionPolicy(**BF16)
    model = _shard(apply_tp(build_llama(), mesh["tp"]), mesh["dp"], mp_policy=mp)
    counts = _train(model, [mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32))],
                    mesh["dp"].get_local_rank())
    _save(out, model, counts, fsdp2=_fsdp2_tp(mesh, mp))


def test_bf16_mixed_precision_with_tp_matches_fsdp2_tp(tmp_path):
    """bf16 parameters, fp32 reduce: within PARITY_TOL of FSDP2 + TP under the same
    policy (measured 6e-8), no collective in the step; and both sides are bf16 runs, at
    least 1e-3 from the fp32 one-process run (measured 4.5e-3)."""
    out = str(tmp_path / "out.pt")
    spawn(_bf16, 4, out)
    ours = torch.load(out)
    assert ours["counts"][0] == 0 and ours["counts"][1] > 0, ours["counts"]
    assert_params_close(ours["params"], ours["fsdp2"], what="bf16 vs FSDP2+TP: ")
    fp32 = _reference("llama")
    far = max((ours["params"][n] - p).abs().max().item() for n, p in fp32.items())
    assert far > 1e-3, f"the bf16 run is {far} from the fp32 one: is the policy applied?"


# ---- transformers' own TP plan ----------------------------------------------------------------
def _hf(rank, world, out):
    from torch.distributed.tensor import DTensor, Shard
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    mesh = _mesh()
    model = _build_hf()
    # the plan from_pretrained(tp_plan="auto") applies: the config's base_model_tp_plan with
    # the model's lm_head rule, its wildcards resolved to this model's names
    plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2))
    apply_tensor_parallelism(model, mesh["tp"], plan)
    placements = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    assert placements["model.layers.0.self_attn.q_proj.weight"] == (Shard(0),)
    assert placements["model.layers.0.mlp.down_proj.weight"] == (Shard(1),)
    assert len(placements) == 2 + 7 * 2, sorted(placements)  # embed, lm_head, 7 per layer
    mf.shard_model(model, mesh=mesh["dp"])
    counts = _train(model, [mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32))],
                    mesh["dp"].get_local_rank())
    _save(out, model, counts)


def test_transformers_llama_with_its_tp_plan_matches_one_process(tmp_path):
    """transformers' LlamaForCausalLM, TP-sharded by transformers itself with the model's
    own plan (DTensor parameters on the tp mesh), then mf.shard_model over dp: within
    PARITY_TOL of one process after 3 steps, no collective in the step."""
    pytest.importorskip("transformers")
    out = str(tmp_path / "out.pt")
    spawn(_hf, 4, out)
    ours = torch.load(out)
    assert ours["counts"][0] == 0 and ours["counts"][1] > 0, ours["counts"]
    assert_params_close(ours["params"], _reference("hf"), what="transformers Llama: ")


# ---- torch.compile around the whole root ---------------------------------------------------
def _compiled_root(rank, world):
    x = _data()[0][rank // 2 * PER:(rank // 2 + 1) * PER]  # this dp rank's rows
    # with TP: refused at the first forward, on every rank, before anything moves; the model
    # itself is untouched and trains eagerly afterwards
    mesh = _mesh()
    model = _shard(apply_tp(build_llama(), mesh["tp"]), mesh["dp"])
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(NotImplementedError,
                       match=r"torch.compile around FSDPLlama, the root .* in a model with "
                             r"tensor parallelism: .* wrong gradients .* Train TP models eagerly"):
        compiled(x[:, :-1])
    assert not mf.comm_stats(model).summary(), "a collective ran before the refusal"
    _loss(model, x).backward()
    assert mf.comm_stats(model).summary()
    # a model whose root is its only unit is sharded by its first forward: refused there too
    lonely = mf.fully_shard(apply_tp(build_llama(), mesh["tp"]), mesh=mesh["dp"])
    with pytest.raises(NotImplementedError, match=r"torch.compile around FSDPLlama, the root"):
        torch.compile(lonely, backend="eager")(x[:, :-1])
    # a compiled function calling the TP model: refused the same way
    with pytest.raises(NotImplementedError, match=r"torch.compile around FSDPLlama"):
        torch.compile(lambda t: model(t), backend="eager")(x[:, :-1])
    # without TP, torch.compile(model) works as before: the root falls back to eager at its
    # hooks and its blocks are compiled; the logits are one process's
    dp4 = init_device_mesh("cpu", (4,))
    plain = _shard(build_llama(), dp4)
    logits = torch.compile(plain, backend="eager")(x[:, :-1])
    torch.testing.assert_close(logits, build_llama()(x[:, :-1]), rtol=1e-6, atol=1e-6)
    logits.float().sum().backward()  # backward through the compiled blocks: reduces run


def test_torch_compile_around_a_tp_root_is_refused():
    """``torch.compile(model)`` of a TP model (or a compiled function calling it) raises
    NotImplementedError at its first forward on every rank, naming the root, with nothing
    gathered; the same model without TP compiles and computes one process's logits."""
    spawn(_compiled_root, 4)
