"""The pieces `matrixfsdp train` composes, in this process on one gloo rank: the model
options (mixed precision, activation checkpointing, the Hugging Face Llama), the
clip/skip decision and the loss plot."""

from __future__ import annotations

import argparse
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers.cli import run_cli
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.train.demo import build_model
from matrixfsdp.train.loop import clip_and_check
from matrixfsdp.train.nonfinite import Checked, Nonfinite, nonfinite_state
from matrixfsdp.train.report import plot_losses


def _args(**kw) -> argparse.Namespace:
    base = dict(model="gpt", d_model=32, heads=2, layers=2, mlp=64, seq=16, seed=0, mp="fp32", debug=False,
                activation_checkpointing=False)
    return argparse.Namespace(**{**base, **kw})


def _build(**kw):
    return build_model(_args(**kw), torch.device("cpu"), init_device_mesh("cpu", (1,)))


def _batch(seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (2, seq + 1), generator=torch.Generator().manual_seed(1))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_recomputes_each_block_with_the_same_gradients(world1):
    plain, plain_loss = _build()
    ckpt, ckpt_loss = _build(activation_checkpointing=True)
    calls = []
    ckpt.layers[0].attn.register_forward_hook(lambda *a: calls.append(1))
    x = _batch()
    a, b = plain_loss(x), ckpt_loss(x)
    assert len(calls) == 1
    a.backward()
    b.backward()
    assert len(calls) == 2  # recomputed in backward
    assert a.item() == b.item()
    ga, gb = _grads(plain), _grads(ckpt)
    assert list(ga) == list(gb) and len(ga) > 0  # names unchanged
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=0, atol=0, msg=n)


def test_mp_bf16_runs_the_blocks_in_bf16(world1):
    model, loss_fn = _build(mp="bf16")
    seen = []
    model.layers[0].attn.q.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    loss = loss_fn(_batch())
    loss.float().backward()
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights


def test_nonfinite_gradients_are_named_before_any_scaling(world1):
    model, loss_fn = _build()
    loss = loss_fn(_batch())
    loss.backward()
    q = model.layers[0].attn.q.weight
    q.grad[0, 0] = math.nan
    before = _grads(model)
    for skip, clip in ((True, 1e-3), (False, 1e-3), (False, None)):  # found with or without skipping
        checked = clip_and_check(model, clip=clip, skip_nonfinite=skip, loss=loss)
        assert checked.nonfinite == Nonfinite([], {"layers.0.attn.q.weight": [0]}), (skip, clip)
        assert checked.loss_sum == loss.item()
        assert checked.nonfinite.describe() == "non-finite gradients: layers.0.attn.q.weight (rank 0)"
        assert (checked.norm is None) == (clip is None and not skip)
        if skip:
            assert not math.isfinite(checked.norm.item())
        after = _grads(model)
        for n in before:  # untouched: the step is skipped or stopped, and nothing was scaled by NaN
            torch.testing.assert_close(after[n], before[n], rtol=0, atol=0, equal_nan=True, msg=n)

    bad_loss = clip_and_check(model, clip=None, skip_nonfinite=False, loss=loss * math.inf).nonfinite
    assert bad_loss.loss_ranks == [0] and bad_loss.ranks == [0]
    assert bad_loss.describe().startswith("the loss is not finite on rank 0; non-finite gradients: ")

    q.grad[0, 0] = 3e38  # finite, but its 2-norm overflows: a false alarm the exact check clears
    assert not math.isfinite(torch.linalg.vector_norm(q.grad.as_subclass(torch.Tensor)).item())
    assert clip_and_check(model, clip=None, skip_nonfinite=False, loss=loss).nonfinite is None
    overflowed = clip_and_check(model, clip=None, skip_nonfinite=True, loss=loss)  # skipped, none named
    assert overflowed.nonfinite == Nonfinite() and overflowed.nonfinite.describe() == \
        "non-finite gradients: none (the norm overflowed)"

    q.grad[0, 0] = 0.0
    checked = clip_and_check(model, clip=1e-3, skip_nonfinite=True)
    assert checked.nonfinite is None and checked.norm.item() > 1e-3 and checked.loss_sum is None
    clipped = torch.linalg.vector_norm(torch.stack([g.norm() for g in _grads(model).values()]))
    assert clipped.item() == pytest.approx(1e-3, rel=1e-3)
    assert clip_and_check(model, clip=None, skip_nonfinite=False) == Checked(None, None, None)


