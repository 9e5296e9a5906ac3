"""How long a collective takes on a two-level cluster: NVLink inside a node, InfiniBand
between nodes, NCCL's algorithms and their latency terms, each op charged on its own.

Pure arithmetic (seconds from bytes). Ranks are numbered as torchtitan builds its mesh,
``(pp, replicate, shard, tp)`` with tp innermost, ``gpus_per_node`` consecutive ranks per
node, so a group is ``size`` ranks ``stride`` apart (:class:`Group`).

* **Launches and ops.** A *launch* is one call the host issues and waits for; it holds one
  or more NCCL *ops*. Where the group coalesces (NCCL: one ``ncclGroupStart`` /
  ``ncclGroupEnd``) a unit's gather is one launch of ``1 + holders`` ops; elsewhere (gloo)
  each op is its own launch. A launch costs ``base_latency`` once; each op its own latency
  at its group's size (below) plus its most loaded rank's bytes over the group's bandwidth
  (ops of one launch share the links, so their bytes add up).
* **Bandwidth.** A group inside one node runs at ``nvlink`` bytes/s per GPU and direction
  (H100 SXM: 450 GB/s, NVLink 4's 900 GB/s counted both ways). A group over several nodes
  with ``k`` of its ranks per node runs at ``min(k x ib, nvlink)``: NCCL spreads its rings
  over the node's ``k`` NICs, so a 1-D ring over whole nodes moves at 8 x 50 = 400 GB/s
  per GPU and a replicate group with one rank per node at one NIC's 50 GB/s.
* **Latency per op** (NCCL's ``src/graph/tuning.cc``: a base per launch, then one hop
  latency per pipeline step, NVLink hops inside a node and network hops across; defaults
  its LL128 ring figures, base 14 us, NVLink hop 1.9 us, network hop 4 us). All-gather,
  reduce-scatter, broadcast and reduce: a ring of ``P - 1`` steps (``nodes - 1`` of them
  across nodes); a broadcast / reduce is pipelined along it, so it pays the same fill.
  All-reduce: the faster of ring (``2 (P - 1)`` steps, twice the ring's bytes) and tree
  (``2 ((k-1) NVLink + log2(nodes) network)`` hops, twice the buffer). All-to-all (the tp
  hop, DistMuon's gathers): one hop, then the busiest rank's ``max(sent, received)``
  through its own NIC across nodes. Point-to-point (pipeline stages): one hop.
* **Measured constants** (``matrixfsdp calibrate``, :mod:`~matrixfsdp.costs.constants`):
  a group inside one node no larger than the largest measured takes each op's measured
  latency and bandwidth at its size and the measured launch cost; whether groups coalesce
  comes from the measurement too. Larger groups keep the model above.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .constants import OP_KINDS, Constants


@dataclass(frozen=True)
class Links:
    """The cluster: GPUs per node, per-GPU bandwidths (bytes/s, each direction), the latency
    terms (seconds), whether process groups coalesce ops into one launch, and optionally
    the constants ``matrixfsdp calibrate`` measured. Flags of ``matrixfsdp plan``."""

    gpus_per_node: int = 8
    nvlink: float = 450e9
    ib: float = 50e9
    base_latency: float = 14e-6
    nvlink_hop: float = 1.9e-6
    ib_hop: float = 4e-6
    coalesced: bool = True
    constants: Constants | None = field(default=None, compare=False)

    def describe(self) -> str:
        text = (f"{self.gpus_per_node} GPUs per node, NVLink {self.nvlink / 1e9:g} GB/s and "
                f"InfiniBand {self.ib / 1e9:g} GB/s per GPU and direction; latency "
                f"{self.base_latency * 1e6:g} us per launch + {self.nvlink_hop * 1e6:g} us per "
                f"NVLink hop, {self.ib_hop * 1e6:g} us per network hop of each op")
        if self.constants is not None:
            text += (f"; groups inside a node of up to {self.constants.largest_group} ranks: "
                     f"{self.constants.describe()}")
        return text

    @property
    def coalesces(self) -> bool:
        return self.constants.coalesced if self.constants is not None else self.coalesced


@dataclass(frozen=True)
class Group:
    """``size`` ranks, ``stride`` world ranks apart, starting at a node boundary."""

    size: int
    stride: int

    def per_node(self, g: int) -> int:
        """How many of its ranks share a node."""
        return 1 if self.stride >= g else min(self.size, max(1, g // self.stride))

    def nodes(self, g: int) -> int:
        return -(-self.size // self.per_node(g))

    def link(self, g: int) -> str:
        """The link its bytes travel on: ``"nvl"`` inside one node, ``"ib"`` across."""
        return "nvl" if self.nodes(g) == 1 else "ib"


Op = tuple[str, float]  # (kind, its most loaded rank's bytes)


@dataclass(frozen=True)
class GroupCost:
    """One group's costs on ``links``, computed once: per op kind its own latency
    (seconds) and bandwidth (bytes/s of its most loaded rank), the cost of one launch, and
    whether ops coalesce into one launch. Every collective time is then a multiply-add."""

    size: int
    launch: float
    coalesced: bool
    lat: dict[str, float]
    bw: dict[str, float]
    tree_lat: float = math.inf  # all-reduce by tree (NCCL picks the faster): latency
    tree_bw: float = 0.0

    @classmethod
    def of(cls, group: Group, links: Links) -> GroupCost:
        g, P = links.gpus_per_node, group.size
        nodes, k = group.nodes(g), group.per_node(g)
        c = links.constants
        if c is not None and nodes == 1 and P <= c.largest_group:
            fits = {kind: c.op(kind, P) for kind in OP_KINDS}
            if all(fits.values()):
                return cls(P, c.launch, c.coalesced, {kd: f.latency for kd, f in fits.items()},
                           {kd: f.bandwidth for kd, f in fits.items()})
        bw = links.nvlink if nodes == 1 else min(k * links.ib, links.nvlink)
        nic = links.nvlink if nodes == 1 else links.ib
        ring = (P - nodes) * links.nvlink_hop + (nodes - 1) * links.ib_hop
        lat = dict.fromkeys(("all_gather", "reduce_scatter", "broadcast", "reduce"), ring)
        lat["all_reduce"] = 2 * ring
        lat["all_to_all"] = links.nvlink_hop if nodes == 1 else links.ib_hop
        band = dict.fromkeys(OP_KINDS, bw)
        band["all_to_all"] = nic
        tree = 2 * ((k - 1) * links.nvlink_hop + math.ceil(math.log2(nodes)) * links.ib_hop)
        return cls(P, links.base_latency, links.coalesces, lat, band, tree, bw)

    def op(self, kind: str, busiest: float) -> float:
        """One op inside a launch: its own latency, then its most loaded rank's bytes."""
        if self.size <= 1 or busiest <= 0:
            return 0.0
        t = self.lat[kind] + busiest / self.bw[kind]
        if kind == "all_reduce" and self.tree_bw:  # a tree moves twice the buffer, 2n
            t = min(t, self.tree_lat + busiest * self.size / (self.size - 1) / self.tree_bw)
        return t

    def launches(self, ops: int) -> int:
        """Launches ``ops`` ops of one unit and direction take here."""
        return (1 if ops else 0) if self.coalesced else ops

    def ops(self, ops: Sequence[Op]) -> float:
        """Seconds of one unit's ops in one direction, issued together (one launch where
        the group coalesces, else one each)."""
        ops = [o for o in ops if o[1] > 0]
        if self.size <= 1 or not ops:
            return 0.0
        return self.launches(len(ops)) * self.launch + sum(self.op(k, b) for k, b in ops)

    def single(self, kind: str, busiest: float) -> float:
        """One op in a launch of its own."""
        return self.ops([(kind, busiest)])

    def ring(self, nbytes: float) -> float:
        """An all-gather (``nbytes``: the gathered buffer) or reduce-scatter (its input)."""
        return self.single("all_gather", nbytes * (self.size - 1) / self.size)

    def all_reduce(self, nbytes: float) -> float:
        """NCCL's all-reduce of an ``nbytes`` buffer (ring or tree, the faster)."""
        return self.single("all_reduce", 2 * nbytes * (self.size - 1) / self.size)

    def all_to_all(self, busiest: float) -> float:
        """An all-to-all whose busiest rank sends or receives ``busiest`` bytes."""
        return self.single("all_to_all", busiest)


