"""Failures that name their culprit, and non-finite values that never reach a checkpoint:
a NaN gradient stops `matrixfsdp train` (without --skip-nonfinite) naming the step, the
parameter and the rank, with the kept checkpoints all finite (--keep-last); with
--skip-nonfinite the skipped step names the ranks; a hung rank is named by the rank that
timed out waiting for it, with the time it actually waited (with and without --debug, and
in the library on three ranks, where the ranks that did arrive are told apart); a save that
hits a file-size limit says so without a stray "(None)"."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.inject_faults import train as train_with_faults
from helpers.rank_pool import spawn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import DeviceMesh

import matrixfsdp as mf
from matrixfsdp.diagnosis import arrival
from matrixfsdp.diagnosis.arrival import CollectiveTimeout
from matrixfsdp.runtime.collectives import Comm, CommStats
from matrixfsdp.state import dcp_io
from matrixfsdp.state.files import is_complete
from matrixfsdp.state.integrity import CheckpointError, write_failure
from matrixfsdp.train.launch import verdict as launch_verdict
from matrixfsdp.train.models import GPT, GPTConfig

if not sys.platform.startswith("linux"):
    pytest.skip("rlimits, and ranks that hang", allow_module_level=True)

TRAIN = ["train", "--layers", "1", "--d-model", "32", "--heads", "2", "--mlp", "64", "--seq", "32",
         "--batch", "2", "--ranks", "2"]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
HANG_GUARD_S = 120.0  # generous: a timeout of 2-3 s must end far sooner, even on loaded cores


def _train(*extra: str, fault: str):
    return train_with_faults(*TRAIN, *extra, faults=fault, env=ENV)


def _launcher_line(run) -> str:
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("matrixfsdp train:")]
    assert len(lines) == 1, run.stderr[-3000:]
    return lines[0]


def _all_finite(checkpoint, tmp_path) -> bool:
    flat = tmp_path / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, flat)
    state = torch.load(flat, weights_only=False)
    tensors = []

    def walk(v):
        if torch.is_tensor(v):
            tensors.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
    walk(state)
    assert len(tensors) > 10  # the model and the optimizer state were read
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_nan_gradient_stops_the_run_and_every_kept_checkpoint_is_finite(tmp_path, mode):
    """A NaN in rank 1's piece of one gradient at step 5 (of 6, 1-based: the fault's 4; a save
    every 2, the last 2 kept). Before: training went on with NaN weights, exited 0, and
    --keep-last 2 pruned the finite checkpoints (both kept ones all-NaN). Now: exit 1 at
    step 5, before its optimizer step, naming the step, the parameter and rank 1; steps 2
    and 4 are kept, both finite."""
    out = tmp_path / "run"
    run = _train("--steps", "6", "--save-every", "2", "--keep-last", "2", "--out", str(out),
                 *(["--async-save"] if mode == "async" else []), fault="nan@1:4")
    assert run.returncode == 1, run.stderr[-3000:]
    line = _launcher_line(run)
    ckpts = out / "checkpoints"
    assert re.fullmatch(
        r"matrixfsdp train: rank [01] failed: NonFiniteError: step 5: non-finite gradients: [\w.]+ "
        r"\(rank 1\)\. Training stopped before the optimizer step, on every rank: no checkpoint "
        rf"holds these values \(the newest checkpoint, {re.escape(str(ckpts / 'step_00000004'))}, "
        r"is from before it\); --skip-nonfinite skips such steps instead; the other ranks were stopped",
        line), line
    assert "Traceback" not in run.stderr  # one line says it all
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000004"]
    for name in ("step_00000002", "step_00000004"):
        assert is_complete(ckpts / name) and _all_finite(ckpts / name, tmp_path), name
    assert not (out / "summary.json").exists()


def test_skipped_steps_name_the_ranks(tmp_path):
    """--skip-nonfinite: a NaN gradient on rank 1 at step 2 and a NaN loss on rank 0 at
    step 4 (1-based; the faults' 1 and 3) are skipped, each line naming where (before: the
    parameters only)."""
    run = _train("--steps", "5", "--skip-nonfinite", "--out", str(tmp_path),
                 fault="nan@1:1,nanloss@0:3")
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout.replace("\r", "\n")
    step1 = re.search(r"step 2: gradient norm is not finite, step skipped on every rank; "
                      r"non-finite gradients: ([\w.]+) \(rank 1\)\n", text)
    assert step1, text[-3000:]
    assert ("step 4: gradient norm is not finite, step skipped on every rank; the loss is not "
            "finite on rank 0; non-finite gradients: ") in text
    skipped = json.loads((tmp_path / "summary.json").read_text())["skipped_steps"]
    assert [s["step"] for s in skipped] == [2, 4]
    assert skipped[0]["nonfinite_ranks"] == {step1.group(1): [1]} and skipped[0]["ranks"] == [1]
    assert skipped[1]["loss_ranks"] == [0] and skipped[1]["ranks"] == [0, 1]


@pytest.mark.parametrize("debug", [False, True])
def test_a_hung_rank_is_named_with_the_time_actually_waited(tmp_path, debug):
    """Rank 1 hangs at the start of step 2 under --timeout 3. Before: without --debug, rank
    0's own gloo error ("Timed out waiting 5000ms for send operation to complete"), no word
    of rank 1; with --debug, "waited 30 s" (the check's default, not what it waited); and
    the launcher said "rank 0 failed". Now rank 0 names rank 1, where it was last seen (the
    last collective rank 0 completed with it: step 2's step check) and the seconds it
    waited, measured; the launcher names rank 1 as the one that hung, and no rank failed."""
    t0 = time.monotonic()
    run = _train("--steps", "4", "--timeout", "3", "--out", str(tmp_path), *(["--debug"] if debug else []),
                 fault="hang@1:2")
    assert time.monotonic() - t0 < HANG_GUARD_S
    assert run.returncode == 1, run.stderr[-3000:]
    line = _launcher_line(run)
    if debug:
        pattern = (r"matrixfsdp train: rank 1 hung: matrixfsdp debug: rank 1 did not "
                   r"arrive \(its last collective: step 2, .*\); rank 0 waited (\d+\.\d) s for it at "
                   r"step 3, unit '<root>', forward gather .*")
    else:
        pattern = (r"matrixfsdp train: rank 1 hung: rank 1 did not arrive at the \w+ #\d+ on ranks 0-1 "
                   r"\(step 3, forward and backward\): last seen at the step check all_reduce #\d+ "
                   r"\(step 2, step check\), the last collective rank 0 completed with it \(it hangs, "
                   r"is slower than the timeout, or left the training loop; debug mode says where each "
                   r"rank is\); rank 0 waited (\d+\.\d) s for it \(the process group's timeout is 3 "
                   r"s\); every rank was stopped \(SIGTERM, then SIGKILL after 5 s\)")
    found = re.fullmatch(pattern, line)
    assert found, line
    assert 2.5 <= float(found.group(1)) < HANG_GUARD_S, line
    assert "failed" not in run.stderr and "rank 0 stopped: " in run.stderr, run.stderr[-3000:]


def _three_ranks(rank, world, tmp):
    """Rank 2 never issues the all-gather that ranks 0 and 1 wait for (a 2 s group)."""
    group = dist.new_group(timeout=timedelta(seconds=2))
    comm = Comm(group, CommStats())
    comm.all_gather(torch.empty(world * 4), torch.ones(4)).wait()  # all arrive: fine
    message = "no error"
    if rank == 2:
        time.sleep(4)  # past the others' timeout; then leave without the all-gather
    else:
        try:
            comm.all_gather(torch.empty(world * 4), torch.ones(4)).wait()
        except CollectiveTimeout as e:
            message = str(e)
        # both stay until both have timed out: a rank leaving the job closes its connections
        store = dist.distributed_c10d._get_default_store()
        store.set(f"timed-out/{rank}", "1")
        store.wait([f"timed-out/{1 - rank}"], timedelta(seconds=60))
    with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
        f.write(message)


def test_a_collective_timeout_names_the_missing_rank_and_those_that_arrived(tmp_path):
    """The library alone (no CLI, no debug mode), on three ranks: ranks 0 and 1 time out
    waiting for rank 2; each names rank 2 as missing, the other as arrived, and the time."""
    spawn(_three_ranks, 3, str(tmp_path), timeout=120)
    for rank, other in ((0, 1), (1, 0)):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        found = re.fullmatch(
            r"rank 2 did not arrive at the all_gather #2 on ranks 0-2: last seen at the all_gather #1, the "
            rf"last collective rank {rank} completed with it \(it hangs, .*\); rank {rank} waited "
            r"(\d+\.\d) s for it \(the process group's timeout is 2 s\); "
            rf"rank {other} arrived and waited too", message)
        assert found and 1.5 <= float(found.group(1)) < HANG_GUARD_S, message
    assert (tmp_path / "rank2.txt").read_text() == "no error"


def _clip_hang(rank, world, tmp):
    """Rank 1 never joins the global gradient norm's all-reduce (a 2 s mesh group)."""
    mesh = DeviceMesh.from_group(dist.new_group(timeout=timedelta(seconds=2)), "cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=1, d_mlp=24))
    mf.fully_shard(model.layers[0], mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    x = torch.randint(0, 64, (2, 9))
    model.loss(x[:, :-1], x[:, 1:]).backward()
    message = "no error"
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        try:
            mf.clip_grad_norm_(model.parameters(), 1.0)
        except CollectiveTimeout as e:
            message = str(e)
        store.set("clip-timed-out", "1")
    else:  # stays until rank 0 has timed out: leaving would close its connections
        store.wait(["clip-timed-out"], timedelta(seconds=60))
    with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
        f.write(message)


def test_a_hang_in_the_gradient_norm_names_the_missing_rank(tmp_path):
    """mf.clip_grad_norm_'s all-reduce is watched like the runtime's collectives: rank 0
    names rank 1 and the time it waited (before: gloo's own receive timeout)."""
    spawn(_clip_hang, 2, str(tmp_path), timeout=120)
    message = (tmp_path / "rank0.txt").read_text()
    found = re.fullmatch(r"rank 1 did not arrive at the gradient norm all_reduce #\d+ on ranks 0-1: "
                         r"last seen at the reduce_scatter #\d+, the last collective rank 0 "
                         r"completed with it \(it hangs, .*\); rank 0 waited (\d+\.\d) s for it "
                         r"\(the process group's timeout is 2 s\)", message)
    assert found and 1.5 <= float(found.group(1)) < HANG_GUARD_S, message


def _file_size_limit(rank, world, tmp):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    message = "no error"
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))  # Python ignores SIGXFSZ: EFBIG
    try:
        mf.save_checkpoint({"x": torch.zeros(1 << 16)}, os.path.join(tmp, "step_1"))
    except CheckpointError as e:
        message = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # this pool rank serves other tests
    with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
        f.write(message)


def test_a_save_over_the_file_size_limit_says_so(tmp_path):
    """A 256 KiB tensor under a 64 KiB file-size limit. Two forms, by where the limit is hit:
    DCP's tensor writer fails a short write with its own error, which it hands to every
    rank without the OSError (before: '... failed: CheckpointException: CheckpointException
    ranks:dict_keys([0])'); a Python write fails with EFBIG and no file name (before:
    '... File too large (None)')."""
    spawn(_file_size_limit, 2, str(tmp_path), timeout=120)
    message = (tmp_path / "rank0.txt").read_text()
    assert message == (tmp_path / "rank1.txt").read_text()  # the same on every rank
    assert re.fullmatch(
        rf"matrixfsdp\.save_checkpoint: writing {re.escape(str(tmp_path / 'step_1'))} failed: rank 0: "
        r"RuntimeError: .+ \(this process's file-size limit is 65536 bytes: ulimit -f\); nothing was "
        r"committed, no earlier checkpoint exists", message), message
    assert not (tmp_path / "step_1").exists() and not (tmp_path / ".step_1.partial").exists()

    efbig = write_failure(OSError(errno.EFBIG, "File too large"), tmp_path / "step_2", tmp_path / "step_1")
    assert str(efbig) == (f"matrixfsdp.save_checkpoint: cannot write {tmp_path / 'step_2'}: File too large "
                          "(EFBIG); a file-size limit (ulimit -f) or the file system's largest file was "
                          f"reached; nothing was committed, the previous checkpoint {tmp_path / 'step_1'} "
                          "is intact")


def _save_hang(rank, world, tmp):
    """Rank 1 never comes to the checkpoint save that rank 0 starts (a 2 s group)."""
    group = dist.new_group(timeout=timedelta(seconds=2))
    store = dist.distributed_c10d._get_default_store()
    message = "no error"
    if rank == 0:
        try:
            mf.save_checkpoint({"x": torch.zeros(3)}, os.path.join(tmp, "step_1"), process_group=group)
        except CollectiveTimeout as e:
            message = str(e)
        store.set("save-timed-out", "1")
    else:
        store.wait(["save-timed-out"], timedelta(seconds=60))
    with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
        f.write(message)


def test_a_rank_missing_at_a_checkpoint_save_is_named(tmp_path):
    """Before DCP's own collectives (whose timeouts name no rank), every rank meets at a
    watched barrier: rank 0 names rank 1, which never came, and the time it waited; nothing
    is written."""
    spawn(_save_hang, 2, str(tmp_path), timeout=120)
    message = (tmp_path / "rank0.txt").read_text()
    found = re.fullmatch(r"rank 1 did not arrive at the checkpoint save barrier #\d+ on ranks 0-1: "
                         r"not seen at any collective of this group \(it hangs, .*\); rank 0 waited "
                         r"(\d+\.\d) s for it .*", message)
    assert found and 1.5 <= float(found.group(1)) < HANG_GUARD_S, message
    assert sorted(os.listdir(tmp_path)) == ["rank0.txt", "rank1.txt"]  # no checkpoint directory


def _write_hang(rank, world, tmp, async_save):
    """Rank 1's storage hangs inside DCP's save (its write never returns until rank 0 has
    given up); rank 0, done writing, waits in DCP's gather of the results (a 2 s group)."""
    group = dist.new_group(timeout=timedelta(seconds=2))
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        write = dcp.FileSystemWriter.write_data

        def hung(self, plan, planner):
            store.wait(["save-timed-out"], timedelta(seconds=60))
            return write(self, plan, planner)
        dcp.FileSystemWriter.write_data = hung
    message = "no error"
    try:
        saved = mf.save_checkpoint({"x": torch.full((3,), float(rank))}, os.path.join(tmp, "step_1"),
                                   process_group=group, async_save=async_save)
        if async_save:
            saved.result()
    except CheckpointError as e:
        message = str(e)
    finally:
        if rank == 0:
            store.set("save-timed-out", "1")
        else:
            dcp.FileSystemWriter.write_data = write
    with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
        f.write(message)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_rank_whose_storage_hangs_inside_dcp_is_named(tmp_path, async_save):
    """DCP's own gather, waiting for a rank whose write hangs, times out naming nobody; the
    save names the rank whose write had not finished and the time waited, and commits nothing."""
    spawn(_write_hang, 2, str(tmp_path), async_save, timeout=120)
    message = (tmp_path / "rank0.txt").read_text()
    found = re.fullmatch(
        rf"matrixfsdp\.save_checkpoint: saving {re.escape(str(tmp_path / 'step_1'))} timed out: rank 1 "
        rf"did not arrive at the end of writing its part of {re.escape(str(tmp_path / 'step_1'))}: still "
        r"in it after \d+\.\d s \(it hangs, or is slower than the timeout\); rank 0 waited (\d+\.\d) s "
        r"for it \(the process group's timeout is 2 s\); nothing was committed, no earlier checkpoint "
        r"exists", message)
    assert found and 1.5 <= float(found.group(1)) < HANG_GUARD_S, message
    assert not (tmp_path / "step_1").exists()


def _part_hangs(rank, world, tmp, where):
    """One rank blocks (until the other has given up) in a part of a save or a load that
    runs between collectives: rank 0 in the commit (``os.rename`` of the partial directory)
    or in DCP's global save planning, rank 1 in DCP's load planning (a 2 s group)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    group = dist.new_group(timeout=timedelta(seconds=2))
    store = dist.distributed_c10d._get_default_store()
    path = os.path.join(tmp, "step_1")
    if where == "load planning":
        mf.save_checkpoint({"x": torch.zeros(3)}, path, process_group=group)
    target = {"commit": (os, "rename"), "global planning": (DefaultSavePlanner, "create_global_plan"),
              "load planning": (dcp.FileSystemReader, "prepare_local_plan")}[where]
    original = getattr(*target)
    stuck = 1 if where == "load planning" else 0

    def blocked(*args, **kwargs):
        if where != "commit" or str(args[0]).endswith(".partial"):  # not DCP's own metadata rename
            store.wait(["gave-up"], timedelta(seconds=60))
        return original(*args, **kwargs)
    if rank == stuck:
        setattr(*target, blocked)
    message = "no error"
    try:
        if where == "load planning":
            dcp_io.load({"x": torch.zeros(3)}, Path(path), group)
        else:
            mf.save_checkpoint({"x": torch.zeros(3)}, path, process_group=group)
    except CollectiveTimeout as e:
        message = str(e)
    except Exception as e:  # noqa: BLE001 (the blocked rank, once let go: its peer has left)
        message = f"{type(e).__name__}"
    finally:
        setattr(*target, original)
        if rank != stuck:
            store.set("gave-up", "1")
    with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
        f.write(message)


@pytest.mark.parametrize("where", ["commit", "global planning", "load planning"])
def test_a_rank_stuck_between_the_collectives_of_a_save_or_load_is_named(tmp_path, where):
    """Rank 0 stuck in the commit (the library's own broadcast then waits; before: gloo's
    bare timeout, naming no rank) or in DCP's global planning (the coordinator's part), rank
    1 stuck in DCP's load planning: the other rank names it and where it was last seen."""
    spawn(_part_hangs, 2, str(tmp_path), where, timeout=120)
    stuck, other = (1, 0) if where == "load planning" else (0, 1)
    message = (tmp_path / f"rank{other}.txt").read_text()
    path = re.escape(str(tmp_path / "step_1"))
    expected = {
        "commit": rf"rank 0 did not arrive at the broadcast of the commit of {path} #\d+ on ranks 0-1: "
                  rf"last seen in rank 0's part of the commit of {path}, \d+\.\d s before",
        "global planning": rf"matrixfsdp\.save_checkpoint: saving {path} timed out: rank 0 did not arrive "
                           rf"at the end of DCP's save planning of {path}: last seen in DCP's global save "
                           rf"planning \(the coordinator\) of {path}, \d+\.\d s before",
        "load planning": rf"matrixfsdp\.load_checkpoint: loading {path} timed out: rank 1 did not arrive "
                         rf"at the end of DCP's load planning of {path}: still in it after \d+\.\d s"}[where]
    found = re.fullmatch(expected + rf" \(it hangs, or is slower than the timeout\); rank {other} waited "
                         r"(\d+\.\d) s for it \(the process group's timeout is 2 s\).*", message)
    assert found and 1.5 <= float(found.group(1)) < HANG_GUARD_S, message


def _posted_group(me: int, last_completed: int, posts: dict[int, dict]):
    """A watched 4-rank group as rank ``me`` sees it after a timeout: the peers' posts in a
    store of its own (``posts``: rank -> what it posted), ``last_completed`` the last point
    this rank completed."""
    g = object.__new__(arrival._Group)
    g.count, g.ranks, g.watched, g.name = last_completed + 1, [0, 1, 2, 3], True, "world"
    g.me, g.timeout, g.slow = me, 5.0, timedelta(0)
    g.store = dist.HashStore()
    g.last = {"index": last_completed, "kind": "all_gather", "step": 5, "phase": "forward and backward",
              "local": False}
    for r, post in posts.items():
        g.store.set(g.key(r), json.dumps({"since": time.time() - 4.0, "step": 5, "local": False,
                                          "phase": "forward and backward", **post}))
    return g


def test_a_peer_waiting_at_an_earlier_collective_is_not_named_as_the_hung_rank():
    """A ring or a reduce completes on some ranks before others: rank 0 completed all_gather
    #31 and times out at #32, while rank 3 still waits at #31 for rank 2 (frozen, last seen
    at #30). Rank 0 names rank 2 only, and says rank 3 waits; then the launcher, from every
    waiting rank's report (rank 3's names rank 2), names rank 2 alone."""
    g = _posted_group(0, 31, {1: {"index": 32, "kind": "all_gather", "state": "waiting"},
                              2: {"index": 30, "kind": "all_gather", "state": "done"},
                              3: {"index": 31, "kind": "all_gather", "state": "waiting"}})
    found = arrival.failure(g, 32, "the all_gather #32", time.monotonic() - 5.0,
                            (5, "forward and backward"),
                            RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    assert found.missing == [2], str(found)
    text = str(found)
    assert "rank 3 was last seen waiting at the all_gather #31" in text and "rank 1 arrived" in text, text
    # an earlier view, before rank 3 posted its wait, named rank 3 too: the launcher drops
    # the ranks that reported a wait themselves
    reports = [{"rank": 0, "time": 1.0, "waited": True, "hung": [2, 3], "message": "ranks 2, 3 ..."},
               {"rank": 3, "time": 1.5, "waited": True, "hung": [2], "message": "rank 2 ..."},
               {"rank": 1, "time": 1.2, "waited": True, "hung": [2], "message": "rank 2 ..."}]
    verdict = launch_verdict(reports)
    assert verdict["hung"] == [2] and verdict["rank"] == 1, verdict
    # a rank that failed of its own accord is the story, however many waited
    own = {"rank": 2, "time": 2.0, "waited": False, "hung": [], "line": "rank 2 failed: ValueError: x"}
    assert launch_verdict([*reports, own])["rank"] == 2
