"""One layout the search weighs and what it costs: the layout (``(replicate, shard, tp, pp)``,
its activation checkpointing and pipeline schedule), its memory, bytes and step seconds,
ours and the peers', and the words and ``--json`` record the report makes of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..costs.steptime import ONE_STAGE, PipelineSchedule, StepTime
from ..layout.types import Plan

KEYS = ("replicate", "shard", "tp", "pp", "largest_rank_bytes", "device_memory_bytes", "fits",
        "model_state_max_over_mean", "critical_bytes_vs_fsdp2", "owner_floor",
        "replicate_bytes_vs_fsdp2_hsdp", "ns_vs_bound", "step_seconds", "fsdp2_step_seconds",
        "bound", "checkpointed_blocks", "mfu", "vs_compute_floor", "tp_placements",
        "keep")


#: activation checkpointing per layout: none, the fewest blocks that fit (each system its
#: own), every block
AC_MODES = ("off", "fit", "all")
SYSTEMS = ("matrixfsdp", "fsdp2_torch_muon", "distmuon")


def ac_mode(ac: bool | str) -> str:
    if isinstance(ac, bool):
        return "all" if ac else "off"
    if ac not in AC_MODES:
        raise ValueError(f"activation checkpointing: one of {AC_MODES}, got {ac!r}")
    return ac


@dataclass(frozen=True)
class Layout:
    """A layout searched: ``(replicate, shard, tp, pp)``, its activation checkpointing
    (``"off"``, ``"fit"``: the fewest blocks that fit, ``"all"``) and pipeline schedule."""

    replicate: int
    shard: int
    tp: int
    pp: int
    checkpointing: bool | str = "fit"
    schedule: PipelineSchedule = ONE_STAGE

    def label(self, ac: str = "") -> str:
        sched = f" ({self.schedule.name})" if self.pp > 1 else ""
        return f"{self.replicate} x {self.shard} x tp {self.tp} x pp {self.pp}{sched}{ac}"


def keep_text(keep: str, m: int) -> str:
    """Which units a step keeps gathered, in words (``keep``:
    :data:`~matrixfsdp.costs.passes.KEEPS`; ``m`` micro-batches)."""
    if keep == "each":
        return "every unit gathered each micro-batch"
    if keep == "root":
        return "root gathered once per step"
    if m == 1:
        return "first and last blocks kept from forward to backward"
    return "root and first block gathered once per step, last block kept"


def ac_text(checkpointed: Sequence[int], blocks: int, keep: str = "each", m: int = 1) -> str:
    """``", AC 34/126 blocks"`` (or ``", AC"`` where every block is checkpointed), and
    which units stay gathered (:func:`keep_text`)."""
    k = sum(checkpointed)
    ac = "" if not k else ", AC" if k == blocks else f", AC {k}/{blocks} blocks"
    return ac + ("" if keep == "each" or (keep == "root" and m == 1) else
                 ", " + keep_text(keep, m))


@dataclass
class Evaluated:
    """One layout's costs: memory of its largest rank, bytes per step (critical path)
    against FSDP2's at the same layout, NS against its bound, step seconds (ours, FSDP2 +
    torch.optim.Muon, DistMuon), each system with the blocks it checkpoints."""

    layout: Layout
    micro_batches: int
    state_max: float
    state_mean: float
    buffers: float
    activations: float
    device_memory: float
    critical_bytes: float
    fsdp2_critical_bytes: float
    floor_bytes: float  # the whole-matrix floor's critical bytes at this layout
    replicate_bytes: float
    fsdp2_replicate_bytes: float
    ns_max: float
    ns_bound: float
    step: StepTime
    fsdp2: StepTime
    distmuon: StepTime | None  # None: DistMuon refuses this layout (tp > 1, pp > 1)
    fsdp2_memory: float = 0.0  # FSDP2 + torch.optim.Muon's largest rank
    distmuon_memory: float = 0.0  # DistMuon's: FSDP2's and its two bucket slots' buffers
    launches: int = 0  # process-group launches per step of the slowest stage (data-parallel)
    fsdp2_launches: int = 0
    ops: int = 0  # the NCCL ops those launches hold
    distmuon_blocks: int = 0  # DistMuon's fastest bucket size (blocks per bucket)
    busiest_matrix: tuple[str, tuple[int, int], float] = ("", (0, 0), 0.0)  # NS FLOPs
    plan: Plan | None = field(default=None, repr=False)  # stage 0's plan
    blocks: int = 0  # the model's blocks
    checkpointed: tuple[int, ...] = ()  # per stage: its first blocks checkpointed (ours)
    fsdp2_checkpointed: tuple[int, ...] = ()
    distmuon_checkpointed: tuple[int, ...] = ()
    keep: str = "each"  # ours: the units kept gathered (passes.KEEPS)
    floor: float = 0.0  # the compute floor (seconds)
    mfu_scale: float = 0.0  # the matmul rate over the GPU's dense peak
    tp_placements: dict[str, int] = field(default_factory=dict)  # "group" / "rank": matrices
    tp_by_name: dict[str, str] = field(default_factory=dict)  # generic name -> placement
    runtime_default_agrees: bool = True  # fully_shard's auto (its default rates) places alike
    ns_comm: float = 0.0  # of the NS seconds: the busiest tp group's all-reduces

    @property
    def largest_rank_bytes(self) -> float:
        return self.state_max + self.buffers + self.activations

    @property
    def fits(self) -> bool:
        return self.largest_rank_bytes <= self.device_memory

    @property
    def owner_floor(self) -> float:
        """The least critical-path bytes this layout's placements can move, over FSDP2's: at
        1-D ``P/(P-1)`` on the matrices (a rank receives all of a unit's matrices, where an
        FSDP2 rank holds ``1/P``); with tp, each unit's largest matrix held whole on one tp
        rank sends ``(T-1)/T`` of it across the tp hop (one its tp group owns: nothing);
        with replicas, it is reduced to and broadcast from its owner replica whole (a slice
        where its tp group owns it)."""
        return self.floor_bytes / self.fsdp2_critical_bytes if self.fsdp2_critical_bytes \
            else 1.0

    @property
    def distmuon_feasible(self) -> bool:
        return self.distmuon is not None

    @property
    def bytes_ratio(self) -> float:
        return self.critical_bytes / self.fsdp2_critical_bytes if self.fsdp2_critical_bytes \
            else 1.0

    def step_of(self, system: str) -> StepTime | None:
        return {"matrixfsdp": self.step, "fsdp2_torch_muon": self.fsdp2,
                "distmuon": self.distmuon}[system]

    def checkpointed_of(self, system: str) -> tuple[int, ...]:
        return {"matrixfsdp": self.checkpointed, "fsdp2_torch_muon": self.fsdp2_checkpointed,
                "distmuon": self.distmuon_checkpointed}[system]

    def label(self, system: str = "matrixfsdp") -> str:
        """The layout, the blocks ``system`` checkpoints, and ours' root once per step."""
        return self.layout.label(ac_text(self.checkpointed_of(system), self.blocks,
                                         self.keep if system == "matrixfsdp" else "each",
                                         self.micro_batches))

    def mfu(self, system: str = "matrixfsdp") -> float | None:
        """Model FLOPs utilisation of ``system``'s step against the GPU's dense peak: the
        step's model FLOPs (3x forward, no recompute) over its seconds on every GPU."""
        st = self.step_of(system)
        return self.floor * self.mfu_scale / st.total if st and st.total else None

    def record(self) -> dict:
        """The ``--json`` keys (:data:`KEYS`) and a few more."""
        lay = self.layout
        rep = (self.replicate_bytes / self.fsdp2_replicate_bytes
               if self.fsdp2_replicate_bytes else None)
        out = {"replicate": lay.replicate, "shard": lay.shard, "tp": lay.tp, "pp": lay.pp,
               "schedule": lay.schedule.name if lay.pp > 1 else None,
               "largest_rank_bytes": round(self.largest_rank_bytes),
               "device_memory_bytes": round(self.device_memory), "fits": self.fits,
               "model_state_max_over_mean": self.state_max / self.state_mean
               if self.state_mean else 1.0,
               "critical_bytes_vs_fsdp2": self.bytes_ratio, "owner_floor": self.owner_floor,
               "replicate_bytes_vs_fsdp2_hsdp": rep,
               "ns_vs_bound": self.ns_max / self.ns_bound if self.ns_bound else 1.0,
               "step_seconds": self.step.total, "fsdp2_step_seconds": self.fsdp2.total,
               "bound": self.step.bound, "checkpointed_blocks": sum(self.checkpointed),
               "mfu": self.mfu(), "vs_compute_floor": self.step.total / self.floor
               if self.floor else None, "tp_placements": dict(self.tp_placements),
               "keep": self.keep}
        out.update({"activation_checkpointing": sum(self.checkpointed) > 0,
                    "checkpointing_mode": ac_mode(lay.checkpointing),
                    "checkpointed_blocks_per_stage": list(self.checkpointed),
                    "blocks": self.blocks, "micro_batches": self.micro_batches,
                    "critical_path": self.step.path,
                    "tp_placement_by_matrix": dict(self.tp_by_name),
                    "tp_ownership_runtime_default_agrees": self.runtime_default_agrees,
                    "ns_tp_all_reduce_seconds": self.ns_comm,
                    "distmuon_step_seconds": self.distmuon.total if self.distmuon else None,
                    "fsdp2_bound": self.fsdp2.bound, "fsdp2_mfu": self.mfu("fsdp2_torch_muon"),
                    "fsdp2_checkpointed_blocks": sum(self.fsdp2_checkpointed),
                    "distmuon_bound": self.distmuon.bound if self.distmuon else None,
                    "distmuon_mfu": self.mfu("distmuon"),
                    "distmuon_checkpointed_blocks": sum(self.distmuon_checkpointed)
                    if self.distmuon else None,
                    "fsdp2_largest_rank_bytes": round(self.fsdp2_memory),
                    "fsdp2_fits": self.fsdp2_memory <= self.device_memory,
                    "distmuon_largest_rank_bytes": round(self.distmuon_memory)
                    if self.distmuon else None,
                    "distmuon_fits": self.distmuon_feasible
                    and self.distmuon_memory <= self.device_memory,
                    "model_state_bytes": round(self.state_max),
                    "buffer_bytes": round(self.buffers),
                    "activation_bytes": round(self.activations),
                    "critical_bytes": round(self.critical_bytes),
                    "fsdp2_critical_bytes": round(self.fsdp2_critical_bytes),
                    "breakdown": self.step.as_dict(), "fsdp2_breakdown": self.fsdp2.as_dict(),
                    "distmuon_breakdown": self.distmuon.as_dict() if self.distmuon else None,
                    "launches_per_step": self.launches, "fsdp2_launches_per_step":
                    self.fsdp2_launches, "ops_per_step": self.ops,
                    "distmuon_blocks_per_bucket": self.distmuon_blocks or None,
                    "busiest_matrix": {"name": self.busiest_matrix[0],
                                       "shape": list(self.busiest_matrix[1]),
                                       "ns_flops": self.busiest_matrix[2]}})
        return out
