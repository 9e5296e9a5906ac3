"""Sixteen thousand ranks, proven in one process: the library's own code as rank 16383 of
16384, against the same at 64 ranks.

``python -m matrixfsdp.bench.scale`` plays one rank of P on a process group that completes
every collective at once and counts what NCCL would be asked (:mod:`matrixfsdp.bench.hollow`:
NCCL's coalescing, so the runtime takes its NCCL path), for a transformers Llama with Llama 3
405B's structure (126 layers, GQA, untied head) at width 64, where only what grows with P
costs anything. Each world size runs in a process of its own (a fresh default group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


def _measure(world_size: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "matrixfsdp.bench.scale", "--ranks",
                          str(world_size), "--iterations", "3"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs() -> tuple[dict, dict]:
    return _measure(64), _measure(16384)


def test_setup_at_16384_ranks_is_fast_small_and_exchanges_o1_bytes(runs):
    """``shard_model`` + ``Muon`` as rank 16383 of 16384: at most 20 s of this process's CPU
    time and 2.5 GiB peak RSS, and no gather at set-up handed more than 4 KiB by this rank
    (every "all ranks agree" check compares a fixed-size digest first). CPU time, not wall
    time: the bound is on the work, which other load on a shared machine does not add to."""
    _, big = runs
    assert big["parameters"] == 1137 and big["units"] == 127
    assert big["setup_cpu_s"] <= 20, big
    assert big["setup_peak_rss_gib"] <= 2.5, big
    assert big["setup_gather_input_bytes"] <= 4096, big


def test_an_iteration_at_16384_ranks_costs_what_it_costs_at_64(runs):
    """A steady iteration (forward, backward, Muon step; after the first step's one-time
    checks): at P = 16384 at most 1.5x the NCCL ops and 2x the host time of P = 64 (the
    least CPU time of iterations 2 and 3: the work, not the machine's other load); FSDP2's
    launch count at both (one per unit and direction: 127 forward gathers, 126 backward
    re-gathers, 127 reduces); no call handed a list of more than 1024 tensors."""
    small, big = (r["iterations"][-1] for r in runs)
    print("P=64:", runs[0]["iterations"], "\nP=16384:", runs[1]["iterations"])
    cpu = [min(it["cpu_s"] for it in r["iterations"][1:]) for r in runs]
    assert big["ops"] <= 1.5 * small["ops"], (small, big)
    assert cpu[1] <= 2 * cpu[0], cpu
    assert small["launches"] == big["launches"] == 127 + 126 + 127, (small, big)
    assert max(small["longest_list"], big["longest_list"]) <= 1024, (small, big)
