"""Where ``matrixfsdp train`` starts, and the checkpoint ``--resume`` loads.

Two parts, so that no rank reads a checkpoint before the process group exists (under
torchrun every rank process runs the command's own start-up):

* before any rank starts (:func:`plan_start`: in the launcher, or in each torchrun rank
  before ``init_process_group``), only directory listings: the complete ``step_N``
  candidates, newest first (those without marker or metadata said and skipped), the
  refusal to overwrite a run's checkpoints without ``--resume``;
* in the ranks, the process group up (:func:`start_point`, before the model is built, and
  :func:`load_start`): rank 0 reads the candidate's index and its ``train`` entry, which
  every rank gets in one broadcast; the arguments are compared with the saved ones; the
  load itself has each rank check (checksums, name marks) and read only the files it reads
  (:func:`~matrixfsdp.state.files.load_checkpoint`). A damaged checkpoint is refused
  naming the file and how, the same on every rank (:class:`Refused`: the command's usage
  error, exit status 2), or with ``--resume-fallback`` skipped, saying why, for the next
  older one."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..state import dcp_io
from ..state.files import _step_dirs, find_checkpoints, is_complete, load_checkpoint
from ..state.integrity import CheckpointError, CheckpointTimeout

SHAPE_ARGS = ("model", "layers", "d_model", "heads", "mlp", "seq")  # must match the checkpoint
RESTORED_ARGS = ("lr", "adamw_lr")  # the optimizer and lr schedule state restore the saved ones
NEW_FROM_HERE_ARGS = ("batch", "grad_accum", "steps", "mp", "clip")  # apply from the resume step
SAVED_ARGS = SHAPE_ARGS + RESTORED_ARGS + NEW_FROM_HERE_ARGS + ("seed",)


def saved_args(args) -> dict[str, Any]:
    """The arguments a `train` checkpoint records (compared at ``--resume``)."""
    return {k: getattr(args, k) for k in SAVED_ARGS}


class Refused(Exception):
    """A run refused once its ranks started (the checkpoint to resume is damaged, or was
    saved from another model), raised alike on every rank: said as the command's own usage
    error, ``matrixfsdp train: error: <message>``, exit status 2 (:mod:`.launch`)."""


def read_train_meta(path: Path, process_group=None) -> dict[str, Any]:
    """The ``train`` entry (step, history, arguments) of a `train` checkpoint, on every rank:
    a collective in which rank 0 reads the index and the entry (checked, as any load) and
    every rank gets it in one broadcast; :class:`CheckpointError` naming the file that cannot
    be read, or saying what the entry lacks, the same on every rank."""
    meta = {"train": ""}
    dcp_io.load(meta, Path(path), process_group)
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
    """Before any rank starts: the checkpoints ``--resume`` may load (sets
    ``args.resume_candidates``, the complete ones newest first; the ranks choose among them:
    :func:`start_point`) or ``error`` naming what is wrong. Reads directory listings only
    (no checkpoint file is opened). ``root``: where this run saves."""
    args.resume_from, args.resume_step, args.resume_candidates = None, 0, []
    args.resume_root, args.resume_skipped = str(root), []
    if args.resume is None:
        refuse_overwrite(args, root, error)
        return
    where = Path(args.resume) if args.resume else root
    complete, skipped = find_checkpoints(where)
    looked = [where]  # DIR given: DIR or DIR/checkpoints; none: this run's own <out>/checkpoints
    if args.resume and not complete and not skipped:
        looked.append(where / "checkpoints")
        complete, skipped = find_checkpoints(looked[-1])
    for d, why in skipped:
        say(f"--resume: skipping {d}: {why}")
    if not complete:
        places = " or ".join(str(p) for p in looked)
        if not args.resume_or_start:
            error(f"--resume {args.resume or ''}".rstrip() + f": no complete checkpoint in {places} "
                  "(a step_<N> directory with COMPLETE and .metadata, or such a directory "
                  "itself). Pass --resume-or-start to start from step 0 when there is none")
        say(f"--resume: no complete checkpoint in {places}; --resume-or-start: starting from step 0")
        refuse_overwrite(args, root, error)
        return
    args.resume_candidates, args.resume_where = [str(d) for d in complete], str(where)


def _say(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def _damaged(args, path: str, e: CheckpointError) -> None:
    """``path`` is damaged: refused (without ``--resume-fallback``), else said and skipped."""
    if not args.resume_fallback:
        raise Refused(f"--resume: {e}. Pass --resume-fallback to load the previous complete "
                      "checkpoint instead")
    _say(f"--resume: {e}; --resume-fallback: trying the previous complete checkpoint")
    args.resume_skipped.append(path)


def _refuse(message: str) -> None:
    raise Refused(message)


def start_point(args) -> dict[str, Any]:
    """In every rank, the process group up, before the model is built: the newest candidate
    of :func:`plan_start` whose index and ``train`` entry read (a damaged one refused, or
    skipped with ``--resume-fallback``), the arguments compared with its own (a model of
    another shape refused, its seed adopted), and refused where the run would overwrite
    newer checkpoints. Sets ``args.resume_from`` / ``args.resume_step``; returns the entry
    (``{}`` when the run starts from step 0). Every rank raises the same :class:`Refused`."""
    if not getattr(args, "resume_candidates", None):
        return {}
    first = getattr(args, "resume_from", None) is None
    while args.resume_candidates:
        path = args.resume_candidates.pop(0)
        try:
            meta = read_train_meta(Path(path))
        except CheckpointError as e:
            if isinstance(e, CheckpointTimeout):
                raise
            _damaged(args, path, e)
            continue
        step = int(meta["step"])
        _compare(args, meta.get("args", {}), step, _say if first else (lambda line: None), _refuse)
        gone = {Path(p) for p in args.resume_skipped} | {Path(path)}
        newer = _newer_checkpoints(Path(args.resume_root), step, gone)
        if args.save_every and newer:
            raise Refused(f"--resume: resuming at step {step} of {path}, but {args.resume_root} holds "
                          f"newer checkpoints ({', '.join(d.name for d in newer)}) that this run "
                          "would overwrite. Resume from the newest, or choose another --out")
        args.resume_from, args.resume_step = path, step
        return meta
    if args.resume_skipped:
        raise Refused(f"--resume: no checkpoint under {args.resume_where} can be loaded: each one is "
                      "damaged (above)")
    return {}


def load_start(model, optimizer, extra: dict[str, Any], args) -> dict[str, Any]:
    """Load ``args.resume_from`` (:func:`start_point`) into the model and the optimizer, with
    ``extra`` entries; where the load finds it damaged (a file one rank reads: its checksum,
    its name mark, its size, or a read that fails), refuse, or with ``--resume-fallback`` say
    so and load the next older candidate (checked against the model as above). Returns the
    loaded state."""
    while True:
        try:
            return load_checkpoint(model, optimizer, args.resume_from, extra=dict(extra))
        except CheckpointError as e:
            if isinstance(e, CheckpointTimeout):
                raise
            _damaged(args, args.resume_from, e)
            args.resume_from = None
            if not start_point(args):
                raise Refused(f"--resume: no checkpoint under {args.resume_where} can be loaded: "
                              "each one is damaged (above)") from None
