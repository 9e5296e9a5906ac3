"""The ``matrixfsdp`` command (``matrixfsdp train | plan | calibrate | bench``, or ``python -m
matrixfsdp``): argument parsing and validation over the layers below it (the training loop
in :mod:`matrixfsdp.train.loop`, the launcher in :mod:`matrixfsdp.train.launch`, the
benchmark in :mod:`matrixfsdp.bench.harness`). The package's command-line face, as
``__init__`` is its API face: the one module above ``train`` and ``bench``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .bench.calibrate import main as calibrate_main
from .bench.config import PRESETS as BENCH_PRESETS
from .bench.harness import main as bench_main
from .planning.advice import SUMMARY_HEAD, Setting, format_search, search_json, summary_row
from .planning.constants import Constants
from .planning.hf_config import config_path, meta_model
from .planning.links import Links
from .planning.model_shapes import ModelShapes, shapes_of
from .planning.search import LLAMA3_TOKENS, default_global_batch, search
from .planning.steptime import Workload
from .planning.traffic import Dtypes
from .runtime.exit import exit_rank
from .train.cluster import DTYPE_BYTES, parse_bytes
from .train.launch import DEFAULT_TIMEOUT_S, DefaultsHelp, launch
from .train.launch import positive_float as _positive_float
from .train.loop import checkpoint_root, train
from .train.models import GPT, PRESETS, GPTConfig
from .train.outlock import OutInUse, RunLock, lock_out
from .train.resume import plan_start

log = logging.getLogger("matrixfsdp")
DEFAULT_RANKS = 4


# ---- plan ---------------------------------------------------------------------------------
def _bench_config(name: str) -> GPTConfig | None:
    """``bench-cpu`` / ``bench-gpu``: the model ``matrixfsdp bench --preset cpu|gpu`` runs."""
    p = BENCH_PRESETS.get(name.removeprefix("bench-")) if name.startswith("bench-") else None
    if p is None:
        return None
    return GPTConfig(vocab_size=256, seq_len=p["seq"], d_model=p["d_model"], n_heads=p["heads"],
                     n_layers=p["layers"], d_mlp=p["mlp"])


PLAN_PRESETS = sorted(PRESETS) + [f"bench-{k}" for k in sorted(BENCH_PRESETS)]


def _plan_model(name: str):
    """(label, model on meta, its units) for a preset name or a transformers config.json."""
    cfg = PRESETS.get(name) or _bench_config(name)
    if cfg is not None:
        with torch.device("meta"):
            net = GPT(cfg)
        return name, net, list(net.layers)
    path = config_path(name)
    if path is None:
        raise SystemExit(f"--model {name}: neither a preset ({', '.join(PLAN_PRESETS)}) nor "
                         "a transformers config.json on disk (a file, or a directory holding one)")
    net, units, label = meta_model(path)
    return label, net, units


def _workload(args, constants: Constants | None, shapes: ModelShapes) -> Workload:
    """The work per rank: the flags' rates, or the ones ``--constants`` measured (at this
    model's matmul and Newton-Schulz shapes, in ``--param-dtype``)."""
    if constants is None:
        return Workload(args.seq, args.micro_batch, args.tflops * 1e12, args.hbm_gbs * 1e9)
    count: dict[tuple[int, int], int] = {(shapes.vocab, shapes.d_model): 1} if shapes.vocab \
        else {}  # the head
    for s in shapes.specs:
        if len(s.shape) == 2 and s.muon:
            count[tuple(s.shape)] = count.get(tuple(s.shape), 0) + 1
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.param_dtype]
    mm, ns = constants.model_rates([(r, c, n) for (r, c), n in count.items()],
                                   args.seq * args.micro_batch, dtype)
    return Workload(args.seq, args.micro_batch, mm, constants.adamw_bytes_per_s, ns_tflops=ns,
                    adamw_hbm=constants.adamw_bytes_per_s, muon_hbm=constants.muon_bytes_per_s)


def _model_matrices(name: str) -> list[tuple[int, int]]:
    """The ``(rows, cols)`` of a model's 2-D weights (``calibrate --model``)."""
    _, net, _ = _plan_model(name)
    return [tuple(p.shape) for p in net.parameters() if p.ndim == 2]


