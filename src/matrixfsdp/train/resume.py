"""Where ``matrixfsdp train`` starts, decided before any rank starts: which checkpoint
``--resume`` loads (complete, checksums and DCP's metadata verified and its own entry read,
a damaged one refused naming the file and how, the newest skipped ones reported, an earlier
one only with ``--resume-fallback``), how the arguments differ from the saved run's, and
that the run will not overwrite checkpoints it did not write."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..state.dcp_io import load_alone
from ..state.files import _step_dirs, find_checkpoints, is_complete
from ..state.integrity import CheckpointError, verify_checkpoint

SHAPE_ARGS = ("model", "layers", "d_model", "heads", "mlp", "seq")  # must match the checkpoint
RESTORED_ARGS = ("lr", "adamw_lr")  # the optimizer and lr schedule state restore the saved ones
NEW_FROM_HERE_ARGS = ("batch", "grad_accum", "steps", "mp", "clip")  # apply from the resume step
SAVED_ARGS = SHAPE_ARGS + RESTORED_ARGS + NEW_FROM_HERE_ARGS + ("seed",)


def saved_args(args) -> dict[str, Any]:
    """The arguments a `train` checkpoint records (compared at ``--resume``)."""
    return {k: getattr(args, k) for k in SAVED_ARGS}


def read_train_meta(path: Path) -> dict[str, Any]:
    """The ``train`` entry (step, history, arguments) of a `train` checkpoint, read in this
    process without a process group; :class:`CheckpointError` naming the file that cannot
    be read, or saying what the entry lacks."""
    meta = {"train": ""}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load_alone(meta, Path(path))
    try:
        found = json.loads(meta["train"])
        int(found["step"])
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} is damaged: its 'train' entry (step and history) "
                              f"is not what a save writes ({type(e).__name__}: {e}); refusing to "
                              "load it") from None
    return found


def _newer_checkpoints(root: Path, step: int, bad: set[Path]) -> list[Path]:
    return sorted(d for n, d in _step_dirs(root) if n > step and is_complete(d) and d not in bad)


def refuse_overwrite(args, root: Path, error: Callable[[str], Any]) -> None:
    """Without ``--resume``: a run that saves into ``root`` that already holds checkpoints
    would replace them; refuse, naming the folder."""
    if not args.save_every:
        return
    held = sorted(d for _, d in _step_dirs(root) if is_complete(d))
    if held:
        error(f"--out {args.out} already holds checkpoints ({root}: {held[0].name} .. "
              f"{held[-1].name}); this run would overwrite them. Pass --resume to continue from "
              "the newest, or choose another --out")


def _pick(args, where: Path, say: Callable[[str], None], error
          ) -> tuple[Path | None, dict[str, Any], set[Path]]:
    """The newest complete checkpoint under ``where`` (or ``where/checkpoints``) that is not
    damaged (its checksums, DCP's metadata and the files it names: ``verify_checkpoint``;
    its ``train`` entry read), with that entry; an older one only with ``--resume-fallback``,
    each one skipped said with why."""
    complete, skipped = find_checkpoints(where)
    if not complete and not skipped:
        complete, skipped = find_checkpoints(where / "checkpoints")
    for d, why in skipped:
        say(f"--resume: skipping {d}: {why}")
    bad: set[Path] = set()
    for d in complete:
        try:
            verify_checkpoint(d)
            return d, read_train_meta(d), bad
        except CheckpointError as e:
            if not args.resume_fallback:
                error(f"--resume: {e}. Pass --resume-fallback to load the previous complete "
                      "checkpoint instead")
            say(f"--resume: {e}; --resume-fallback: trying the previous complete checkpoint")
            bad.add(d)
    if complete:
        error(f"--resume: no checkpoint under {where} can be loaded: each one is damaged (above)")
    if not args.resume_or_start:
        error(f"--resume {args.resume or where}: no complete checkpoint in {where} or "
              f"{where / 'checkpoints'} (a step_<N> directory with COMPLETE and .metadata, or such "
              "a directory itself). Pass --resume-or-start to start from step 0 when there is none")
    return None, {}, bad


def _compare(args, saved: dict[str, Any], step: int, say, error) -> None:
    """Report how ``args`` differ from the checkpoint's; the model's shape must match, and
    the saved seed wins so that the data order continues."""
    shape = [f"--{k.replace('_', '-')} {getattr(args, k)} (checkpoint: {saved[k]})"
             for k in SHAPE_ARGS if k in saved and saved[k] != getattr(args, k)]
    if shape:
        error("--resume: the model differs from the checkpoint's: " + ", ".join(shape))
    if "seed" in saved and saved["seed"] != args.seed:
        say(f"--resume: --seed {args.seed} differs from the checkpoint's {saved['seed']}; using "
            f"{saved['seed']} so that the data order continues where it was")
        args.seed = saved["seed"]
    for k in RESTORED_ARGS:
        if k in saved and saved[k] != getattr(args, k):
            say(f"--resume: --{k.replace('_', '-')} {getattr(args, k)} differs from the "
                f"checkpoint's {saved[k]}; the checkpoint's is used (the optimizer and lr "
                "schedule state are restored)")
    for k in NEW_FROM_HERE_ARGS:
        if k in saved and saved[k] != getattr(args, k):
            say(f"--resume: --{k.replace('_', '-')} {getattr(args, k)} differs from the "
                f"checkpoint's {saved[k]}; the new value applies from step {step} on")


def plan_start(args, root: Path, error: Callable[[str], Any], say: Callable[[str], None]) -> None:
    """Decide where the run starts (sets ``args.resume_from`` and ``args.resume_step``, and
    ``args.seed`` to the saved one) or ``error`` naming what is wrong. ``root``: where this
    run saves."""
    args.resume_from, args.resume_step = None, 0
    if args.resume is None:
        refuse_overwrite(args, root, error)
        return
    where = Path(args.resume) if args.resume else root
    found, meta, bad = _pick(args, where, say, error)
    if found is None:
        say(f"--resume: no complete checkpoint in {where}; --resume-or-start: starting from step 0")
        refuse_overwrite(args, root, error)
        return
    step = int(meta["step"])
    _compare(args, meta.get("args", {}), step, say, error)
    newer = _newer_checkpoints(root, step, bad | {found})
    if args.save_every and newer:
        error(f"--resume: resuming at step {step} of {found}, but {root} holds newer checkpoints "
              f"({', '.join(d.name for d in newer)}) that this run would overwrite. Resume from "
              "the newest, or choose another --out")
    args.resume_from, args.resume_step = str(found), step
