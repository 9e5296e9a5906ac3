"""How long a collective takes on a two-level cluster: NVLink inside a node, InfiniBand
between nodes, NCCL's algorithms and their latency terms.

Pure arithmetic (seconds from bytes). Ranks are numbered as torchtitan builds its mesh,
``(pp, replicate, shard, tp)`` with tp innermost, ``gpus_per_node`` consecutive ranks per
node, so a group is ``size`` ranks ``stride`` apart (:class:`Group`).

* **Bandwidth.** A group inside one node runs at ``nvlink`` bytes/s per GPU. A group over
  several nodes with ``k`` of its ranks per node runs at ``min(k x ib, nvlink)``: NCCL
  spreads its rings over the node's ``k`` NICs (its bus bandwidth), so a 1-D ring over
  whole nodes moves at 8 x 50 = 400 GB/s per GPU and a replicate group with one rank per
  node at one NIC's 50 GB/s.
* **Latency** (NCCL's ``src/graph/tuning.cc`` model): a base per collective plus one hop
  latency per ring step, NVLink hops for steps inside a node and network hops for the
  ``nodes - 1`` steps across nodes (all-reduce: twice). Defaults are NCCL's LL128 ring
  figures (base 14 us, NVLink hop 1.9 us, network hop 4 us).
* **Algorithms.** All-gather and reduce-scatter: ring, ``(P-1)/P`` of the buffer through
  every rank. All-reduce: the faster of ring (``2 (P-1)/P``) and tree (``2x`` the buffer,
  latency ``2 ((k-1) NVLink + log2(nodes) network)`` hops). Broadcast and reduce: a ring
  pipeline (every rank moves the buffer once; ``P - 1`` hops to fill it, paid by each
  broadcast: they run one after the other on the group's stream). All-to-all (the tp hop,
  DistMuon's gathers): the busiest rank's ``max(sent, received)``, through its own NIC
  across nodes. Point-to-point (pipeline stages): one hop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Links:
    """The cluster: GPUs per node, per-GPU bandwidths (bytes/s, each direction) and the
    latency terms (seconds). Flags of ``matrixfsdp plan``."""

    gpus_per_node: int = 8
    nvlink: float = 900e9
    ib: float = 50e9
    base_latency: float = 14e-6
    nvlink_hop: float = 1.9e-6
    ib_hop: float = 4e-6

    def describe(self) -> str:
        return (f"{self.gpus_per_node} GPUs per node, NVLink {self.nvlink / 1e9:g} GB/s and "
                f"InfiniBand {self.ib / 1e9:g} GB/s per GPU and direction; latency "
                f"{self.base_latency * 1e6:g} us per collective + {self.nvlink_hop * 1e6:g} us "
                f"per NVLink hop, {self.ib_hop * 1e6:g} us per network hop")


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


@dataclass(frozen=True)
class GroupCost:
    """One group's bandwidth (bytes/s) and latencies (seconds) on ``links``, computed once:
    every collective time is then a multiply-add (``ring`` for all-gather / reduce-scatter,
    ``pipeline`` for broadcast / reduce, ``all_reduce``, ``all_to_all``)."""

    size: int
    bw: float
    nic: float  # one rank's own injection bandwidth (an all-to-all's busiest rank)
    lat_ring: float
    lat_all_reduce_ring: float
    lat_tree: float
    base: float

    @classmethod
    def of(cls, group: Group, links: Links) -> GroupCost:
        g, P = links.gpus_per_node, group.size
        nodes, k = group.nodes(g), group.per_node(g)
        bw = links.nvlink if nodes == 1 else min(k * links.ib, links.nvlink)
        nic = links.nvlink if nodes == 1 else links.ib
        hops = links.base_latency + (P - nodes) * links.nvlink_hop + (nodes - 1) * links.ib_hop
        ar = (links.base_latency + 2 * (P - nodes) * links.nvlink_hop
              + 2 * (nodes - 1) * links.ib_hop)
        tree = links.base_latency + 2 * ((k - 1) * links.nvlink_hop
                                         + math.ceil(math.log2(nodes)) * links.ib_hop)
        return cls(P, bw, nic, hops, ar, tree, links.base_latency)

    def ring(self, nbytes: float) -> float:
        """All-gather (``nbytes``: the gathered buffer) or reduce-scatter (its input)."""
        if self.size <= 1 or nbytes <= 0:
            return 0.0
        return self.lat_ring + nbytes * (self.size - 1) / self.size / self.bw

    def grouped(self, busiest: float) -> float:
        """An uneven all-gather or reduce-scatter whose most loaded rank moves ``busiest``
        bytes: one launch (NCCL runs its broadcasts / reduces as one group, concurrently:
        one ring fill), then the busiest rank's bytes."""
        if self.size <= 1 or busiest <= 0:
            return 0.0
        return self.lat_ring + busiest / self.bw

    def all_reduce(self, nbytes: float) -> float:
        """The faster of NCCL's ring and tree all-reduce of an ``nbytes`` buffer."""
        if self.size <= 1 or nbytes <= 0:
            return 0.0
        ring = self.lat_all_reduce_ring + 2 * nbytes * (self.size - 1) / self.size / self.bw
        return min(ring, self.lat_tree + 2 * nbytes / self.bw)

    def all_to_all(self, busiest: float) -> float:
        """An all-to-all whose busiest rank sends or receives ``busiest`` bytes (through its
        own NIC across nodes)."""
        if self.size <= 1 or busiest <= 0:
            return 0.0
        return self.base + busiest / self.nic


def p2p_time(nbytes: float, crosses_nodes: bool, links: Links) -> float:
    """One send between neighbouring pipeline stages."""
    if nbytes <= 0:
        return 0.0
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
