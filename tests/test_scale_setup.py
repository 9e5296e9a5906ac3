"""Set-up at sixteen thousand ranks exchanges O(1) bytes per rank: one process plays rank
16383 of 16384 on torch's fake process group (every collective completes at once) and
shards a transformers Llama with Llama 3 405B's structure (126 layers, GQA, untied head)
at width 64, then builds ``mf.Muon``. Every "all ranks agree" check (the model, Muon's
settings, the initial values, each rank's own checks) must take its digest path: one
small all-reduce each, the item lists never gathered, nothing handed to a collective over
4 KiB or a list of P tensors.

What each call is handed is recorded by wrapping torch.distributed's collective functions
in that process. (The fake group's all-reduce returns this rank's own values, so the
digests always agree here: the failure paths are tested on 4 gloo ranks in
tests/test_agree.py.) Its own numbers (time, peak RSS) are printed, not asserted; the
bounds on them are tests/test_scale_ranks.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

WORLD = 16384
GATHER_BOUND = 4096  # bytes one rank may hand to any collective at set-up
# torch.distributed's collectives: the position of what this rank sends (an all-gather's
# output is P slots of what every rank sends; only the input is this rank's)
COLLECTIVES = {"all_gather": 1, "all_gather_into_tensor": 1, "all_gather_single": 1, "all_gather_object": 1,
               "all_reduce": 0, "broadcast": 0, "broadcast_object_list": 0, "gather": 0, "scatter": 1,
               "reduce": 0, "reduce_scatter": 1, "reduce_scatter_tensor": 1, "all_to_all": 1,
               "all_to_all_single": 1}


def _play_last_rank(world: int) -> dict:
    """In this process: rank ``world - 1`` of ``world`` sets up the model and Muon; what
    every collective call was handed, and which checks ran and how."""
    import resource
    import time

    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp as mf
    from matrixfsdp.optim import policy
    from matrixfsdp.runtime import agree, checks, lazy_init

    calls: list[tuple[str, int, int]] = []  # (function, bytes sent, longest tensor list handed)

    def size(x) -> tuple[int, int]:
        if torch.is_tensor(x):
            return x.numel() * x.element_size(), 0
        if isinstance(x, (list, tuple)):
            sizes = [size(t) for t in x]
            return sum(s for s, _ in sizes), max([len(x)] + [n for _, n in sizes])
        return 0, 0

    def wrapped(name, fn, sent_at):
        def call(*args, **kwargs):
            handed = list(args) + list(kwargs.values())
            sent = size(args[sent_at] if len(args) > sent_at else handed[sent_at])[0]
            calls.append((name, sent, max(size(a)[1] for a in handed)))
            return fn(*args, **kwargs)
        return call

    dist.init_process_group("fake", store=dist.HashStore(), rank=world - 1, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=208, num_hidden_layers=126,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
        tie_word_embeddings=False))
    for name, sent_at in COLLECTIVES.items():
        if hasattr(dist, name):
            setattr(dist, name, wrapped(name, getattr(dist, name), sent_at))
    ran: list[str] = []  # the checks, and any failure path taken

    def spy(module, name, label=None):
        fn = getattr(module, name)

        def call(*args, **kwargs):
            ran.append(label or name)
            return fn(*args, **kwargs)
        setattr(module, name, call)

    spy(agree, "_first_difference")  # the failure path of every settings comparison
    spy(agree, "every_rank")  # P values: the failure paths of init, coverage and counts
    spy(agree, "every_value")
    spy(lazy_init, "check_same_setup", "model check")
    spy(lazy_init, "check_same_init")
    spy(lazy_init, "agree_on_local_checks")
    spy(policy, "check_same_setup", "optimizer check")
    spy(checks, "broadcast_object")  # a local check's or an idle owner's failure path
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    t0 = time.perf_counter()
    mf.shard_model(model, mesh=mesh)
    mf.Muon(mf.muon_param_groups(model, lr=0.02))
    return {"setup_s": time.perf_counter() - t0, "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            / 2**20, "rss_before_gib": rss0, "calls": calls, "ran": ran,
            "parameters": len(list(model.parameters()))}


@pytest.fixture(scope="module")
def setup_at_16384() -> dict:
    out = subprocess.run([sys.executable, __file__, str(WORLD)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"P={WORLD}: set-up {found['setup_s']:.2f} s, peak RSS {found['rss_gib']:.2f} GiB "
          f"({found['rss_before_gib']:.2f} before)")
    return found


def test_setup_at_16384_ranks_sends_no_collective_more_than_4_kib(setup_at_16384):
    """Nor any list of more than 1024 tensors (before: the model check handed 236 KB to an
    all-gather of 16384 slots, Muon's 48 KB, check_same_init 18 KB: ~140 s and ~16 GB per
    rank)"""
    calls = setup_at_16384["calls"]
    assert setup_at_16384["parameters"] == 1137
    assert calls, "no collective recorded"
    biggest = max(calls, key=lambda c: c[1])
    assert biggest[1] <= GATHER_BOUND, biggest
    assert max(n for _, _, n in calls) <= 1024, [c for c in calls if c[2] > 1024]


def test_every_set_up_check_takes_its_digest_path(setup_at_16384):
    """Each check ran, once, and none took a failure path; the checks' collectives are one
    all-reduce each (the local checks', the model's, the initial values', Muon's)."""
    ran = setup_at_16384["ran"]
    assert ran == ["agree_on_local_checks", "model check", "check_same_init", "optimizer check"], ran
    reduces = [c for c in setup_at_16384["calls"] if c[0] == "all_reduce"]
    assert len(reduces) >= 4, setup_at_16384["calls"]
    assert max(b for _, b, _ in reduces) <= 8 * 8, reduces  # the settings' 4 lanes and their ~


if __name__ == "__main__":
    print(json.dumps(_play_last_rank(int(sys.argv[1]))))
