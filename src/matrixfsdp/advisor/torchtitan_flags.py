"""The planner's advice as torchtitan flags (``matrixfsdp plan ... --torchtitan``): the
command line of torchtitan's own trainer on MatrixFSDP (``--module
matrixfsdp.integrations.torchtitan``) for the advised layout, and what of the advice
torchtitan's flags cannot say."""

from __future__ import annotations

from .evaluated import Evaluated

#: torchtitan's ``--parallelism.pipeline_parallel_schedule`` for the planner's schedules
SCHEDULE_NAMES = {"1F1B": "1F1B", "interleaved 1F1B": "Interleaved1F1B",
                  "interleaved zero bubble": "InterleavedZeroBubble"}


def torchtitan_args(e: Evaluated, config: str, seq: int, global_batch: int) -> list[str]:
    """torchtitan 0.3.0's arguments (after ``-m torchtitan.train``) for layout ``e`` of a
    model whose torchtitan config function is ``config``: the parallel degrees, the batch
    (``global_batch`` sequences of ``seq`` tokens; the local batch one micro-batch of a
    data-parallel rank) and activation checkpointing, which torchtitan applies to every
    block or none (``full`` where the advice checkpoints any)."""
    lay = e.layout
    dp = lay.replicate * lay.shard
    local = global_batch // (dp * e.micro_batches)
    args = ["--module", "matrixfsdp.integrations.torchtitan", "--config", config,
            "--parallelism.data_parallel_replicate_degree", str(lay.replicate),
            "--parallelism.data_parallel_shard_degree", str(lay.shard),
            "--parallelism.tensor_parallel_degree", str(lay.tp),
            "--parallelism.pipeline_parallel_degree", str(lay.pp)]
    if lay.pp > 1:
        args += ["--parallelism.pipeline_parallel_schedule", SCHEDULE_NAMES[lay.schedule.name]]
    args += ["--training.seq_len", str(seq), "--training.global_batch_size", str(global_batch),
             "--training.local_batch_size", str(local)]
    return args + ["activation_checkpoint:" + ("full" if sum(e.checkpointed) else "none")]


def torchtitan_text(e: Evaluated, config: str, seq: int, global_batch: int,
                    gpus_per_node: int) -> str:
    """The command, one flag per line, and what it leaves out of the advice."""
    world = e.layout.replicate * e.layout.shard * e.layout.tp * e.layout.pp
    nodes = max(1, world // gpus_per_node)
    args = torchtitan_args(e, config, seq, global_batch)
    flags = []
    i = 0
    while i < len(args):  # "--flag value" pairs on one line each
        if args[i].startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            flags.append(f"{args[i]} {args[i + 1]}")
            i += 2
        else:
            flags.append(args[i])
            i += 1
    lines = [f"torchrun --nnodes {nodes} --nproc-per-node {min(world, gpus_per_node)} "
             "--rdzv-backend c10d --rdzv-endpoint HOST:29500 -m torchtitan.train \\",
             *(f"    {f} \\" for f in flags[:-1]), f"    {flags[-1]}", ""]
    notes = []
    blocks, ac = e.blocks, sum(e.checkpointed)
    if 0 < ac < blocks:
        notes.append(f"activation checkpointing: the advice checkpoints {ac} of {blocks} blocks; "
                     "torchtitan checkpoints every block or none, so `full` (more recompute than "
                     "modelled: `matrixfsdp plan ... --activation-checkpointing on` models it)")
    if e.keep != "each":
        notes.append("units kept gathered (the advice's `" + e.keep + "`): torchtitan's "
                     "`--parallelism.fsdp_reshard_after_forward` sets every unit alike; the "
                     "advice's per-unit calls are in the report above (a script of your own)")
    if e.layout.tp > 1:
        notes.append("tp placement: `convert(config, tp_ownership=\"auto\")`, the one line's "
                     "default, places each tp-split matrix as planned")
    if e.layout.pp > 1:
        notes.append("pipeline parallelism: torchtitan 0.3.0 calls `schedule.step(arg_mbs=...)`, "
                     "which torch 2.13 lacks (docs/torchtitan.md)")
    return "\n".join(lines + [f"* {n}" for n in notes])