def p2p_time(nbytes: float, crosses_nodes: bool, links: Links) -> float:
    """One send between neighbouring pipeline stages (measured: a 2-rank broadcast)."""
    if nbytes <= 0:
        return 0.0
    c = links.constants
    if c is not None and not crosses_nodes and c.op("broadcast", 2):
        f = c.op("broadcast", 2)
        return c.launch + f.latency + nbytes / f.bandwidth
    hop, bw = (links.ib_hop, links.ib) if crosses_nodes else (links.nvlink_hop, links.nvlink)
    return links.base_latency + hop + nbytes / bw


@dataclass(frozen=True)
class Mesh:
    """A layout's groups: ``(pp, replicate, shard, tp)`` ranks, tp innermost."""

    pp: int
    replicate: int
    shard: int
    tp: int

    @property
    def tp_group(self) -> Group:
        return Group(self.tp, 1)

    @property
    def shard_group(self) -> Group:
        return Group(self.shard, self.tp)

    @property
    def replicate_group(self) -> Group:
        return Group(self.replicate, self.shard * self.tp)

    @property
    def replica_group(self) -> Group:
        """The ``shard x tp`` ranks of one replica (contiguous)."""
        return Group(self.shard * self.tp, 1)

    def pp_crosses_nodes(self, g: int) -> bool:
        return self.replicate * self.shard * self.tp >= g

    def costs(self, links: Links) -> MeshCost:
        return MeshCost(GroupCost.of(self.tp_group, links), GroupCost.of(self.shard_group, links),
                        GroupCost.of(self.replicate_group, links),
                        GroupCost.of(self.replica_group, links),
                        self.shard_group.link(links.gpus_per_node),
                        self.replicate_group.link(links.gpus_per_node))


@dataclass(frozen=True)
class MeshCost:
    """The groups of a :class:`Mesh` costed on a cluster, and the links the shard and
    replicate groups travel on (``"nvl"`` or ``"ib"``)."""

    tp: GroupCost
    shard: GroupCost
    replicate: GroupCost
    replica: GroupCost
    shard_link: str
    replicate_link: str
