"""A finished rank leaves through exit_rank: its output is flushed and its exit code kept.
A rank that leaves otherwise frees its process group once it drops what holds it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.checkpointing import GLOBAL, SEQ, build_sharded, train_steps
from helpers.rank_pool import spawn
from helpers.reference import batches
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def test_exit_rank_flushes_runs_atexit_and_keeps_the_code():
    code = ("import atexit, sys; from matrixfsdp.runtime.exit import exit_rank; "
            "atexit.register(lambda: print('atexit', end='')); "
            "print('out', end=''); print('err', end='', file=sys.stderr); exit_rank(3)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (3, "outatexit", "err")


def _threads() -> set[int]:
    """The ids of this process's threads (Linux)."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _train_save_load(rank, world, ckpt):
    """The issue's case in one function, as a user's ``main()``: train, save through torch's
    ``get_state_dict`` + ``dcp.save``, load into a new model through ``dcp.load`` +
    ``set_state_dict``, train a step."""
    data = batches(2, 1, GLOBAL, SEQ)
    model, opt, sched = build_sharded(world)
    train_steps(model, opt, sched, data, [0], rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    model, opt, sched = build_sharded(world, seed=1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train_steps(model, opt, sched, data, [1], rank, world)


def _group_goes_with_the_model(rank, world, tmp):
    before = _threads()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    ours = _threads() - before  # the group's: gloo's worker threads and its device's loop
    assert len(ours) >= 2, f"the new gloo group started {len(ours)} threads"
    _train_save_load(rank, world, f"{tmp}/ckpt")
    dist.destroy_process_group()
    gc.collect()
    left = ours & _threads()
    assert not left, (f"rank {rank}: the destroyed group's gloo threads {sorted(left)} outlived "
                      "the model, optimizer, mesh and state dicts: something keeps the group")


def test_a_destroyed_group_goes_with_the_model(tmp_path):
    """Once a script has destroyed its process group and dropped the model, optimizer, mesh
    and state dicts, a garbage collection frees the group and joins its gloo threads: the
    library keeps no group of its own. What lets a rank that does not leave through
    exit_rank end without torch's race at interpreter exit (docs/troubleshooting.md, "A rank
    aborts at exit"; studies/exit_abort.py --exit collect)."""
    spawn(_group_goes_with_the_model, 2, str(tmp_path), init=False)
