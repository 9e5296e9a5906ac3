import gc
import os
import sys
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep the profiler quiet in spawned ranks
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def world1():
    """A one-rank gloo process group in the test process itself."""
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
