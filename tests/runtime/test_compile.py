"""torch.compile on blocks after fully_shard, the FSDP2 way: ``block.compile(backend=...)``
per block. The compiled model trains like the uncompiled one, the unit hooks stay outside
the compiled code (one graph for all blocks, no graph break, no recompilation) and the
optimizer step issues no collective. See docs/compile.md."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers.collectives import Collectives
from helpers.rank_pool import spawn
from helpers.reference import PARITY_TOL, assert_params_close, batches, rank_slice
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import matrixfsdp as mf
from matrixfsdp.train.models import GPT, GPTConfig

STEPS, PER_RANK, SEQ = 3, 2, 16
CFG = dict(vocab_size=256, d_model=35, n_heads=5, n_layers=2, d_mlp=55, seq_len=17)
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_eps=1e-6, adamw_weight_decay=0.01)


def _build(mesh, recipe: str | None, backend: str, mp):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh, mp_policy=mp)
    mf.fully_shard(model, mesh=mesh, mp_policy=mp)
    for block in model.layers:
        if recipe == "module":  # compiles the module's __call__: hooks and forward
            block.compile(backend=backend)
        elif recipe == "forward":  # compiles the forward alone: hooks run around it
            block.forward = torch.compile(block.forward, backend=backend)
    opt = mf.Muon(mf.muon_param_groups(model, **MUON, ns_dtype=torch.float32, **ADAMW))
    return model, opt


def _step(model, opt, x, counted: Collectives, counting: bool, first: bool = False) -> None:
    with counted.during("forward", counting and first):
        logits = model(x[:, :-1])
    F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
    with counted.during("step", counting):
        opt.step()
    opt.zero_grad()


def _worker(rank, world_size, case, out_path):
    import torch._inductor.config
    from torch._dynamo.utils import counters

    # Inductor compiles its C++ kernels in this process: by default each rank would start a
    # pool of compile workers (fresh interpreters importing torch, 6 per rank here), some 4
    # CPU s per run on a machine whose 2 cores the ranks already fill.
    torch._inductor.config.compile_threads = 1

    mesh = init_device_mesh("cpu", (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if case.get("mp") else None
    data = [rank_slice(x, rank, PER_RANK, False) for x in batches(STEPS, world_size, PER_RANK, SEQ)]
    plain, plain_opt = _build(mesh, None, case["backend"], mp)
    for x in data:
        _step(plain, plain_opt, x, Collectives(), counting=False)
    model, opt = _build(mesh, case["recipe"], case["backend"], mp)
    counters.clear()
    counted = Collectives()
    for i, x in enumerate(data):
        _step(model, opt, x, counted, counting=True, first=i == 0)
    step_collectives, other_collectives = counted["step"], counted["forward"]
    dynamo = {"graphs": counters["stats"]["unique_graphs"],
              "breaks": sum(counters["graph_break"].values()),
              "frames": counters["frames"]["total"]}
    ours, ref = mf.full_state_dict(model), mf.full_state_dict(plain)
    if rank == 0:
        torch.save({"ours": ours, "ref": ref, "dynamo": dynamo, "step": step_collectives,
                    "other": other_collectives}, out_path)


# Tolerances against the same run uncompiled. eager and aot_eager run the very ATen ops of
# eager mode (measured: bit-identical, bf16 policy included); inductor generates its own
# fused C++ kernels (layer norm, softmax, GELU, their backward) with other summation orders
# and vectorised math: measured 4.2e-7 after 3 to 5 steps. Both within PARITY_TOL, the
# bound for another summation order of the same fp32 math (reference.py).
CASES = {
    "eager": (dict(recipe="module", backend="eager"), PARITY_TOL),
    "aot_eager_bf16": (dict(recipe="module", backend="aot_eager", mp=True), PARITY_TOL),
    "inductor": (dict(recipe="module", backend="inductor"), PARITY_TOL),
    "forward_only_eager": (dict(recipe="forward", backend="eager"), PARITY_TOL),
}


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_blocks_train_like_eager(name, tmp_path):
    """2 ranks, different data, fp32 NS: 3 steps of the compiled model against 3 steps of
    the same model uncompiled; one compiled graph serves both blocks in every step."""
    case, tol = CASES[name]
    torch.set_num_threads(1)
    out = os.path.join(tmp_path, "out.pt")
    spawn(_worker, 2, case, out)
    res = torch.load(out)
    assert res["step"] == 0, "optimizer.step() issued collectives"
    assert res["other"] > 0, "the profiler saw no collective at all"
    # The hooks never reach Dynamo: the block's forward is its only frame, traced into one
    # graph (shared by both blocks: the parameters are graph inputs), with no break and no
    # recompilation over the steps, whichever way the block is compiled.
    assert res["dynamo"] == {"graphs": 1, "breaks": 0, "frames": 1}, res["dynamo"]
    assert list(res["ours"]) == list(res["ref"]), "parameter names changed under compile"
    assert_params_close(res["ours"], res["ref"], tol)


def test_a_forward_inside_a_cuda_graph_capture_is_refused_naming_the_unit(world1, monkeypatch):
    """CUDA graphs replay fixed addresses; a unit's parameters are allocated at each gather.
    A forward while the device's stream captures raises naming the unit and the compile
    modes to use (CPU has no capture: CUDA's probe, ``is_current_stream_capturing``, is
    stood in for on the CPU module); without a capture the same model runs."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp as mf
    from matrixfsdp.train.models import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_mlp=32, seq_len=8))
    mesh = init_device_mesh("cpu", (1,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    x = torch.randint(0, 64, (2, 8))
    monkeypatch.setattr(torch.cpu, "is_current_stream_capturing", lambda: True, raising=False)
    with pytest.raises(RuntimeError, match=r"unit '<root>' ran inside a CUDA graph capture.*"
                                           r"max-autotune-no-cudagraphs"):
        model(x)
    monkeypatch.setattr(torch.cpu, "is_current_stream_capturing", lambda: False)
    model(x).sum().backward()