def _plan(args) -> None:
    for n in args.world_size:
        if args.shard_size is not None and n % args.shard_size:
            raise SystemExit(f"--shard-size {args.shard_size} must divide --world-size {n}")
    try:
        constants = Constants.load(args.constants) if args.constants else None
    except ValueError as e:
        raise SystemExit(str(e)) from None
    links = Links(args.gpus_per_node, args.nvlink_gbs * 1e9, args.ib_gbs * 1e9,
                  args.latency_us * 1e-6, args.nvlink_hop_us * 1e-6, args.ib_hop_us * 1e-6,
                  constants=constants)
    dtypes = Dtypes(4, DTYPE_BYTES[args.param_dtype], DTYPE_BYTES[args.reduce_dtype])
    checkpointing = {"auto": (False, True), "on": (True,), "off": (False,)}[
        args.activation_checkpointing]
    global_batch = args.global_batch or default_global_batch(args.seq, args.global_tokens)
    done = []
    for name in args.model:
        label, net, units = _plan_model(name)
        shapes = shapes_of(net, units)
        setting = Setting(links, _workload(args, constants, shapes), dtypes, args.device_memory)
        n_params = sum(p.numel() for p in net.parameters())
        for world in args.world_size:
            found = search(shapes, world, args.device_memory, links=links,
                           workload=setting.workload, dtypes=setting.dtypes,
                           global_batch=global_batch, tp=args.tp, pp=args.pp,
                           shard=[args.shard_size] if args.shard_size else None,
                           checkpointing=checkpointing)
            done.append((label, n_params, shapes.blocks, found, setting))
    if args.json:
        out = [search_json(label, n, s, st) for label, n, _, s, st in done]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=1))
    elif len(done) > 1:
        print("\n".join([*SUMMARY_HEAD, *(summary_row(label, s) for label, _, _, s, _ in done)]))
    else:
        label, n, blocks, s, st = done[0]
        print(format_search(label, n, blocks, s, st, args.top, args.max_rows))


