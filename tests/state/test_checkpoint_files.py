"""Plain files into and out of a sharded model: a sharded run starts from an unsharded
safetensors / torch.save checkpoint with each rank reading only its rows (peak memory measured),
and a Hugging Face checkpoint written from a sharded model loads with from_pretrained."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from helpers.rank_pool import spawn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.runtime.param import placement_of
from matrixfsdp.train.models import GPT, GPTConfig

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# ~12.7M parameters (51 MB fp32): large enough that a rank's shard (about half) and one
# tensor (the largest is 4 MiB) stand out of the RSS noise.
BIG = dict(vocab_size=256, seq_len=64, d_model=512, n_heads=8, n_layers=4, d_mlp=2048)
LLAMA = dict(vocab_size=256, hidden_size=40, intermediate_size=56, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
             tie_word_embeddings=True)
MIB = 2 ** 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _load_measured(path: str, world: int) -> dict:
    """A GPT built on meta, sharded, filled from ``path``: peak RSS over the load."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**BIG))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    mf.get_root(model)  # plans: this rank's shards allocated, not yet written
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    before = _status("VmRSS")
    mf.load_full_checkpoint(model, path)
    peak = _status("VmHWM") - before
    return dict(model=model, shard=shard, peak=peak)


def _worker(rank, world, tmp):
    torch.manual_seed(0)
    largest = max(p.numel() * 4 for p in GPT(GPTConfig(**BIG)).parameters())
    out = {"largest": largest}
    for kind in ("safetensors", "torch"):
        r = _load_measured(os.path.join(tmp, f"big.{kind}"), world)
        model = r.pop("model")
        full = safetensors_torch.load_file(os.path.join(tmp, "big.safetensors"))
        for p in model.parameters():  # each shard holds exactly its rows of the file
            pl = placement_of(p)
            a, b = pl.row_ranges[rank]
            assert torch.equal(p.detach(), full[pl.spec.name][a:b]), (kind, pl.spec.name)
        out[kind] = r
        model(torch.zeros(1, 8, dtype=torch.long))  # built on meta, initialised by the load
        del model, full
    # Hugging Face: from a save_pretrained directory (tied head) into a sharded Llama with other
    # weights, one training step, then save_pretrained from the sharded model
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    mf.shard_model(model, mesh=init_device_mesh("cpu", (world,)))
    mf.load_full_checkpoint(model, os.path.join(tmp, "hf_in"))
    out["loaded"] = mf.full_state_dict(model)
    opt = mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=3e-3))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    mf.save_pretrained(model, os.path.join(tmp, "hf_out"))
    out["trained"] = mf.full_state_dict(model)
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))


def test_load_unsharded_files_and_save_pretrained(tmp_path):
    """2 ranks. safetensors (safe_open + get_slice) and torch.save (torch.load(mmap=True)) files of
    the unsharded model fill a meta-built sharded model with exactly the file's rows; peak RSS
    over the load stays near the rank's shard (measured, reported). A tiny Llama (tied head)
    loads from save_pretrained's directory, trains a step, and mf.save_pretrained writes a
    directory that from_pretrained loads in this plain process, bit for bit."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    big = GPT(GPTConfig(**BIG))
    sd = big.state_dict()
    safetensors_torch.save_file(sd, str(tmp_path / "big.safetensors"))
    torch.save(sd, tmp_path / "big.torch")
    del big, sd
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    hf.save_pretrained(tmp_path / "hf_in")
    spawn(_worker, 2, str(tmp_path))

    outs = [torch.load(tmp_path / f"out{r}.pt", weights_only=False) for r in range(2)]
    for rank, out in enumerate(outs):
        for kind in ("safetensors", "torch"):
            r = out[kind]
            print(f"\nrank {rank} {kind}: shard {r['shard'] / MIB:.1f} MiB, peak RSS over the load "
                  f"+{r['peak'] / MIB:.1f} MiB (largest tensor {out['largest'] / MIB:.1f} MiB)")
            # safetensors maps one tensor at a time: shard + about one tensor (its rows read, a copy)
            # torch.load(mmap=True) keeps the file mapped: the pages of this rank's rows stay resident
            limit = r["shard"] + 2 * out["largest"] + 8 * MIB if kind == "safetensors" \
                else 2 * r["shard"] + 2 * out["largest"] + 8 * MIB
            assert r["peak"] < limit, (rank, kind, r, limit)
    expected = hf.state_dict()
    loaded = outs[0]["loaded"]
    assert loaded.keys() == expected.keys()
    for n, t in expected.items():
        assert torch.equal(loaded[n], t), n
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_out")
    trained = outs[0]["trained"]
    changed = 0
    for n, t in back.state_dict().items():
        assert torch.equal(t, trained[n]), n
        changed += not torch.equal(t, expected[n])
    assert changed > len(expected) // 2, "the step changed the weights that were saved"
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()


def _unwritable(rank, world, tmp):
    blocker = os.path.join(tmp, "a_file")  # a file where the checkpoint's parent should be
    message = "no error"
    for async_save in (False, True):
        try:
            mf.save_checkpoint({"x": torch.zeros(2)}, os.path.join(blocker, "step_1"),
                               async_save=async_save)
        except RuntimeError as e:
            message = str(e)
        with open(os.path.join(tmp, f"rank{rank}_{async_save}.txt"), "w") as f:
            f.write(message)
    torch.distributed.barrier()  # still in step: nobody was left in a collective


def test_a_checkpoint_directory_rank_0_cannot_create_fails_on_every_rank(tmp_path):
    """Rank 0 creates the directory; when it cannot, every rank raises the same error
    (before: rank 0 raised, the others went on into the save's collectives and crashed on a
    closed connection)."""
    (tmp_path / "a_file").write_text("")
    spawn(_unwritable, 2, str(tmp_path), timeout=120)
    for rank in range(2):
        for async_save in (False, True):
            message = (tmp_path / f"rank{rank}_{async_save}.txt").read_text()
            assert "matrixfsdp.save_checkpoint: cannot write" in message and "a_file" in message, message
            assert message == (tmp_path / f"rank0_{async_save}.txt").read_text()  # the same on every rank
