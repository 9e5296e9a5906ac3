"""``matrixfsdp train``'s command line: its options with their defaults (``--help``) and the
checks of their values before any rank starts, one line each. And the
command itself (:func:`run_train`): the ``--out`` lock taken, the ranks launched."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .launch import DEFAULT_TIMEOUT_S, DefaultsHelp, launch, positive_float
from .loop import checkpoint_root, train
from .outlock import OutInUse, RunLock, lock_out
from .resume import plan_start

DEFAULT_RANKS = 4


def int_at_least(lo: int):
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


def validate_train(tr: argparse.ArgumentParser, args) -> None:
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


def _tau(text: str) -> float:
    """``--qk-clip``: a number > 0, or ``inf`` (record the largest logits, clip nothing)."""
    return math.inf if text.strip().lower() in ("inf", "infinity") else positive_float(text)


def add_train_args(sub) -> argparse.ArgumentParser:
    tr = sub.add_parser("train", allow_abbrev=False, help="train a byte-level model on the stdlib sources",
                        description="Train a byte-level model on the Python standard library's "
                        "sources, on local ranks it starts (gloo on CPU, NCCL with one GPU per "
                        "rank), or in place under torchrun. Every default is shown.",
                        formatter_class=DefaultsHelp)
    pos = int_at_least(1)
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
    tr.add_argument("--lr", type=positive_float, default=0.02, help="Muon's learning rate")
    tr.add_argument("--adamw-lr", type=positive_float, default=3e-3,
                    help="AdamW's learning rate (embeddings, head, norms, biases)")
    tr.add_argument("--per-head", action="store_true",
                    help="per-head Muon: each attention head's block of q/k/v orthogonalised on "
                         "its own (matrixfsdp.muon_param_groups(per_head=True))")
    tr.add_argument("--qk-clip", type=_tau, default=None, metavar="TAU",
                    help="QK-clip (Kimi K2's MuonClip): after each step, shrink W_q/W_k of heads "
                         "whose largest logit exceeded TAU (inf: only record the largest logits)")
    tr.add_argument("--clip", type=positive_float, default=None, metavar="X",
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
    tr.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                    help="process-group timeout: a collective waiting longer fails")
    tr.add_argument("--out", default="runs/train",
                    help="directory for summary.json, loss.png and checkpoints (one run at a time)")
    tr.add_argument("--save-every", type=int_at_least(0), default=0, metavar="N",
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
    tr.add_argument("--rss-every", type=int_at_least(0), default=0, metavar="N",
                    help="record each rank's resident memory (VmRSS) every N steps, into "
                         "summary.json's rss_mib (min, mean, max over the ranks); 0: never")
    return tr


def _lock_out(tr: argparse.ArgumentParser, args, argv: list[str]) -> RunLock | None:
    """One run per ``--out``: the lock of :mod:`.outlock`, taken by the
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
    """The checkpoints ``--resume`` may load, from directory listings (before any rank; the
    ranks choose among them once the process group exists: :mod:`.resume`)."""

    quiet = os.environ.get("RANK", "0") != "0"
    plan_start(args, checkpoint_root(args), tr.error,
               lambda line: None if quiet else print(line, flush=True))


def run_train(tr: argparse.ArgumentParser, args, argv: list[str]) -> None:
    """``matrixfsdp train``, parsed: the values checked, the ``--out`` lock taken, the
    checkpoints to resume from listed, the ranks launched (or, under torchrun, this one)."""
    validate_train(tr, args)
    lock = _lock_out(tr, args, argv)
    try:
        _plan_start(tr, args)
        launch(train, args, args.ranks, args.timeout, held=lock)
    finally:  # ended here (a run in this process: tests); a killed launcher's ends with it
        if lock is not None:
            lock.release()
