"""A torchtitan trainer's own code, unchanged, on a model sharded here (issue 34), each
against one process (torch.optim.Muon with fp32 NS + AdamW) and beside FSDP2 doing the same
in the same job:

* every compile form FSDP2 accepts: a ``torch.compile(block)`` wrapper registered back into
  ``model.layers`` (a ModuleList, and a ModuleDict as torchtitan's) before ``fully_shard``,
  torchtitan's in-place ``block.compile()`` before it, and both after it; the names torch
  keeps (``_orig_mod.`` in ``named_parameters`` and ``state_dict``) and those its helpers
  give (without it), FSDP2's in both;
* torchtitan's meta-device init: build on meta, ``fully_shard``, ``model.to_empty``, the
  model's own init, then a seed checkpoint through torch's ``set_model_state_dict(
  full_state_dict=True)``.

FSDP2 runs as tests/runtime/test_tp_compose.py runs it: each step its full gradients step a plain
replica with the same optimizers, whose values go back into the DTensor shards.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from helpers.parity import ADAMW, MUON, ODD, muon_groups
from helpers.rank_pool import spawn
from helpers.reference import PARITY_TOL, assert_params_close, batches, rank_slice, train_reference
from helpers.titan_hf import gpt_adapter, titan_hf_export
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.train.models import GPT, GPTConfig

STEPS, PER, SEQ = 3, 2, 16
ORIG = "_orig_mod."


class DictGPT(GPT):
    """GPT with its blocks in a ModuleDict, as torchtitan's Decoder holds them."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(self.layers)})

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed(idx) + self.pos(pos)
        for block in self.layers.values():
            x = block(x)
        return self.head(self.norm(x))


def _blocks(model) -> list[tuple[str, nn.Module]]:
    layers = model.layers
    return list(layers.items()) if isinstance(layers, nn.ModuleDict) else list(enumerate(layers))


def _compile(model, inplace: bool) -> None:
    for key, block in _blocks(model):
        if inplace:
            block.compile(backend="eager")  # torchtitan's apply_compile (fullgraph aside)
        else:
            model.layers[key] = torch.compile(block, backend="eager")  # registered back


def _build(form: str, shard, mesh):
    """Our GPT (or DictGPT), compiled as ``form`` says before or after ``shard``."""
    torch.manual_seed(0)
    model = (DictGPT if form.endswith("dict") else GPT)(GPTConfig(**ODD))
    when, inplace = form.split("_")[0], "inplace" in form
    if when == "before":
        _compile(model, inplace)
    for _, block in _blocks(model):
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    if when == "after":
        _compile(model, inplace)
    return model


def _data(world):
    return batches(STEPS, world, PER, SEQ)


def _fsdp2_run(model, rank, world):
    """FSDP2's gradients step a plain replica (torch's Muon fp32 NS + AdamW); its values go
    back into the shards. Returns the replica's parameters."""
    from helpers.reference import is_muon_name, reference_ns_fp32
    from torch.distributed.tensor import distribute_tensor
    torch.manual_seed(0)
    replica = GPT(GPTConfig(**ODD))
    named = list(replica.named_parameters())
    opts = [torch.optim.Muon([p for n, p in named if is_muon_name(n, p)], **MUON),
            torch.optim.AdamW([p for n, p in named if not is_muon_name(n, p)], **ADAMW)]
    with reference_ns_fp32():
        for x in _data(world):
            x = rank_slice(x, rank, PER, False)
            model.loss(x[:, :-1], x[:, 1:]).backward()
            for p, q in zip(model.parameters(), replica.parameters()):
                q.grad = p.grad.full_tensor()
            model.zero_grad()
            for o in opts:
                o.step()
                o.zero_grad()
            with torch.no_grad():
                for p, q in zip(model.parameters(), replica.parameters()):
                    p.to_local().copy_(distribute_tensor(q, p.device_mesh, p.placements).to_local())
    return {n: p.detach().clone() for n, p in replica.named_parameters()}


def _ours_run(model, rank, world):
    opt = mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32))
    for x in _data(world):
        x = rank_slice(x, rank, PER, False)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()


COMPILE_FORMS = ("before_wrapper", "before_wrapper_dict", "before_inplace", "after_wrapper",
                 "after_inplace")


def _compile_forms(rank, world, out):
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    res = {}
    for form in COMPILE_FORMS:
        torch._dynamo.reset()
        counters.clear()
        ours = _build(form, mf.fully_shard, mesh)
        _ours_run(ours, rank, world)
        graphs = counters["stats"]["unique_graphs"]
        torch_full = get_model_state_dict(ours, options=StateDictOptions(full_state_dict=True))
        theirs = _build(form, fully_shard, mesh)
        res[form] = dict(
            full=mf.full_state_dict(ours), torch_full=torch_full, graphs=graphs,
            names=[n for n, _ in ours.named_parameters()], keys=list(ours.state_dict()),
            fsdp2_names=[n for n, _ in theirs.named_parameters()],
            fsdp2_keys=list(theirs.state_dict()),
            fsdp2_torch_keys=list(get_model_state_dict(theirs)),
            fsdp2=_fsdp2_run(theirs, rank, world))
    if rank == 0:
        torch.save(res, out)


