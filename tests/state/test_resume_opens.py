"""A resume touches only what each rank must. Under torchrun's environment no rank opens or
hashes a checkpoint file before the process group exists (before: each rank process
verified the whole checkpoint as rank 0 of 1, hashing every file, then read it again); at
the same world size each rank opens and hashes only the DCP shard files it wrote
(``__<rank>_*.distcp``), and rank 0 alone also the index (``.metadata``, ``CHECKSUMS.json``)
(before: every rank opened every rank's file, for the name marks and the replicated values).

Each rank process records its own opens (``sys.addaudithook``) and hashes, from outside the
library (``tests/helpers/open_audit.py``). The rank processes are forked from the server that
preloaded torch and the library (as the launcher's ranks are), each given torchrun's
environment before the command starts."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import open_audit
from helpers.cli import run_cli
from helpers.rank_pool import spawn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.state.files import checkpoint_dir
from matrixfsdp.state.integrity import CheckpointError
from matrixfsdp.train.models import GPT, GPTConfig

if not sys.platform.startswith("linux"):
    pytest.skip("torchrun's environment on local processes", allow_module_level=True)

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--mlp", "64", "--seq", "32", "--batch", "2"]
WORLD = 4
SHARD = re.compile(r"__(\d+)_\d+\.distcp")
INDEX = (".metadata", "CHECKSUMS.json", "COMPLETE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(env: dict, log: Path, args: list[str]) -> None:
    """One rank process: torchrun's environment, this process's opens and hashes recorded
    from here on, its output into ``log``'s ``.out`` / ``.err``, then the command."""
    os.environ.update(env)
    for fd, suffix in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(str(log.with_suffix(suffix)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    open_audit.install(str(log))
    from matrixfsdp.__main__ import run
    sys.argv = ["matrixfsdp", *args]
    run()


def _torchrun_ranks(logs: Path, *args: str) -> list[subprocess.CompletedProcess]:
    """``matrixfsdp *args`` in WORLD processes with the environment torchrun gives its ranks
    (forked from the server that preloaded torch and the library, as the launcher's ranks
    are: a fresh interpreter per rank costs seconds of imports), each recording into
    ``logs/rank<r>.jsonl``."""
    port, ctx = _free_port(), multiprocessing.get_context("forkserver")
    procs = []
    for r in range(WORLD):
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RANK": str(r),
               "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(WORLD),
               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(ctx.Process(target=_rank, args=(env, logs / f"rank{r}.jsonl", list(args))))
        procs[-1].start()
    for p in procs:
        p.join(300)
    out = []
    for r, p in enumerate(procs):
        if p.is_alive():
            for q in procs:
                q.kill()
            raise TimeoutError(f"rank {r} did not end")
        log = logs / f"rank{r}.jsonl"
        out.append(subprocess.CompletedProcess(args, p.exitcode, log.with_suffix(".out").read_text(),
                                               log.with_suffix(".err").read_text()))
    return out


def test_a_resume_under_torchrun_opens_only_each_ranks_own_files_and_none_before_the_group(tmp_path):
    out = tmp_path / "run"
    saved = run_cli("train", "--ranks", str(WORLD), "--steps", "1", "--save-every", "1", *TINY,
                    "--out", str(out), env={"OMP_NUM_THREADS": "1"})
    assert saved.returncode == 0, saved.stderr[-3000:]
    ck = checkpoint_dir(out / "checkpoints", 1)
    sizes = {f.name: f.stat().st_size for f in ck.iterdir()}
    assert sorted(n for n in sizes if SHARD.fullmatch(n)) == [f"__{r}_0.distcp" for r in range(WORLD)]

    logs = tmp_path / "audit"
    logs.mkdir()
    ranks = _torchrun_ranks(logs, "train", "--steps", "1", *TINY, "--resume", "--out", str(out))
    for r, run in enumerate(ranks):
        assert run.returncode == 0, (r, run.stderr[-3000:])
    assert f"resumed from {ck} (step 1, saved at {WORLD} ranks; now {WORLD})" in ranks[0].stdout

    for r in range(WORLD):
        seen = [json.loads(line) for line in (logs / f"rank{r}.jsonl").read_text().splitlines()]
        here = [e for e in seen if Path(e["path"]).parent == ck]
        before = [e for e in here if not e["pg"]]
        assert not before, (r, before)  # nothing of the checkpoint before init_process_group
        opened = Counter(Path(e["path"]).name for e in here if e["kind"] == "open")
        hashed = {Path(e["path"]).name: e["bytes"] for e in here if e["kind"] == "hash"}
        shards = {n for n in opened if SHARD.fullmatch(n)}
        assert shards == {f"__{r}_0.distcp"}, (r, dict(opened))  # its own file, no other rank's
        index = {n for n in opened if n in INDEX}
        assert index == ({".metadata", "CHECKSUMS.json"} if r == 0 else set()), (r, dict(opened))
        assert set(opened) == shards | index, (r, dict(opened))
        # each file hashed once, on the rank that reads it (rank 0: the index too)
        assert hashed == {n: sizes[n] for n in shards | ({".metadata"} if r == 0 else set())}, (r, hashed)
        print(f"rank {r}: opened {dict(sorted(opened.items()))}, hashed {sum(hashed.values())} bytes")


def _model(world: int, seed: int):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_mlp=24))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    return model, mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=3e-3))


def _full(model, opt) -> dict:
    """Every parameter and optimizer state tensor, full (torch's full_state_dict)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v for k, v in msd.items()}
    for name, state in osd["state"].items():
        out.update({f"optim.{name}.{k}": v for k, v in state.items()})
    return out


def _save_at_2(rank: int, world: int, tmp: str) -> None:
    model, opt = _model(world, seed=0)
    x = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(1))[rank::world]
    for _ in range(2):
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    path = Path(tmp) / "step_2"
    mf.save_checkpoint(mf.get_state_dict(model, opt), path)
    full = _full(model, opt)
    if rank == 0:
        torch.save(full, Path(tmp) / "full.pt")
    # verify_checkpoint: each rank checks the files it wrote; a damaged one of rank 1's is
    # named on every rank, by rank 1 alone (one all-reduce, then its message)
    assert mf.verify_checkpoint(path)
    shard = path / "__1_0.distcp"
    data = shard.read_bytes()
    dist.barrier()
    if rank == 1:
        shard.write_bytes(data[:100] + bytes(b ^ 0xFF for b in data[100:116]) + data[116:])
    dist.barrier()
    with pytest.raises(CheckpointError, match=rf"{shard} does not match its checksum"):
        mf.verify_checkpoint(path)
    dist.barrier()
    if rank == 1:
        shard.write_bytes(data)
    dist.barrier()


def test_a_load_at_another_world_size_plans_each_rank_from_the_index_rank_0_read(world1, tmp_path):
    """Saved at 2 ranks, loaded at 1 by mf.load_checkpoint: no rank finds its pieces in its
    own file as saved, so rank 0 broadcasts the index and each rank plans its reads from it
    (DCP's own overlap search): every parameter and optimizer state tensor bit for bit. At 2
    ranks, verify_checkpoint names a damaged file of rank 1 on both ranks."""
    spawn(_save_at_2, 2, str(tmp_path))
    want = torch.load(tmp_path / "full.pt")
    model, opt = _model(1, seed=7)
    mf.load_checkpoint(model, opt, tmp_path / "step_2")
    got = _full(model, opt)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
