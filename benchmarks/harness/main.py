"""``matrixfsdp bench``: MatrixFSDP against FSDP2 + peer Muon optimizers, side by side.

One invocation launches ``world_size`` local ranks (forked from a preloaded server,
``file://`` rendezvous; gloo on CPU, NCCL with one GPU per rank when CUDA is available)
and runs every selected system, one after the other inside the same ranks, on the same
model (same seed), the same per-rank token batches, the same world size and the same
hyperparameters:

=====================  ================================================================
``fsdp2_adamw``        FSDP2 (``fully_shard`` per block, then root) + ``torch.optim.AdamW``
``fsdp2_torch_muon``   FSDP2 + ``torch.optim.Muon`` on the DTensor matrices (+ AdamW)
``fsdp2_dist_muon``    FSDP2 + torchtitan ``DistMuon`` (+ AdamW)
``fsdp2_muon_fsdp2``   FSDP2 + ``muon_fsdp2.Muon``
``matrixfsdp``         ``matrixfsdp.fully_shard`` per block, then root + ``matrixfsdp.Muon``
``fsdp2_soap``         (only with ``--systems``) FSDP2 + SOAP on gathered whole matrices
``matrixfsdp_soap``    (only with ``--systems``) MatrixFSDP + SOAP on the owners' matrices
=====================  ================================================================

The two SOAP systems (``benchmarks/harness/matrix_systems.py``) compare with each other for exactness.

Muon matrices for the peers are the ones MatrixFSDP's default rule selects (2-D weights
inside the blocks, from ``plan_module``); everything else gets AdamW. Each system gets its
own fresh model and its own process group, which its collectives and the harness's
per-phase barriers use (so a peer that fails mid-step cannot desynchronise the next
system), and ``warmup + steps + 1`` training steps:

* ``warmup`` untimed steps (FSDP2 lazy init, muon-fsdp2's ``torch.compile``, optimizer
  state creation);
* ``steps`` timed steps;
* one profiled step (not timed) for the collective counts and the memory accounting.

A peer that raises is recorded as ``"does not run here: <exception>"`` with the exact
error text, and the benchmark goes on with the other systems.

What is measured (units in the names: ``_ms`` milliseconds, ``_mib`` 2**20 bytes)
---------------------------------------------------------------------------------
Time
    Each phase -- ``forward`` (``model.loss``), ``backward`` (``loss.backward()``),
    ``step`` (``optimizer.step()`` then ``zero_grad(set_to_none=True)``) -- starts after a
    barrier on the system's group so all ranks start it together, and is timed on every rank with
    ``time.perf_counter`` (wall) and ``time.process_time`` (CPU time of the whole rank
    process, all threads: the communication threads' work counts). On CUDA the device is
    synchronised before reading the clocks. ``total`` is the time from the aligned start
    of ``forward`` to the end of ``step`` on that rank, so it includes the two barriers in
    between (the wait for the slowest rank after each phase). Reported: median, min and
    max over all measured steps of all ranks, and the per-rank medians.

Collectives (:func:`.measure.collective_payload_bytes`, identical for every system)
    ``torch.profiler`` (CPU activity, ``record_shapes=True``) around the profiled step,
    with one ``record_function`` range per phase. Every *outermost* dispatcher op in the
    ``c10d::`` namespace whose start lies in a phase range is one call of that phase (the
    process-group level: functional collectives and DTensor redistribution end up there,
    and ops issued from any thread are attributed by time). The harness's own barriers
    lie outside the ranges. Bytes per call, from the recorded argument shapes and dtypes,
    are the size of the whole (unsharded) buffer the collective works on, as this rank
    sees it:

    * all-gather family (``_allgather_base_``, ``allgather_``, ``allgather_coalesced_``,
      ``allgather_into_tensor_coalesced_``) and ``gather_``: group size x this rank's
      input tensor(s) (= the all-gather output);
    * reduce-scatter family (``_reduce_scatter_base_``, ``reduce_scatter_``,
      ``reduce_scatter_tensor_coalesced_``) and ``scatter_``: group size x this rank's
      output tensor(s) (= the reduce-scatter input). The group is the world, or under
      HSDP the shard group (where every system's all-gathers and reduce-scatters run);
    * all-to-all (``alltoall_base_``, ``alltoall_``): this rank's input tensor (what it
      sends, its own part included); with uneven splits this varies by rank, and its
      mean over ranks is the size of the gathered buffer;
    * ``allreduce_``, ``allreduce_coalesced_``, ``broadcast_``, ``reduce_``, ``send``,
      ``recv_``, ``recv_any_source_``: the tensor(s) passed (under HSDP these are the
      replicate-dim collectives, tabled separately with their bytes on the wire: a ring
      all-reduce of n bytes sends 2n(R-1)/R per rank, a reduce or broadcast n(R-1)/R);
    * ``barrier`` / ``monitored_barrier_``: 0 bytes; any other ``c10d::`` op: its first
      argument's tensor(s), and its name is listed under ``unknown_ops``.

    The table shows the mean over ranks of calls and bytes per phase.
    MatrixFSDP's own counter (``matrixfsdp.comm_stats``) is reported separately per phase
    as a cross-check.

Memory per rank
    CUDA: ``torch.cuda.max_memory_allocated`` over the timed steps. CPU, where the
    allocator keeps no statistics: ``peak_mib = live_at_start_mib + transient_peak_mib``,
    where ``live_at_start_mib`` is the size of all distinct tensor storages reachable by
    Python's garbage collector at the start of the profiled step that were not alive
    before this system was built (sharded parameters, optimizer state, persistent
    communication buffers; the token batches and earlier systems' leftovers are
    excluded), and ``transient_peak_mib`` is the high-water mark, during the profiled
    step, of the running sum of the CPU allocator's allocations minus frees recorded by
    ``torch.profiler(profile_memory=True)`` (gradients, unsharded parameters, activations,
    collective buffers, NS temporaries). ``state_mib`` is, for information, the distinct
    storages of parameters + gradients + optimizer state right after ``optimizer.step()``.
    The table shows the maximum over ranks.

Exactness
    After all steps, every Muon system's full parameters (``DTensor.full_tensor()`` /
    ``matrixfsdp.full_state_dict``) are compared on rank 0 with the reference (the first
    Muon system that ran, normally ``fsdp2_torch_muon``): max abs difference over all
    parameters. Muon systems differ only by bf16 Newton-Schulz rounding, so an element
    further than :data:`.config.EXACT_BOUND` (5e-3, absolute; plus
    :data:`.config.EXACT_ULPS` roundings of the parameter dtype at its size) is flagged as a
    failure: that bound is 6x the differences seen and 5x below what skipping the Muon
    step moves (the reasoning is in ``config.py``).

Machine
    ``results.json["machine"]`` and the table's "Machine:" line, as rank 0 sees it
    (:func:`~matrixfsdp.train.machine.machine_info`): CPU model, the ISA torch dispatches to, whether bf16
    matmuls run on AMX, logical CPUs, torch threads per rank and ``OMP_NUM_THREADS``, GPU.

MatrixFSDP balance
    ``plan_of(model).imbalance`` / ``.imbalance_bound`` (NS FLOP cost, max rank / mean);
    the per-rank median optimizer-step CPU time and its spread (max/min over ranks); and
    ``ns_limit_ms``: every rank times, concurrently, ``zeropower_via_newtonschulz`` in
    bf16 on random matrices of the shapes it owns (median of :data:`.measure.NS_REPS`
    repetitions after one warm-up); the maximum over ranks is the time no exact
    owner-computes step can beat on this machine with this plan. ``ns_limit_cpu_ms`` is the same in process
    CPU time, to compare with the step's CPU time when other load shares the cores.

HSDP (``--replicas R``)
    Every system on an ``(R, world / R)`` mesh, ``mesh_dim_names=("replicate", "shard")``:
    FSDP2's HSDP for the FSDP2 systems (all-reduce of every gradient shard across replicas,
    the optimizer on every replica), MatrixFSDP's (reduce to the owner replica, NS once in
    the world, broadcast back in the next forward). Only the systems of
    :data:`.config.HSDP_SYSTEMS` run: DistMuon and muon-fsdp2 take 1-D meshes.

``matrixfsdp bench --link ...`` runs the link-speed sweep of ``benchmarks/parallel/link.py`` instead, and
``matrixfsdp bench --tp ...`` the tensor-parallel byte count of ``benchmarks/parallel/tp.py`` (MatrixFSDP
dp x tp against FSDP2 + TP, docs/nd-parallel.md), and ``matrixfsdp bench --ep ...`` the
expert-parallel one of ``benchmarks/parallel/ep.py`` (against FSDP2 + EP).

Outputs in ``--out``: ``results.json`` (everything), ``results.md`` (the tables, also
printed), ``phases.png`` (stacked forward/backward/step medians; skipped with a warning
when matplotlib is missing).

Code, in ``benchmarks/harness/``: ``config.py`` (settings, presets, system names),
``systems.py`` (building each system; ``peers.py`` the peer optimizers), ``run.py`` (what
each rank does, in order), ``measure.py`` (clocks, barriers, memory, profiler analysis and
payload rule, NS limit, exactness), ``report.py`` (results entries, tables, plot, files). This file
is the entry point: arguments, rank launch, outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict

import torch

from matrixfsdp.train.launch import DefaultsHelp, positive_float
from matrixfsdp.train.rank_process import ranks_started

from ..parallel.ep import main as ep_main
from ..parallel.link import main as link_main
from ..parallel.tp import main as tp_main
from .config import (
    EXACT_BOUND,
    HSDP_SYSTEMS,
    OPTIONAL_SYSTEMS,
    PG_TIMEOUT_S,
    PRESETS,
    SYSTEMS,
    BenchConfig,
)
from .report import write_results
from .run import rank_main


def _rank(rank: int, from_launcher, cfg: BenchConfig, init_file: str, result_file: str) -> None:
    """One bench rank, forked from the preloaded server (:mod:`..train.rank_process`)."""
    from_launcher.adopt()
    rank_main(rank, cfg, init_file, result_file)


def parse_args(argv: list[str] | None) -> BenchConfig:
    """The run's settings from the command line (``matrixfsdp bench --help``); errors exit
    through ``argparse`` before any rank starts."""
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="matrixfsdp bench", formatter_class=DefaultsHelp,
        description="MatrixFSDP vs FSDP2 + AdamW / torch Muon / DistMuon / muon-fsdp2, "
                    "side by side on local ranks. Three other benchmarks share the command: "
                    "--link, --tp and --ep (each with its own --help).")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model/batch preset (default: cpu; gpu = bf16, d_model 2048, 16 layers, "
                        "MLP 8192, seq 2048, needs CUDA)")
    p.add_argument("--ranks", dest="world_size", type=int, default=None, metavar="N",
                   help="ranks (default: 4 on CPU, the GPU count with CUDA; --world-size is "
                        "another name for it)")
    p.add_argument("--world-size", dest="world_size", type=int, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the earlier spelling
    p.add_argument("--steps", type=int, default=5, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system first")
    p.add_argument("--systems", default=None,
                   help=f"comma list out of {','.join(SYSTEMS + OPTIONAL_SYSTEMS)} (default: "
                        f"{','.join(SYSTEMS)}; with --replicas: {','.join(HSDP_SYSTEMS)})")
    p.add_argument("--replicas", type=int, default=1, metavar="R",
                   help="HSDP: run every system on a (R, ranks / R) (replicate, shard) mesh")
    p.add_argument("--out", default="runs/bench", help="output directory")
    modes = p.add_argument_group("other benchmarks of the same command (each its own options: "
                                 "matrixfsdp bench --link 1 --help, --tp --help, --ep --help)")
    modes.add_argument("--link", metavar="GB/S,...", default=None,
                       help="step time against modelled link speeds, overlap on and off, FSDP2 "
                            "under the same link (benchmarks/parallel/link.py; its default --out runs/link)")
    modes.add_argument("--tp", action="store_true",
                       help="dp x tp bytes against FSDP2 + TP, same run (benchmarks/parallel/tp.py; "
                            "its default --out runs/bench_tp)")
    modes.add_argument("--ep", action="store_true",
                       help="expert-parallel bytes against FSDP2 + EP, same run "
                            "(benchmarks/parallel/ep.py; its default --out runs/bench_ep)")
    p.add_argument("--timeout", type=positive_float, default=PG_TIMEOUT_S, metavar="SECONDS",
                   help=f"process-group timeout (default {PG_TIMEOUT_S})")
    p.add_argument("--backend", choices=["gloo", "grouped_gloo"], default=None,
                   help="CPU ranks' process groups: gloo (default), or grouped_gloo, gloo with "
                        "NCCL's uneven all-gather / reduce-scatter (MatrixFSDP takes NCCL's "
                        "path: one call per unit and direction); CUDA runs NCCL")
    p.add_argument("--mp", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: every system gathers and computes in bf16 and reduces in fp32 "
                        "(torch's MixedPrecisionPolicy), fp32 master weights")
    for flag, dest in (("--layers", "layers"), ("--d-model", "d_model"), ("--heads", "heads"),
                       ("--mlp", "mlp"), ("--seq", "seq"), ("--batch", "batch")):
        p.add_argument(flag, dest=dest, type=int, default=None,
                       help=f"default: the preset's ({PRESETS['cpu'][dest]} in cpu, "
                            f"{PRESETS['gpu'][dest]} in gpu)")
    a = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    preset = a.preset or "cpu"
    if preset == "gpu" and not cuda:
        p.error("--preset gpu needs CUDA")
    if cuda and a.backend is not None:
        p.error("--backend is for CPU ranks; CUDA runs NCCL")
    default = SYSTEMS if a.replicas == 1 else HSDP_SYSTEMS
    known = default + OPTIONAL_SYSTEMS if a.replicas == 1 else HSDP_SYSTEMS
    systems = [s.strip() for s in (a.systems or ",".join(default)).split(",") if s.strip()]
    unknown = [s for s in systems if s not in known]
    if unknown or not systems:
        hsdp = f" with --replicas {a.replicas} (HSDP)" if a.replicas > 1 else ""
        p.error(f"systems {unknown} do not run{hsdp}; choose from {','.join(known)}")
    world = a.world_size or (torch.cuda.device_count() if cuda else 4)
    if world < 1 or (cuda and world > torch.cuda.device_count()):
        p.error(f"--ranks {world}: need 1..{torch.cuda.device_count() if cuda else 'N'} "
                "(one GPU per rank)")
    if a.replicas < 1 or world % a.replicas:
        p.error(f"--replicas {a.replicas} must be >= 1 and divide --ranks {world}")
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    sizes = {k: (v if getattr(a, k, None) is None else getattr(a, k))
             for k, v in PRESETS[preset].items()}
    if sizes["d_model"] % sizes["heads"]:
        p.error(f"--d-model {sizes['d_model']} is not divisible by --heads {sizes['heads']}")
    return BenchConfig(world_size=world, steps=a.steps, warmup=a.warmup,
                       systems=[s for s in known if s in systems], out=a.out, preset=preset,
                       device_type="cuda" if cuda else "cpu",
                       backend="nccl" if cuda else a.backend or "gloo",
                       timeout_s=a.timeout, mp=a.mp, replicas=a.replicas,
                       **sizes)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write ``results.json``, ``results.md``, ``phases.png`` into
    ``--out`` and print the table. Returns 0, or 1 if a rank crashed outside a system.
    With ``--link``: the step-time-against-link-speed sweep of :mod:`.link` instead; with
    ``--tp``: tensor parallelism's bytes against FSDP2 + TP (:mod:`.tp`); with ``--ep``:
    expert parallelism's against FSDP2 + EP (:mod:`.ep`)."""
    if any(a == "--link" or a.startswith("--link=") for a in (argv or [])):
        return link_main(argv)
    if "--tp" in (argv or []):
        return tp_main(argv)
    if "--ep" in (argv or []):
        return ep_main(argv)
    cfg = parse_args(argv)
    os.makedirs(cfg.out, exist_ok=True)
    if cfg.device_type == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    started = time.time()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="matrixfsdp_bench_") as tmp:
        result_file = os.path.join(tmp, "systems.json")
        try:
            with ranks_started(_rank, (cfg, os.path.join(tmp, "init"), result_file),
                               cfg.world_size) as ranks:
                while not ranks.join():
                    pass
        except Exception as e:  # a rank died outside the per-system error handling
            print(f"matrixfsdp bench: a rank failed: {e}", file=sys.stderr)
            return 1
        with open(result_file) as f:
            ranks = json.load(f)
    systems = ranks["systems"]
    results = {
        "config": asdict(cfg), "device": cfg.device_type, "torch": torch.__version__,
        "machine": ranks["machine"],
        "started_unix": started, "wall_s": time.perf_counter() - t0,
        "exact_bound": EXACT_BOUND, "method": __doc__, "systems": systems,
    }
    md = write_results(results, cfg.out)
    print(md)
    print(f"total wall time {results['wall_s']:.1f} s; results in {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
