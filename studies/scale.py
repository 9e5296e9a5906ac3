"""One rank of a world of any size, in one process: what the library's own code costs that
rank at set-up and per training iteration, where only what grows with P costs anything.

A transformers Llama with Llama 3 405B's structure (126 layers, GQA, an untied head: 1137
parameters in 127 units) at width 64, sharded by ``mf.shard_model`` over a 1-D mesh of a
:mod:`~matrixfsdp.testing.hollow` process group (every collective completes at once, counted
as NCCL would issue it), stepped by ``mf.Muon``. Reports set-up time and peak RSS, the
largest input handed to a gather at set-up, and per iteration (forward, backward, step) its
host time (wall and this process's CPU time), NCCL launches and ops, and the longest list
of tensors handed to one call.

    python -m studies.scale --ranks 16384 [--rank R] [--iterations 3]

prints one JSON line. ``tests/runtime/test_16384_ranks.py`` runs it at P = 64 and P = 16384.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp import testing

LLAMA_405B_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=208, num_hidden_layers=126,
                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                        use_cache=False, tie_word_embeddings=False)


def _peak_rss_gib() -> float:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20 if sys.platform != "darwin" else kib / 2**30


def measure(world_size: int, rank: int, iterations: int = 3, layers: int = 126,
            shard_size: int | None = None) -> dict:
    """Set-up and ``iterations`` training iterations as ``rank`` of ``world_size``; with
    ``shard_size``, on an HSDP mesh of ``world_size // shard_size`` replicas."""
    import transformers  # optional: the test extras'

    testing.register("hollow")
    dist.init_process_group("hollow", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        mesh = (init_device_mesh("cpu", (world_size // shard_size, shard_size),
                                 mesh_dim_names=("replicate", "shard"))
                if shard_size else init_device_mesh("cpu", (world_size,)))
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{**LLAMA_405B_SHAPE, "num_hidden_layers": layers}))
        testing.COUNTS.reset()
        start, cpu = time.perf_counter(), time.process_time()
        mf.shard_model(model, mesh=mesh)
        opt = mf.Muon(mf.muon_param_groups(model, lr=0.02))
        out = {"world_size": world_size, "rank": rank, "parameters": len(list(model.parameters())),
               "units": len(mf.get_root(model).units), "setup_s": time.perf_counter() - start,
               "setup_cpu_s": time.process_time() - cpu, "setup_peak_rss_gib": _peak_rss_gib(),
               "setup_gather_input_bytes": testing.COUNTS.gather_input_bytes,
               "iterations": []}
        x = torch.randint(0, LLAMA_405B_SHAPE["vocab_size"], (1, 16),
                          generator=torch.Generator().manual_seed(0))
        for _ in range(iterations):
            testing.COUNTS.reset()
            start, cpu = time.perf_counter(), time.process_time()
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            out["iterations"].append({
                "host_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
                "launches": sum(testing.COUNTS.launches.values()), "ops": testing.COUNTS.total_ops,
                "ops_by_kind": dict(testing.COUNTS.ops), "longest_list": testing.COUNTS.longest_list})
        out["peak_rss_gib"] = _peak_rss_gib()
        return out
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m studies.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", dest="world_size", type=int, default=16384,
                   help="P, the ranks of the world played (default: 16384; --world-size is "
                        "another name for it)")
    p.add_argument("--world-size", dest="world_size", type=int, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=None, help="the rank played (default: P - 1)")
    p.add_argument("--iterations", type=int, default=3, help="training iterations (default: 3)")
    p.add_argument("--layers", type=int, default=126, help="decoder layers (default: 126, 405B's)")
    p.add_argument("--shard-size", type=int, default=None,
                   help="HSDP: shard groups of this size, P / shard-size replicas (default: "
                        "none, a 1-D mesh)")
    a = p.parse_args(argv)
    rank = a.world_size - 1 if a.rank is None else a.rank
    print(json.dumps(measure(a.world_size, rank, a.iterations, a.layers, a.shard_size)))


if __name__ == "__main__":
    main()