@pytest.fixture(scope="module")
def reference():
    return train_reference(GPTConfig(**ODD), _data(2), muon_kw=MUON, adamw_kw=ADAMW, ns_fp32=True)


def test_every_compile_form_trains_as_one_process(reference, tmp_path):
    """2 ranks, each compile form (eager backend): within PARITY_TOL of one process after 3
    steps, as FSDP2 in the same form; names as FSDP2's (``_orig_mod.`` kept by
    ``named_parameters`` / ``state_dict`` where a wrapper is registered, dropped by torch's
    ``get_model_state_dict``, whose full tensors equal ``mf.full_state_dict``'s)."""
    out = str(tmp_path / "out.pt")
    spawn(_compile_forms, 2, out)
    res = torch.load(out)
    for form, r in res.items():
        assert r["graphs"] >= 1, f"{form}: nothing was compiled"
        assert r["names"] == r["fsdp2_names"], form
        assert r["keys"] == r["fsdp2_keys"], form
        assert sorted(r["torch_full"]) == sorted(r["fsdp2_torch_keys"]) == sorted(reference), form
        assert (ORIG in r["names"][5]) == ("wrapper" in form), (form, r["names"][5])
        full = {n.replace(ORIG, ""): t for n, t in r["full"].items()}
        assert all(torch.equal(full[n], t) for n, t in r["torch_full"].items()), form
        assert_params_close(full, reference, PARITY_TOL, what=f"{form}: ")
        assert_params_close(r["fsdp2"], reference, PARITY_TOL, what=f"FSDP2 {form}: ")


# ---- meta-device init as torchtitan does it ------------------------------------------------
def _own_init(model) -> None:
    """The model's own init, FSDP2's recipe (torchtitan's ``init_weights`` is the same kind:
    element-wise ``nn.init`` calls on each parameter): every module's ``reset_parameters``."""
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()


def _meta_build(shard, mesh):
    with torch.device("meta"):
        model = GPT(GPTConfig(**ODD))
    for block in model.layers:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    _own_init(model)
    return model


def _meta_init(rank, world, seed_dcp, out):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from matrixfsdp.runtime.param import placement_of
    warnings.filterwarnings("ignore", "Initializing zero-element tensors")
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    seed = GPT(GPTConfig(**ODD)).state_dict()  # the seed checkpoint, made on one process
    res = {}
    model = _meta_build(mf.fully_shard, mesh)
    again = _meta_build(mf.fully_shard, mesh)
    shards = {n: p.detach().clone() for n, p in model.named_parameters()}
    res["init_finite"] = all(bool(p.isfinite().all()) for p in shards.values())
    res["init_rerun_equal"] = all(torch.equal(p, q) for p, q in zip(shards.values(), again.parameters()))
    # the distribution: ones and zeros where the init writes them; nn.Linear's kaiming
    # uniform within 1/sqrt(fan_in), fan_in read off the shard (its columns: the full ones)
    bounds = {n: 1 / p.shape[1] ** 0.5 for n, p in shards.items()
              if placement_of(dict(model.named_parameters())[n]).spec.muon}
    res["init_in_bounds"] = all(shards[n].abs().max() <= b if shards[n].numel() else True
                                for n, b in bounds.items())
    res["norm_ones"] = bool((shards["layers.0.norm1.weight"] == 1).all())
    with pytest.raises(ValueError, match=r"float16 .*before fully_shard"):
        model.half()  # refused before anything moves
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.to("cpu")  # onto the shards' own device: a no-op
    set_model_state_dict(model, {k: v.clone() for k, v in seed.items()},
                         options=StateDictOptions(full_state_dict=True))
    _ours_run(model, rank, world)
    res["ours"] = mf.full_state_dict(model)
    # the same seed through DCP (torchtitan's seed checkpoint), into the re-run model
    sd = get_model_state_dict(again)
    dcp.load(sd, checkpoint_id=seed_dcp)
    set_model_state_dict(again, sd)
    _ours_run(again, rank, world)
    res["ours_dcp"] = mf.full_state_dict(again)
    theirs = _meta_build(fully_shard, mesh)
    set_model_state_dict(theirs, {k: v.clone() for k, v in seed.items()},
                         options=StateDictOptions(full_state_dict=True))
    res["fsdp2"] = _fsdp2_run(theirs, rank, world)
    if rank == 0:
        torch.save(res, out)


