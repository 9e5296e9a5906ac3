"""Debug mode: every rank checks that all ranks are about to issue the same collective.

Collectives pair up by order alone, so ranks that take different paths through the model
(one skips a block, one stops early) either hang until the process group's timeout or,
worse, pair a gather of one unit with a gather of another. With ``fully_shard(root,
debug=True)`` each gather and reduce is preceded by a tiny all-gather of the signature
``(step, unit, phase, elements, layout)`` (the collective's size and a checksum of where
each parameter's pieces live: these differ when ranks built, shaped or froze the model
differently, since frozen parameters are planned and reduced differently); every rank
compares all signatures and raises the same error, naming each rank's position, when they
differ, and raises after ``timeout`` seconds when some rank never arrives. Off by default:
it adds one small collective per collective.
Under HSDP the check runs over every rank of the 2-D mesh (the shard groups and the
replicate groups all pair up by order), once per unit before each phase, the replicate
reduce and broadcast included.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import all_gather_single

PHASES = ("forward gather", "backward gather", "gradient reduce",
          "replicate reduce", "replicate broadcast")
FORWARD_GATHER, BACKWARD_GATHER, REDUCE, REPLICATE_REDUCE, REPLICATE_BROADCAST = range(5)


class CollectiveCheck:
    """Compares ``(step, unit index, phase, elements, layout checksum)`` across the ranks
    of ``group`` (the whole mesh)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, unit_names: list[str],
                 timeout: float = 30.0):
        self.group = group
        self.device = device
        self.unit_names = unit_names
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.step = 0  # backward passes completed

    def describe(self, sig: list[int]) -> str:
        step, unit, phase, numel, digest = sig
        size = f" of {numel} elements, layout {digest:08x}" if numel else ""
        return f"step {step}, unit '{self.unit_names[unit]}', {PHASES[phase]}{size}"

    def __call__(self, unit: int, phase: int, numel: int = 0, digest: int = 0) -> None:
        mine = [self.step, unit, phase, numel, digest]
        sig = torch.tensor(mine, dtype=torch.int64, device=self.device)
        out = torch.empty(self.world_size * len(mine), dtype=torch.int64, device=self.device)
        work = all_gather_single(out, sig, group=self.group, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 - the backend's own timeout error, re-raised
            raise RuntimeError(
                f"matrixfsdp debug: rank {self.rank} waited {self.timeout:.0f} s at "
                f"{self.describe(mine)} and some rank never issued a collective (it left the "
                "training loop early, or hangs outside MatrixFSDP)") from e
        rows = out.view(self.world_size, len(mine)).tolist()
        if any(r != rows[0] for r in rows):
            where = "; ".join(f"rank {r}: {self.describe(s)}" for r, s in enumerate(rows))
            raise RuntimeError("matrixfsdp debug: ranks diverged, they are about to issue "
                               f"different collectives ({where}). Every rank must run the same "
                               "sharded modules in the same order each step; a different size "
                               "or layout means the ranks built, shaped or froze the model "
                               "differently (frozen parameters are planned and reduced apart)")
