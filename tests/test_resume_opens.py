"""A resume touches only what each rank must. Under torchrun's environment no rank opens or
hashes a checkpoint file before the process group exists (before: each rank process
verified the whole checkpoint as rank 0 of 1, hashing every file, then read it again); at
the same world size each rank opens and hashes only the DCP shard files it wrote
(``__<rank>_*.distcp``), and rank 0 alone also the index (``.metadata``, ``CHECKSUMS.json``)
(before: every rank opened every rank's file, for the name marks and the replicated values).

Each rank process records its own opens (``sys.addaudithook``) and hashes, from outside the
library (``tests/open_audit.py``)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from _cli import run_cli

from matrixfsdp.state.files import checkpoint_dir

if not sys.platform.startswith("linux"):
    pytest.skip("torchrun's environment on local processes", allow_module_level=True)

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--mlp", "64", "--seq", "32", "--batch", "2"]
WORLD = 4
AUDIT = Path(__file__).with_name("open_audit.py")
SHARD = re.compile(r"__(\d+)_\d+\.distcp")
INDEX = (".metadata", "CHECKSUMS.json", "COMPLETE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_ranks(logs: Path, *args: str) -> list[subprocess.CompletedProcess]:
    """``matrixfsdp *args`` in WORLD processes with the environment torchrun gives its ranks,
    each recording into ``logs/rank<r>.jsonl``."""
    port = _free_port()
    procs = []
    for r in range(WORLD):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RANK": str(r),
               "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(WORLD),
               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCHELASTIC_RUN_ID": "test-resume-opens"}
        procs.append(subprocess.Popen([sys.executable, str(AUDIT), str(logs / f"rank{r}.jsonl"), *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_a_resume_under_torchrun_opens_only_each_ranks_own_files_and_none_before_the_group(tmp_path):
    out = tmp_path / "run"
    saved = run_cli("train", "--ranks", str(WORLD), "--steps", "2", "--save-every", "2", *TINY,
                    "--out", str(out), env={"OMP_NUM_THREADS": "1"})
    assert saved.returncode == 0, saved.stderr[-3000:]
    ck = checkpoint_dir(out / "checkpoints", 2)
    sizes = {f.name: f.stat().st_size for f in ck.iterdir()}
    assert sorted(n for n in sizes if SHARD.fullmatch(n)) == [f"__{r}_0.distcp" for r in range(WORLD)]

    logs = tmp_path / "audit"
    logs.mkdir()
    ranks = _torchrun_ranks(logs, "train", "--steps", "2", *TINY, "--resume", "--out", str(out))
    for r, run in enumerate(ranks):
        assert run.returncode == 0, (r, run.stderr[-3000:])
    assert f"resumed from {ck} (step 2, saved at {WORLD} ranks; now {WORLD})" in ranks[0].stdout

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
