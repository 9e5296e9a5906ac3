"""Naming the rank a hang waited for from torch's flight recorder, the way a hang on NCCL is
named (NCCL's ``wait()`` does not block the host, so the runtime's own naming, which
watches gloo groups, sees nothing; the watchdog dumps each rank's flight record instead).
The records here are real ones, torch's recorder on gloo (same format as NCCL's dumps):
three ranks, rank 2 never issues the fourth all-reduce."""

from __future__ import annotations

import os
import subprocess
import sys

from matrixfsdp.train.flight import hung_ranks, read_dumps, recorder_env

SCRIPT = r"""
import os, pickle, sys, torch, torch.distributed as dist
import torch._C._distributed_c10d as c10d
from matrixfsdp.train.launch import launch

def work(folder):
    rank = dist.get_rank()
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    side = dist.new_group([0, 1])
    if rank < 2:
        dist.all_reduce(t, group=side)  # a group where all its ranks agree
        dist.all_reduce(t, async_op=True)  # rank 2 never issues this one
    with open(os.path.join(folder, f"rank_{rank}"), "wb") as f:
        f.write(c10d._dump_fr_trace())  # what NCCL's watchdog writes at its timeout
    os._exit(0)

class Args:
    cmd = "test"
    folder = sys.argv[1]

def main(args):
    work(args.folder)

if __name__ == "__main__":
    launch(main, Args(), 3, timeout_s=60)
"""


def test_the_rank_that_never_issued_a_collective_is_named_from_real_flight_records(tmp_path):
    script = tmp_path / "ranks.py"  # a file: the launcher's rank processes import its functions
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                         text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "100"})
    assert out.returncode == 0, out.stderr[-3000:]
    dumps = read_dumps(tmp_path)
    assert sorted(dumps) == [0, 1, 2] and all(dumps.values())
    found = hung_ranks(dumps)
    assert found is not None, dumps
    ranks, sentence = found
    assert ranks == [2], sentence
    assert "rank 2 never issued gloo:all_reduce #4" in sentence and "ranks 0, 1 issued" in sentence


def test_records_that_agree_name_nobody_and_the_launcher_sets_what_the_user_did_not(tmp_path,
                                                                                 monkeypatch):
    entry = {"process_group": ("0", "default_pg"), "collective_seq_id": 7,
             "profiling_name": "nccl:all_reduce", "is_p2p": False}
    assert hung_ranks({0: [entry], 1: [dict(entry)]}) is None
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    env = recorder_env(str(tmp_path))
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env  # the user's own setting stands
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == os.path.join(str(tmp_path), "rank_")