def test_a_nonfinite_state_is_found_before_a_save(world1):
    """The save-time check: a NaN weight and an infinite optimizer moment are named (the
    loop refuses to commit such a state); a finite state passes."""
    model, loss_fn = _build()
    opt = mf.Muon(mf.muon_param_groups(model))
    loss_fn(_batch()).backward()
    opt.step()
    assert nonfinite_state(model, opt) == {}
    with torch.no_grad():
        model.layers[0].mlp.fc.weight[0, 0] = math.nan
    moment = next(iter(opt.state[model.head.weight].items()))
    moment[1].view(-1)[0] = math.inf
    found = nonfinite_state(model, opt)
    assert found == {"layers.0.mlp.fc.weight": [0], f"head.weight optimizer state '{moment[0]}'": [0]}, found


def test_loss_plot_is_skipped_in_one_line_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert plot_losses([3.0, 2.0], tmp_path / "loss.png") is False
    out = capsys.readouterr().out
    assert out == "loss.png skipped: matplotlib is not installed (pip install matplotlib)\n"
    assert not (tmp_path / "loss.png").exists()


def test_hf_llama_keeps_its_names_and_predicts_the_next_byte(world1):
    pytest.importorskip("transformers")
    model, loss_fn = _build(model="hf-llama", activation_checkpointing=True)
    assert "model.layers.0.self_attn.q_proj.weight" in dict(model.named_parameters())
    assert mf.get_root(model.model.layers[0]) is mf.get_root(model)  # mf.shard_model: a unit per layer
    calls = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    x = _batch()
    loss = loss_fn(x)
    loss.backward()
    assert len(calls) == 2  # HF's checkpointing recomputed the layer in backward
    assert all(p.grad is not None for p in model.parameters() if p.numel())
    with torch.no_grad():  # HF shifts labels itself: the targets are x[:, 1:]
        logits = model(input_ids=x[:, :-1]).logits.float()
        ref = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    torch.testing.assert_close(loss.detach().float(), ref)


def test_train_hf_llama_on_two_ranks(tmp_path):
    pytest.importorskip("transformers")
    out = run_cli("train", "--model", "hf-llama", "--ranks", "2", "--steps", "6", "--layers", "2",
                  "--d-model", "32", "--heads", "2", "--mlp", "64", "--seq", "32", "--batch", "2",
                  "--grad-accum", "2", "--activation-checkpointing", "--mp", "bf16", "--clip", "1.0",
                  "--skip-nonfinite", "--per-head", "--qk-clip", "1.0", "--out", str(tmp_path),
                  env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"] == "hf-llama" and summary["skipped_steps"] == []
    # per-head Muon on q/k/v, QK-clip's maxima through transformers' attention interface
    assert summary["per_head"] and len(summary["max_logits"]) == 6
    assert "per-head Muon: 6 matrices in 2 heads" in out.stderr + out.stdout
    assert summary["loss_end"] < summary["loss_start"]


def test_train_tp_matches_the_same_run_without_tp(tmp_path):
    """``--ranks 4 --tp 2`` (2 dp x 2 tp, torchtitan's plan on the GPT's blocks) reads the
    same global batch as ``--ranks 2`` and trains to the same losses (fp32 rounding)."""
    small = ["--steps", "3", "--layers", "1", "--d-model", "32", "--heads", "2", "--mlp", "64",
             "--seq", "16", "--batch", "2"]
    runs = {}
    for name, flags in (("tp", ["--ranks", "4", "--tp", "2"]), ("dp", ["--ranks", "2"])):
        out = run_cli("train", *flags, *small, "--out", str(tmp_path / name),
                      env={"OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-4000:]
        runs[name] = json.loads((tmp_path / name / "summary.json").read_text())
    assert runs["tp"]["tp"] == 2
    for a, b in zip(runs["tp"]["losses"] + [runs["tp"]["val_loss_end"]],
                    runs["dp"]["losses"] + [runs["dp"]["val_loss_end"]]):
        assert abs(a - b) < 1e-5, (runs["tp"]["losses"], runs["dp"]["losses"])
    bad = run_cli("train", "--ranks", "4", "--tp", "3", *small, "--out", str(tmp_path / "bad"))
    assert bad.returncode != 0 and "--tp 3 must divide the ranks 4, --heads 2, --mlp 64" in bad.stderr
