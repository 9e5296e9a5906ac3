"""Naming the rank a hang waited for from torch's flight recorder, the way a hang on NCCL is
named (NCCL's ``wait()`` does not block the host, so the runtime's own naming, which
watches gloo groups, sees nothing; the watchdog dumps each rank's flight record instead).
The records here are real ones, torch's recorder on gloo (same format as NCCL's dumps):
three ranks, rank 2 never issues the fourth all-reduce."""

from __future__ import annotations

import os
import pickle

import pytest
from helpers.rank_pool import spawn

from matrixfsdp.diagnosis.flight import hung_ranks, main, read_dumps, recorder_env


def _records(rank, world_size, folder, init_file):
    """Three ranks with torch's flight recorder on (read when a group is made); rank 2 writes
    its record before it issues the fourth all-reduce, the others after: what NCCL's
    watchdog writes when rank 2 never issues it."""
    import torch
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    def entries() -> list:
        try:
            return pickle.loads(c10d._dump_fr_trace()).get("entries", [])
        except Exception:  # noqa: BLE001 (no recorder in this process yet)
            return []
    # this pool's process may hold earlier tests' records (groups of the same names): keep
    # this job's, as a fresh process's dump would be
    seen = max((e["record_id"] for e in entries()), default=-1)
    os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    side = dist.new_group([0, 1])
    del os.environ["TORCH_FR_BUFFER_SIZE"]  # this pool's later groups record nothing
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    if rank < 2:
        dist.all_reduce(t, group=side)  # a group where all its ranks agree
    work = dist.all_reduce(t, async_op=True) if rank < 2 else None
    dump = pickle.loads(c10d._dump_fr_trace())
    dump["entries"] = [e for e in dump["entries"] if e["record_id"] > seen]
    with open(os.path.join(folder, f"rank_{rank}"), "wb") as f:
        pickle.dump(dump, f)
    (work or dist.all_reduce(t, async_op=True)).wait()  # every rank ends the same


def test_the_rank_that_never_issued_a_collective_is_named_from_real_flight_records(tmp_path):
    spawn(_records, 3, str(tmp_path), str(tmp_path / "init"), init=False)
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


def test_the_command_refuses_a_directory_with_nothing_to_read(tmp_path, capsys):
    """``python -m matrixfsdp.diagnosis.flight DIR``: a directory that does not exist, one with
    no dump and one whose dumps cannot be read are refused (exit 2, saying what is missing),
    never called a hang-free run; records that agree exit 0 saying how many were read."""
    def refused(folder) -> str:
        with pytest.raises(SystemExit) as stop:
            main([str(folder)])
        assert stop.value.code == 2
        out, err = capsys.readouterr()
        assert "every rank issued the same collectives" not in out + err
        return err

    assert f"{tmp_path / 'nonexistent'} is not a directory: nothing to read" in refused(
        tmp_path / "nonexistent")
    assert f"no flight-recorder dump in {tmp_path}: no file named rank_<rank>" in refused(tmp_path)
    (tmp_path / "rank_0").write_bytes(b"not a pickle")
    assert f"none of the 1 dumps in {tmp_path} (rank_0) could be read" in refused(tmp_path)
    entry = {"process_group": ("0", "default_pg"), "collective_seq_id": 7,
             "profiling_name": "nccl:all_reduce", "is_p2p": False}
    for rank in (0, 1):
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps({"entries": [entry]}))
    assert main([str(tmp_path)]) == 0
    assert "every rank issued the same collectives in every group (2 dumps read: ranks 0, 1)" \
        in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0 and "Exit status" in capsys.readouterr().out