def test_meta_to_empty_own_init_seed_load_trains_as_one_process(reference, tmp_path):
    """2 ranks, torchtitan's order: meta, fully_shard, to_empty, the model's own init, a
    seed checkpoint through torch's set_model_state_dict(full_state_dict=True) or DCP, 3
    steps: within PARITY_TOL of one process, as FSDP2 in the same script. The own init
    leaves finite values of its distribution, the same on a re-run; ``.half()`` after
    fully_shard is refused before anything moves."""
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(0)
    seed_dcp = str(tmp_path / "seed")
    dcp.save(GPT(GPTConfig(**ODD)).state_dict(), checkpoint_id=seed_dcp, no_dist=True)
    out = str(tmp_path / "out.pt")
    spawn(_meta_init, 2, seed_dcp, out)
    res = torch.load(out)
    assert res["init_finite"] and res["init_rerun_equal"] and res["init_in_bounds"] and res["norm_ones"]
    assert_params_close(res["ours"], reference, PARITY_TOL, what="meta+to_empty+seed: ")
    assert_params_close(res["ours_dcp"], reference, PARITY_TOL, what="meta+to_empty+DCP seed: ")
    assert_params_close(res["fsdp2"], reference, PARITY_TOL, what="FSDP2 meta+to_empty+seed: ")


# ---- Hugging Face export: torchtitan's last_save_in_hf, transformers' save_pretrained ----------
def _hf_export(rank, world, folder, out):
    """torchtitan's CheckpointManager, unchanged, saving the last step in HF format (its
    model's state_dict, the adapter's to_hf, DCP with a HuggingFaceStorageWriter
    consolidating into safetensors); and transformers' save_pretrained of torch's full
    export (get_model_state_dict with full_state_dict and cpu_offload: rank 0's)."""
    import transformers
    mesh = init_device_mesh("cpu", (world,))
    model = _build("before_wrapper", mf.fully_shard, mesh)  # a compiled model, too
    _ours_run(model, rank, world)
    titan_hf_export(model, folder, STEPS)  # the test reads the safetensors itself
    full = mf.full_state_dict(model)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, intermediate_size=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(cfg)
    for block in llama.model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(llama, mesh=mesh)
    exported = get_model_state_dict(llama, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        llama.save_pretrained(os.path.join(folder, "hf"), state_dict=exported)
        torch.save({"full": full, "llama": mf.full_state_dict(llama)}, out)
    else:
        mf.full_state_dict(llama)


def test_hf_export_loads_back_into_the_plain_model(reference, tmp_path):
    """2 ranks: torchtitan's last_save_in_hf export of a trained (compiled) model loads back,
    through the adapter's from_hf, into the plain GPT, equal to mf.full_state_dict and
    within PARITY_TOL of one process; a transformers Llama exported through torch's
    get_model_state_dict(full_state_dict, cpu_offload) and save_pretrained loads back
    with from_pretrained, equal."""
    import transformers
    from safetensors.torch import load_file
    out = str(tmp_path / "out.pt")
    spawn(_hf_export, 2, str(tmp_path), out)
    res = torch.load(out)
    files = glob.glob(str(tmp_path / "titan" / "step-*" / "*.safetensors"))
    hf = {k: v for f in files for k, v in load_file(f).items()}
    assert "model.layers.0._orig_mod.attn.q.weight" in hf and "lm_head.weight" in hf, sorted(hf)[:4]
    plain = GPT(GPTConfig(**ODD))
    plain.load_state_dict({k.replace(ORIG, ""): v for k, v in gpt_adapter().from_hf(hf).items()})
    full = {k.replace(ORIG, ""): v for k, v in res["full"].items()}
    assert all(torch.equal(p, full[n]) for n, p in plain.named_parameters())
    assert_params_close(dict(plain.named_parameters()), reference, what="HF export: ")
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert all(torch.equal(p, res["llama"][n]) for n, p in back.named_parameters())


def _unmatched(rank, world, out):
    from types import SimpleNamespace

    from helpers import titan_cpu
    titan_cpu.import_torchtitan()
    from matrixfsdp.integrations.torchtitan_optim import unmatched_anywhere
    groups = [SimpleNamespace(pattern=p) for p in ("embeddings", "layers", "nowhere")]
    mine = {0: [groups[0], groups[1]], 1: [groups[1]]}[rank]  # a first and a later pipeline stage
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(repr(unmatched_anywhere(groups, set(map(id, mine)))))


def test_a_pattern_matched_on_another_pipeline_rank_is_no_error_anywhere(tmp_path):
    """torchtitan's "pattern matched no parameters" error, for the whole model: a pattern the
    first pipeline stage's parts match (the embeddings) is no error on a later stage's rank,
    and one no rank matches is named on every rank alike (before: raised on the later
    stage's rank only, while the others went on to wait)."""
    spawn(_unmatched, 2, str(tmp_path))
    got = {(tmp_path / f"rank{r}.txt").read_text() for r in range(2)}
    assert got == {"['nowhere']"}, got
