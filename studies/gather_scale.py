"""What the exact gather behind torch's ``full_state_dict`` costs one rank of P ranks, per
tensor, played in one process (:mod:`~matrixfsdp.testing.hollow`: every collective completes
at once and is counted as NCCL would issue it, so only what this rank's own code does with
P costs anything).

Three kinds of tensor, as rank P - 1 holds them in a MatrixFSDP state dict: a Muon matrix
it owns (64 x 64), its share of an even parameter (2 of 2P rows), a 0-d AdamW ``step``.
For each P it times :func:`~matrixfsdp.tensors.gather.gather_rows` per call (the median of
``--calls``) and counts the collectives, the longest list of tensors handed to one, and the
bytes this rank receives before any data moves (the agreement: P descriptors of 40 bytes
before, one all-reduce of 80 bytes now). A call that raises (on this process group, where
every rank looks like this one, the old descriptor check finds the even share's rows
missing, after its exchange) is timed up to the raise.

    python -m studies.gather_scale [--world-sizes 64 1024 4096 16384] [--calls 100]

prints one JSON line per P.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from matrixfsdp import testing
from matrixfsdp.tensors.gather import gather_rows


def _cases(P: int) -> dict:
    return {"matrix": (torch.randn(64, 64), (64, 64), (0, 0)),
            "even rows": (torch.randn(2, 64), (2 * P, 64), (2 * (P - 1), 0)),
            "step": (torch.tensor(1.0), (), ())}


def measure(P: int, calls: int) -> dict:
    """Rank P - 1 of P: per kind, the median seconds per call and what NCCL would be asked."""
    testing.register("hollow")
    dist.init_process_group("hollow", store=dist.HashStore(), rank=P - 1, world_size=P)
    out: dict = {"world_size": P}
    try:
        for name, (local, shape, offsets) in _cases(P).items():
            times, raised = [], None
            for _ in range(calls):
                testing.COUNTS.reset()
                t0 = time.perf_counter()
                try:
                    gather_rows(local, shape, offsets, name, dist.group.WORLD)
                except RuntimeError as e:
                    raised = str(e).split(",")[0]
                times.append(time.perf_counter() - t0)
            stats = testing.COUNTS
            out[name] = {"ms_per_call": 1e3 * statistics.median(times), "ops": dict(stats.ops),
                         "longest_list": stats.longest_list, "raised": raised}
    finally:
        dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m studies.gather_scale",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    p.add_argument("--calls", type=int, default=100)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    for P in a.world_sizes:
        print(json.dumps(measure(P, a.calls)), flush=True)


if __name__ == "__main__":
    main()