# ---- command line -------------------------------------------------------------------------
def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def writable_dir_error(out: str) -> str | None:
    """Why results cannot be written into directory ``out`` (created if missing), or None.
    Checked before any rank starts, so a bad path does not cost a finished run."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".matrixfsdp-write-check-"):
            pass
    except OSError as e:
        return f"--out {out}: cannot write there ({e.strerror or e})"
    return None


MAX_LR = 10.0  # above this the first step overflows the demo model: said before any rank starts


def checkpoint_dir_error(args) -> str | None:
    """Why ``train`` could not write its checkpoints (``<out>/checkpoints``, the longest
    path it writes tried out), or None."""
    probe = Path(args.out) / "checkpoints" / ".step_00000000.partial"
    try:
        probe.mkdir(parents=True, exist_ok=True)
        (probe / "__0_0.distcp").write_bytes(b"")
        shutil.rmtree(probe)
    except OSError as e:
        return f"--save-every: cannot write checkpoints under {probe.parent} ({e.strerror or e})"
    return None


def _validate_train(tr: argparse.ArgumentParser, args) -> None:
    """Every ``train`` argument checked before any rank starts (one line each, no rank)."""
    if args.d_model % args.heads:
        tr.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.model == "hf-llama":
        if (args.d_model // args.heads) % 2:
            tr.error(f"--model hf-llama needs an even head size for its rotary embedding; "
                     f"--d-model {args.d_model} / --heads {args.heads} = {args.d_model // args.heads}")
        if importlib.util.find_spec("transformers") is None:
            tr.error("--model hf-llama needs transformers (pip install transformers)")
    for flag, lr in (("--lr", args.lr), ("--adamw-lr", args.adamw_lr)):
        if lr > MAX_LR and os.environ.get("RANK", "0") == "0":
            print(f"matrixfsdp train: note: {flag} {lr:g} is above {MAX_LR:g}; the first step will "
                  "likely overflow the weights (--skip-nonfinite skips such steps)", file=sys.stderr)
    if not args.out.strip():
        tr.error("--out must name a directory (it is empty)")
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if torchrun and args.ranks is not None and args.ranks != int(os.environ["WORLD_SIZE"]):
        tr.error(f"--ranks {args.ranks} under torchrun, which runs {os.environ['WORLD_SIZE']} ranks "
                 "(WORLD_SIZE): drop --ranks and set the ranks with torchrun --nproc-per-node")
    args.ranks = args.ranks or DEFAULT_RANKS
    if args.tp > 1:
        world = int(os.environ["WORLD_SIZE"]) if torchrun else args.ranks
        bad = [f"{what} {n}" for what, n in (("ranks", world), ("--heads", args.heads),
                                             ("--mlp", args.mlp)) if n % args.tp]
        if bad:
            tr.error(f"--tp {args.tp} must divide the {', '.join(bad)}")
        if args.model != "gpt":
            tr.error("--tp: only --model gpt has a tensor-parallel plan here (transformers models: "
                     "docs/nd-parallel.md)")
    for needs, flag in ((args.async_save, "--async-save"), (args.keep_last, "--keep-last")):
        if needs and not args.save_every:
            tr.error(f"{flag} needs --save-every N")
    if args.resume_fallback and args.resume is None:
        tr.error("--resume-fallback needs --resume")
    if args.resume and not Path(args.resume).is_dir():
        tr.error(f"--resume {args.resume}: no such directory")


def _lock_out(tr: argparse.ArgumentParser, args, argv: list[str]) -> RunLock | None:
    """One run per ``--out``: the lock of :mod:`matrixfsdp.train.outlock`, taken by the
    process that writes ``--out`` (this launcher; under torchrun, rank 0, which lives as
    long as the run) before anything is written there. Another run holding it: one line,
    exit 2. Then the checks that write into ``--out``."""
    if os.environ.get("RANK", "0") != "0":  # only rank 0 writes (under torchrun too)
        return None
    try:
        lock = lock_out(args.out, ["matrixfsdp", *argv])
    except OutInUse as e:
        print(f"{tr.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as e:
        tr.error(f"--out {args.out}: cannot write there ({e.strerror or e})")
    if lock.unsupported:
        print(f"{tr.prog}: note: --out {args.out}: no file lock there ({lock.unsupported}); "
              "another run on this directory would not be refused", file=sys.stderr)
    try:
        problem = writable_dir_error(args.out) or (checkpoint_dir_error(args) if args.save_every else None)
        if problem:
            tr.error(problem)
    except BaseException:
        lock.release()
        raise
    return lock


def _plan_start(tr: argparse.ArgumentParser, args) -> None:
    """Which checkpoint ``--resume`` loads and what differs from it (before any rank)."""

    quiet = os.environ.get("RANK", "0") != "0"
    plan_start(args, checkpoint_root(args), tr.error,
               lambda line: None if quiet else print(line, flush=True))


def _bench_out_error(rest: list[str]) -> str | None:
    """``--out`` of ``bench`` (its default too) checked before its ranks start."""
    if "-h" in rest or "--help" in rest:
        return None
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--out", default="runs/bench")  # harness.parse_args's default
    known, _ = pre.parse_known_args(rest)
    return writable_dir_error(known.out)


def _tau(text: str) -> float:
    """``--qk-clip``: a number > 0, or ``inf`` (record the largest logits, clip nothing)."""
    return math.inf if text.strip().lower() in ("inf", "infinity") else _positive_float(text)


def _add_train_args(sub) -> argparse.ArgumentParser:
    tr = sub.add_parser("train", help="train a byte-level model on the stdlib sources",
                        description="Train a byte-level model on the Python standard library's "
                        "sources, on local ranks it starts (gloo on CPU, NCCL with one GPU per "
                        "rank), or in place under torchrun. Every default is shown.",
                        formatter_class=DefaultsHelp)
    pos = _int_at_least(1)
    tr.add_argument("--ranks", type=pos, default=None,
                    help=f"local ranks to start (default {DEFAULT_RANKS}; under torchrun, its own, "
                         "WORLD_SIZE; --world-size is another name for it)")
    tr.add_argument("--world-size", dest="ranks", type=pos, default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS)  # bench's and plan's spelling
    tr.add_argument("--steps", type=pos, default=60, help="optimizer steps")
    tr.add_argument("--model", choices=("gpt", "hf-llama"), default="gpt",
                    help="gpt: matrixfsdp.train.models.GPT; hf-llama: a randomly initialised "
                         "transformers LlamaForCausalLM of the same sizes (needs transformers)")
    tr.add_argument("--tp", type=pos, default=1, metavar="N",
                    help="tensor parallelism over N ranks (torchtitan's plan: Colwise q/k/v/fc, "
                         "Rowwise o/proj), fully_shard over the ranks / N data-parallel ones")
    tr.add_argument("--layers", type=pos, default=4, help="transformer blocks")
    tr.add_argument("--d-model", type=pos, default=128, help="model width")
    tr.add_argument("--heads", type=pos, default=4, help="attention heads")
    tr.add_argument("--mlp", type=pos, default=512, help="MLP hidden width")
    tr.add_argument("--seq", type=pos, default=128, help="tokens (bytes) per sequence")
    tr.add_argument("--batch", type=pos, default=8, help="sequences per rank per micro-batch")
    tr.add_argument("--grad-accum", type=pos, default=1, metavar="K",
                    help="micro-batches per step, each backward of loss / K")
    tr.add_argument("--lr", type=_positive_float, default=0.02, help="Muon's learning rate")
    tr.add_argument("--adamw-lr", type=_positive_float, default=3e-3,
                    help="AdamW's learning rate (embeddings, head, norms, biases)")
    tr.add_argument("--per-head", action="store_true",
                    help="per-head Muon: each attention head's block of q/k/v orthogonalised on "
                         "its own (matrixfsdp.muon_param_groups(per_head=True))")
    tr.add_argument("--qk-clip", type=_tau, default=None, metavar="TAU",
                    help="QK-clip (Kimi K2's MuonClip): after each step, shrink W_q/W_k of heads "
                         "whose largest logit exceeded TAU (inf: only record the largest logits)")
    tr.add_argument("--clip", type=_positive_float, default=None, metavar="X",
                    help="clip gradients to global norm X (matrixfsdp.clip_grad_norm_)")
    tr.add_argument("--debug", action="store_true",
                    help="before each collective, check every rank is at the same step, unit and "
                         "phase; raise naming the diverging rank (one extra tiny collective each)")
    tr.add_argument("--skip-nonfinite", action="store_true",
                    help="skip the optimizer step on every rank when the global gradient norm "
                         "is NaN/inf, and log which gradients were not finite")
    tr.add_argument("--mp", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    tr.add_argument("--activation-checkpointing", action="store_true",
                    help="recompute each block's activations in backward")
    tr.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    tr.add_argument("--timeout", type=_positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                    help="process-group timeout: a collective waiting longer fails")
    tr.add_argument("--out", default="runs/train",
                    help="directory for summary.json, loss.png and checkpoints (one run at a time)")
    tr.add_argument("--save-every", type=_int_at_least(0), default=0, metavar="N",
                    help="save a checkpoint (torch.distributed.checkpoint, by parameter name) every N "
                         "steps and at the last step, into <out>/checkpoints/step_<N>; a directory is "
                         "complete or ignored")
    tr.add_argument("--async-save", action="store_true",
                    help="with --save-every: stage each checkpoint to CPU memory and write it in the "
                         "background (torch.distributed.checkpoint.async_save) while training goes on")
    tr.add_argument("--keep-last", type=pos, default=None, metavar="N",
                    help="with --save-every: keep the newest N complete checkpoints, deleting older "
                         "ones once a newer one is committed")
    tr.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                    help="continue from the latest complete checkpoint in DIR or DIR/checkpoints "
                         "(without DIR: <out>/checkpoints), saved at any --ranks, its checksums "
                         "verified; none there is an error")
    tr.add_argument("--resume-or-start", action="store_true",
                    help="with --resume: start from step 0 when there is no checkpoint")
    tr.add_argument("--resume-fallback", action="store_true",
                    help="with --resume: if the newest checkpoint is damaged (its checksums, its "
                         ".metadata, a shard or CHECKSUMS.json missing, a load that fails), load the "
                         "newest one that loads, saying which it skipped and why, instead of stopping")
    tr.add_argument("--rss-every", type=_int_at_least(0), default=0, metavar="N",
                    help="record each rank's resident memory (VmRSS) every N steps, into "
                         "summary.json's rss_mib (min, mean, max over the ranks); 0: never")
    return tr


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(prog="matrixfsdp", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = _add_train_args(sub)
    pos = _int_at_least(1)
    pl = sub.add_parser("plan", help="advise a layout (replicate x shard x tp x pp) for a model "
                        "on a cluster: the fitting one with the lowest modelled step time, next "
                        "to FSDP2 + torch.optim.Muon and DistMuon (docs/plan.md)")

    def size(text: str) -> int:
        try:
            return parse_bytes(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    real = _positive_float
    pl.add_argument("--model", nargs="+", default=["paper"], metavar="NAME|CONFIG",
                    help=f"a preset ({', '.join(PLAN_PRESETS)}) or a transformers config.json "
                         "on disk (or its directory); several models and/or world sizes: one "
                         "summary row each")
    pl.add_argument("--world-size", nargs="+", type=pos, default=[8])
    pl.add_argument("--shard-size", type=pos, default=None,
                    help="search only this HSDP shard size (default: every divisor)")
    pl.add_argument("--tp", nargs="+", type=pos, default=None,
                    help="search only these tensor-parallel sizes (default: up to a node)")
    pl.add_argument("--pp", nargs="+", type=pos, default=None,
                    help="search only these pipeline sizes (default: powers of two up to 16)")
    pl.add_argument("--device-memory", type=size, default="80GiB",
                    help="memory per device; a layout whose largest rank needs more is never "
                         "advised while one fits (default 80GiB)")
    pl.add_argument("--param-dtype", choices=("fp32", "bf16"), default="bf16",
                    help="dtype of the gathers and gather buffers (MixedPrecisionPolicy "
                         "param_dtype; default bf16); storage and optimizer state stay fp32")
    pl.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="dtype of the gradient reduce (MixedPrecisionPolicy reduce_dtype)")
    pl.add_argument("--seq", type=pos, default=8192, help="tokens per sequence (default 8192)")
    pl.add_argument("--micro-batch", type=pos, default=1,
                    help="sequences per micro-batch per data-parallel rank (default 1)")
    pl.add_argument("--global-batch", type=pos, default=None,
                    help="sequences per step (default: --global-tokens / --seq)")
    pl.add_argument("--global-tokens", type=pos, default=LLAMA3_TOKENS,
                    help="tokens per step when --global-batch is not given (default 2^24, "
                         "Llama 3's 16M)")
    pl.add_argument("--constants", default=None, metavar="FILE",
                    help="rates and collective costs measured by `matrixfsdp calibrate` "
                         "(replace --tflops, --hbm-gbs and the latency and bandwidth of "
                         "groups inside a node)")
    pl.add_argument("--activation-checkpointing", choices=("auto", "on", "off"), default="auto",
                    help="auto: search both")
    pl.add_argument("--tflops", type=real, default=400.0,
                    help="bf16 TFLOP/s reached by the matmuls and Newton-Schulz (default 400)")
    pl.add_argument("--hbm-gbs", type=real, default=3350.0,
                    help="memory bandwidth for the element-wise optimizer updates, GB/s")
    pl.add_argument("--gpus-per-node", type=pos, default=8)
    pl.add_argument("--nvlink-gbs", type=real, default=450.0,
                    help="NVLink GB/s per GPU and direction (default 450: H100 SXM)")
    pl.add_argument("--ib-gbs", type=real, default=50.0,
                    help="InfiniBand GB/s per GPU and direction (default 50)")
    pl.add_argument("--latency-us", type=real, default=14.0,
                    help="base latency per collective, microseconds (NCCL's LL128 ring: 14)")
    pl.add_argument("--nvlink-hop-us", type=real, default=1.9,
                    help="latency per ring step inside a node (NCCL's LL128: 1.9)")
    pl.add_argument("--ib-hop-us", type=real, default=4.0,
                    help="latency per ring step across nodes (NCCL's LL128: 4.0)")
    pl.add_argument("--json", action="store_true",
                    help="print the advice and every layout searched as JSON")
    pl.add_argument("--top", type=pos, default=12, help="layouts shown in the table")
    pl.add_argument("--max-rows", type=_int_at_least(1), default=16)
    bp = sub.add_parser("bench", help="benchmark against FSDP2 peers (see --help)", add_help=False)
    sub.add_parser("calibrate", help="measure this machine's constants for plan --constants "
                   "(see --help)", add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "calibrate":
        return calibrate_main(rest, _model_matrices)
    if args.cmd == "bench":
        problem = _bench_out_error(rest)
        if problem:
            bp.error(problem)
        return bench_main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "train":
        _validate_train(tr, args)
        lock = _lock_out(tr, args, sys.argv[1:] if argv is None else argv)
        try:
            _plan_start(tr, args)
            launch(train, args, args.ranks, args.timeout, held=lock)
        finally:  # ended here (a run in this process: tests); a killed launcher's ends with it
            if lock is not None:
                lock.release()
    else:
        _plan(args)
    return 0


def run() -> None:
    """The ``matrixfsdp`` command (and ``python -m matrixfsdp``): :func:`main`, then leave
    without interpreter finalization, which takes seconds with torch loaded (about 3 s here
    after a failed run), so that a failure ends the command in about a second."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    if isinstance(code, str):  # SystemExit("message"): as Python prints it, exit status 1
        print(code, file=sys.stderr)
        code = 1
    exit_rank(0 if code is None else int(code))


if __name__ == "__main__":
    run()
