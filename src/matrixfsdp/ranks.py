"""Small helpers shared by every entry point that runs ranks (``matrixfsdp train``,
``matrixfsdp bench`` and the bench tools), kept out of the CLI so that the benchmark can use
them without importing it: the device a local rank runs on, waiting for that device before
reading host clocks, and the argument type of ``--timeout`` (and ``--clip``)."""

from __future__ import annotations

import argparse
import math

import torch


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
