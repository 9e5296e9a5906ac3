"""Running ranks, shared by every entry point (``matrixfsdp train``, ``matrixfsdp bench``
and the bench tools) and kept out of the CLI so that the benchmark can use it without
importing it: the launcher (:func:`launch`: local processes, or in place under torchrun),
the device a local rank runs on, waiting for that device before reading host clocks, and
the argument type of ``--timeout`` (and ``--clip``)."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ._exit import exit_rank

DEFAULT_TIMEOUT_S = 300.0  # process-group timeout of `train`, spawned and under torchrun alike
STOP_GRACE_S = 5.0  # after SIGTERM, how long a rank may take to end before SIGKILL


def device_for(local_rank: int) -> torch.device:
    """The device of local rank ``local_rank``: GPU ``local_rank % count`` (made the current
    device) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    """Wait for queued device work, so host clocks time it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def positive_float(text: str) -> float:
    """``argparse`` type: a finite number > 0 (seconds of a timeout, a clipping norm)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v




# ---- launching ---------------------------------------------------------------------------
def _spawned(rank: int, fn, world_size: int, init_file: str, args, timeout_s: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device_for(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        fn(args)
    finally:
        dist.destroy_process_group()
    exit_rank(0)  # finished: leave without interpreter finalization (see _exit.py)


class _Stopped(BaseException):
    """The launcher received SIGTERM: stop the ranks, then exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop_ranks(processes) -> None:
    """SIGTERM every live rank, SIGKILL those still alive after :data:`STOP_GRACE_S`, reap all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def _join_ranks(ctx, prog: str) -> None:
    """Wait for every rank. The first rank to fail ends the others (torch's ``join`` does
    that) and this launcher with a one-line error naming it; SIGTERM or Ctrl-C to the
    launcher ends every rank before the launcher exits, so no rank outlives it."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    def on_sigterm(signum, frame):
        raise _Stopped(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        while not ctx.join(timeout=1.0):
            pass
    except ProcessRaisedException as e:
        print(e.msg.strip(), file=sys.stderr)  # the rank's own traceback
        last = e.msg.strip().splitlines()[-1] if e.msg.strip() else "an exception"
        raise SystemExit(f"{prog}: rank {e.error_index} (pid {e.error_pid}) failed: {last}; "
                         "the other ranks were stopped") from None
    except ProcessExitedException as e:
        how = (f"was killed by signal {e.signal_name}" if e.signal_name
               else f"exited with code {e.exit_code}")
        raise SystemExit(f"{prog}: rank {e.error_index} (pid {e.error_pid}) {how}; "
                         "the other ranks were stopped") from None
    except (KeyboardInterrupt, _Stopped) as e:
        _stop_ranks(ctx.processes)
        signum = e.signum if isinstance(e, _Stopped) else signal.SIGINT
        print(f"{prog}: stopped by {signal.Signals(signum).name}; all ranks ended", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def launch(fn, args, world_size: int, timeout_s: float | None = None) -> None:
    """Run ``fn(args)`` on ``world_size`` ranks: in place under torchrun (RANK is set),
    else as local processes (gloo on CPU, NCCL on CUDA). ``timeout_s`` (default
    ``args.timeout``, else :data:`DEFAULT_TIMEOUT_S`) is the process group's timeout in both
    cases: a collective waiting longer for a peer fails instead of hanging."""
    if timeout_s is None:
        timeout_s = getattr(args, "timeout", None) or DEFAULT_TIMEOUT_S
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        device_for(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        try:
            fn(args)
        finally:
            dist.destroy_process_group()
        exit_rank(0)  # finished: leave without interpreter finalization (see _exit.py)
    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        raise SystemExit(f"--ranks {world_size} needs {world_size} GPUs, found "
                         f"{torch.cuda.device_count()}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = torch.multiprocessing.start_processes(
            _spawned, args=(fn, world_size, os.path.join(tmp, "init"), args, timeout_s),
            nprocs=world_size, join=False, start_method="spawn")
        _join_ranks(ctx, f"matrixfsdp {getattr(args, 'cmd', None) or 'launch'}")
