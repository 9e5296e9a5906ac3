import gc
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep the profiler quiet in spawned ranks
# tests/: the shared helpers are the package ``helpers`` (tests/helpers/); the test files sit
# in folders by the package's rooms, each imported by its basename (pytest's default
# "prepend" import mode: every basename is unique). The rank processes the tests start
# inherit this path, so they import both.
sys.path.insert(0, os.path.dirname(__file__))
# the repository root: benchmarks/, studies/ and tools/ (outside the package) for their tests
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def world1():
    """A one-rank gloo process group in the test process itself (made once, and again if a
    test destroyed it: test_plan_peers plays a rank of 8 on torch's fake group)."""
    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(), "init")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    yield


def pytest_collection_finish(session):
    """Every test module is imported (torch, transformers, the library): keep those objects
    out of the garbage collector's full collections, which then scan only what tests make."""
    gc.freeze()


# The files that take longest (seconds each under `make test`'s two workers, measured on 2
# cores with `--durations=0` on a fresh clone with a cold inductor cache, as CI runs,
# 2026-12-06; torchtitan's N-D and gpu-check files added 2026-12-07: 39 s down to 5 s), run
# first: `make test` hands whole files to two workers in collection order (`--dist loadfile
# --no-loadscope-reorder`), so that longest-first leaves only short files for the end, where
# one worker would otherwise run a long one alone. The
# first two pair the torchtitan trainer's two busy ranks with the hang tests' waiting;
# test_compile comes early for its cold C++ build (30 s of one core on a fresh machine).
LONGEST_FIRST = ("test_torchtitan_full_trainer.py", "test_run_failures_named.py", "test_compile.py",
                 "test_torchtitan_nd.py", "test_cli_launch.py", "test_gpu_check.py",
                 "test_cli_hangs.py", "test_docs_examples.py",
                 "test_pipelining.py", "test_tp_compose.py", "test_bench.py", "test_cli_run_lock.py",
                 "test_16384_ranks.py", "test_pip_install.py", "test_parity.py",
                 "test_torchtitan_pieces.py", "test_plan_search.py", "test_matrix_optimizers.py",
                 "test_hsdp.py", "test_tp_group.py", "test_device_memory.py", "test_plan_placements.py",
                 "test_checkpoint.py", "test_plan_at_16384.py",
                 "test_imports.py",
                 "test_training_features.py", "test_cli_train.py", "test_plan_model.py",
                 "test_cli_never_destroys_work.py")
# a name here that no test file has any more (renamed, moved away) would silently stop
# ordering it: refused at once
_missing = set(LONGEST_FIRST) - {p.name for p in Path(__file__).parent.rglob("test_*.py")}
assert not _missing, f"conftest.LONGEST_FIRST names no test file: {sorted(_missing)}"


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: files stay whole
