"""Sixteen thousand ranks, proven in one process: the library's own code as rank 16383 of
16384, against the same at 64 ranks.

One subprocess (a fresh default group each time) runs ``studies.scale``'s
measurement at P = 16384, then at P = 64: one rank of P on a process group that completes
every collective at once and counts what NCCL would be asked (:mod:`matrixfsdp.testing.hollow`:
NCCL's coalescing, so the runtime takes its NCCL path), for a transformers Llama with Llama 3
405B's structure (126 layers, GQA, untied head) at width 64, where only what grows with P
costs anything; then HSDP (shard groups of 8) at 2048 replicas against 8, at 8 layers.
During the set-up at 16384 it also records, by wrapping torch.distributed's
collective functions and the set-up checks, what each call was handed and which path each
"all ranks agree" check took. (The group answers as if every rank held this rank's values,
so the checks always agree here: their failure paths are tested on 4 gloo ranks in
tests/diagnosis/test_agree.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

BIG, SMALL = 16384, 64
HSDP_SHARD = 8  # HSDP: 2048 replicas of 8 shard ranks against 8 of 8
GATHER_BOUND = 4096  # bytes one rank may hand to any collective at set-up
# torch.distributed's collectives: the position of what this rank sends (an all-gather's
# output is P slots of what every rank sends; only the input is this rank's)
COLLECTIVES = {"all_gather": 1, "all_gather_into_tensor": 1, "all_gather_single": 1, "all_gather_object": 1,
               "all_reduce": 0, "broadcast": 0, "broadcast_object_list": 0, "gather": 0, "scatter": 1,
               "reduce": 0, "reduce_scatter": 1, "reduce_scatter_tensor": 1, "all_to_all": 1,
               "all_to_all_single": 1}


def _play() -> dict:
    """In this process: P = 16384 with the set-up recorded, then P = 64."""
    import torch
    import torch.distributed as dist

    import matrixfsdp as mf
    from matrixfsdp.diagnosis import agree
    from matrixfsdp.optim import policy
    from matrixfsdp.runtime import checks, lazy_init
    from studies import scale

    calls: list[tuple[str, int, int]] = []  # (function, bytes sent, longest tensor list handed)
    ran: list[str] = []  # the set-up checks, and any failure path taken
    recording = [True]

    def size(x) -> tuple[int, int]:
        if torch.is_tensor(x):
            return x.numel() * x.element_size(), 0
        if isinstance(x, (list, tuple)):
            sizes = [size(t) for t in x]
            return sum(s for s, _ in sizes), max([len(x)] + [n for _, n in sizes])
        return 0, 0

    def wrapped(name, fn, sent_at):
        def call(*args, **kwargs):
            if recording[0]:
                handed = list(args) + list(kwargs.values())
                sent = size(args[sent_at] if len(args) > sent_at else handed[sent_at])[0]
                calls.append((name, sent, max(size(a)[1] for a in handed)))
            return fn(*args, **kwargs)
        return call

    for name, sent_at in COLLECTIVES.items():
        if hasattr(dist, name):
            setattr(dist, name, wrapped(name, getattr(dist, name), sent_at))

    def spy(module, name, label=None):
        fn = getattr(module, name)

        def call(*args, **kwargs):
            if recording[0]:
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
    muon = mf.Muon

    def built(*args, **kwargs):  # the set-up ends with the optimizer: stop recording there
        opt = muon(*args, **kwargs)
        recording[0] = False
        return opt
    mf.Muon = built
    big = scale.measure(BIG, BIG - 1, iterations=3)
    mf.Muon = muon
    small = scale.measure(SMALL, SMALL - 1, iterations=3)
    hsdp = {P: scale.measure(P, P - 1, iterations=4, layers=8, shard_size=HSDP_SHARD)
            for P in (BIG, SMALL)}
    return {"big": big, "small": small, "calls": calls, "ran": ran,
            "hsdp_big": hsdp[BIG], "hsdp_small": hsdp[SMALL]}


@pytest.fixture(scope="module")
def runs() -> dict:
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_setup_at_16384_ranks_is_fast_small_and_exchanges_o1_bytes(runs):
    """``shard_model`` + ``Muon`` as rank 16383 of 16384: at most 20 s of this process's CPU
    time and 2.5 GiB peak RSS; no collective handed more than 4 KiB or a list of more than
    1024 tensors (before: the model check handed 236 KB to an all-gather of 16384 slots,
    Muon's 48 KB, check_same_init 18 KB: ~140 s and ~16 GB per rank). CPU time, not wall
    time: the bound is on the work, which other load on a shared machine does not add to."""
    big, calls = runs["big"], runs["calls"]
    print({k: v for k, v in big.items() if k != "iterations"})
    assert big["parameters"] == 1137 and big["units"] == 127
    assert big["setup_cpu_s"] <= 20, big
    assert big["setup_peak_rss_gib"] <= 2.5, big
    assert calls, "no collective recorded"
    biggest = max(calls, key=lambda c: c[1])
    assert biggest[1] <= GATHER_BOUND, biggest
    assert max(n for _, _, n in calls) <= 1024, [c for c in calls if c[2] > 1024]


def test_every_set_up_check_takes_its_digest_path(runs):
    """Each check ran, once, and none took a failure path; the checks' collectives are one
    all-reduce each (the local checks', the model's, the initial values', Muon's)."""
    ran = runs["ran"]
    assert ran == ["agree_on_local_checks", "model check", "check_same_init", "optimizer check"], ran
    reduces = [c for c in runs["calls"] if c[0] == "all_reduce"]
    assert len(reduces) >= 4, runs["calls"]
    assert max(b for _, b, _ in reduces) <= 8 * 8, reduces  # the settings' 4 lanes and their ~


def test_an_iteration_at_16384_ranks_costs_what_it_costs_at_64(runs):
    """A steady iteration (forward, backward, Muon step; after the first step's one-time
    checks): at P = 16384 at most 1.5x the NCCL ops and 2x the host time of P = 64 (the
    least CPU time of iterations 2 and 3: the work, not the machine's other load); FSDP2's
    launch count at both (one per unit and direction: 127 forward gathers, 126 backward
    re-gathers, 127 reduces); no call handed a list of more than 1024 tensors."""
    small, big = runs["small"]["iterations"], runs["big"]["iterations"]
    print("P=64:", small, "\nP=16384:", big)
    cpu = [min(it["cpu_s"] for it in r[1:]) for r in (small, big)]
    assert big[-1]["ops"] <= 1.5 * small[-1]["ops"], (small[-1], big[-1])
    assert cpu[1] <= 2 * cpu[0], cpu
    assert small[-1]["launches"] == big[-1]["launches"] == 127 + 126 + 127, (small[-1], big[-1])
    assert max(it["longest_list"] for it in small + big) <= 1024


def test_hsdp_with_2048_replicas_costs_what_it_costs_with_8(runs):
    """HSDP, shard groups of 8: 2048 replicas (P = 16384) against 8 (P = 64), 8 layers. The
    replicate dim's ops follow the replicas that step a matrix of a rank's segment, never
    the number of replicas: the same ops and launches, at most 2x the host time (before:
    a view per replica per unit and direction, 3.3x at 8 layers)."""
    small, big = runs["hsdp_small"]["iterations"], runs["hsdp_big"]["iterations"]
    print("HSDP 8x8:", small, "\nHSDP 2048x8:", big)
    assert big[-1]["ops_by_kind"] == small[-1]["ops_by_kind"], (small[-1], big[-1])
    assert big[-1]["launches"] == small[-1]["launches"]
    cpu = [min(it["cpu_s"] for it in r[1:]) for r in (small, big)]
    assert cpu[1] <= 2 * cpu[0], cpu


if __name__ == "__main__":
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, repo)  # benchmarks/
    print(json.dumps(_play()))
