"""What NCCL would have been asked by the test process groups of this process
(:mod:`matrixfsdp.testing`): launches, ops and bytes by collective kind."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Counts:
    """Since the last :meth:`reset`: ``launches`` and ``ops`` by kind (a coalesced group is
    one launch, counted as ``coalesced``, and each op it holds counts under its kind; an
    all-gather / reduce-scatter over parts of different sizes is NCCL's group of one
    broadcast / reduce per part: P ops), ``payload`` (bytes handed over: an all-gather's
    output, any other op's input), ``longest_list`` (the most tensors one call was handed)
    and ``gather_input_bytes`` (the largest input this rank handed one gather)."""

    launches: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)
    payload: Counter = field(default_factory=Counter)
    longest_list: int = 0
    gather_input_bytes: int = 0

    def reset(self) -> None:
        self.launches.clear()
        self.ops.clear()
        self.payload.clear()
        self.longest_list = self.gather_input_bytes = 0

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    def op(self, kind: str, ops: int = 1, payload: int = 0, tensors: int = 1,
           launch: bool = True) -> None:
        """Count ``ops`` ops of ``kind``, and a launch of its own unless inside a coalesced
        group (``launch`` False)."""
        self.ops[kind] += ops
        self.payload[kind] += payload
        self.longest_list = max(self.longest_list, tensors)
        if launch:
            self.launches[kind] += 1


COUNTS = Counts()  # every test process group of this process counts here
