"""Checkpoints keyed by parameter name.

* :func:`full_state_dict` / :func:`load_full_state_dict`: full tensors on every rank, for
  plain files and Hugging Face (``matrixfsdp.save_pretrained``).
* :func:`get_state_dict` / :func:`set_state_dict`: for ``torch.distributed.checkpoint``
  (DCP). Values are :class:`~matrixfsdp.dcp.RowShard` s, each carrying its place in the full
  tensor: every element is written once (a matrix and its momentum by the owner, row shards
  and their AdamW moments by the rank holding them), and a load at another world size reads
  the pieces this rank's new placement needs. The optimizer state is keyed by parameter
  name, as in torch's ``get_state_dict``.
* :func:`save_checkpoint` / :func:`latest_checkpoint`: a checkpoint directory is complete
  or ignored (written under a temporary name, renamed by rank 0 once every rank is done);
  ``async_save=True`` stages to CPU and writes and commits in the background.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from .comm import gather_v
from .dcp import RowShard, RowShardStager
from .optim_checkpoint import Optimizers, as_list, load_optim_state, local_piece, optim_state_dict
from .param import placement_of
from .plan import Placement
from .runtime import Root, get_root


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter name -> full tensor (and buffers), on every rank.

    A collective: every rank must call it (under HSDP it first broadcasts the matrices
    stepped since the last forward, so every replica returns the same). Names are those of
    the unsharded model, so the result loads into a plain ``nn.Module`` with
    ``load_state_dict``.
    """
    root = get_root(model)
    root.sync_replicas()  # HSDP: every replica holds the stepped matrices (no-op otherwise)
    out: dict[str, torch.Tensor] = {}
    for unit in root.units:
        lay = unit.layout
        flat = unit.local.new_empty(lay.numel)
        gather_v(unit.local, flat, lay.seg_sizes, root.group)
        for pl, pieces in zip(lay.placements, lay.pieces):
            spec = pl.spec
            full = flat.new_empty(spec.numel)
            rows = full.view(spec.rows, spec.row_numel)
            for pc in pieces:
                rows[pc.row_start:pc.row_stop].view(-1).copy_(flat[pc.offset:pc.offset + pc.numel])
            out[spec.name] = full.view(spec.shape)
    # The module's order and names, tied parameters under each of their names (as
    # ``model.state_dict()`` holds them).
    ordered = {name: out[root.aliases.get(name, name)]
               for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, buf in persistent_buffers(model):
        ordered[name] = buf.detach().clone()
    return ordered


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) for the buffers ``model.state_dict()`` holds: non-persistent ones
    (rotary ``inv_freq``, causal masks) are left out, as torch does."""
    return [(f"{prefix}.{name}" if prefix else name, buf)
            for prefix, mod in model.named_modules() for name, buf in mod._buffers.items()
            if buf is not None and name not in mod._non_persistent_buffers_set]


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors (``full_state_dict``'s, or a plain model's ``state_dict()``) into
    this rank's shards and the buffers; no communication, every rank needs ``state``. The
    model part of :func:`set_state_dict`: tied parameters under either name, a meta-built
    model's shards initialised. Raises ``ValueError`` naming a missing, unexpected or
    misshapen entry."""
    _load_model(model, get_root(model), state, strict=True)


# ---- torch.distributed.checkpoint ---------------------------------------------------------
@dataclass
class _Entry:
    name: str
    tensor: torch.Tensor
    module: nn.Module
    attr: str
    is_param: bool


def _entries(model: nn.Module) -> list[_Entry]:
    """What ``model.state_dict()`` holds, in its order: parameters (tied ones under every
    name) and persistent buffers, walked as ``Module.state_dict`` walks them."""
    out: list[_Entry] = []

    def visit(mod: nn.Module, prefix: str) -> None:
        for attr, p in mod._parameters.items():
            if p is not None:
                out.append(_Entry(prefix + attr, p, mod, attr, True))
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set:
                out.append(_Entry(prefix + attr, b, mod, attr, False))
        for name, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.")
    visit(model, "")
    return out


def _placement(p: torch.Tensor, name: str) -> Placement:
    pl = placement_of(p)
    if pl is None:
        raise ValueError(f"matrixfsdp: parameter '{name}' is not a MatrixFSDP shard (a state dict "
                         "is taken between steps, with the model planned by fully_shard)")
    return pl


def get_state_dict(model: nn.Module, optimizers: Optimizers | None = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` for ``torch.distributed.checkpoint``, keyed by name.

    * ``model``: every name of ``model.state_dict()`` (tied parameters under each name);
      parameters as :class:`~matrixfsdp.dcp.RowShard` views of this rank's shards (the
      fp32 masters under a mixed-precision policy), persistent buffers as the full tensors
      every rank holds (replicated: DCP writes one copy).
    * ``optim`` (if ``optimizers`` are given: one optimizer or a list), shaped like torch's
      ``get_state_dict`` (several optimizers merged into one):
      ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``.
      ``matrixfsdp.Muon``: ``momentum_buffer`` placed like the matrix (written by its owner;
      under HSDP by its owner world rank only), AdamW's ``exp_avg`` / ``exp_avg_sq`` placed
      like the rows and ``step``, a 0-d tensor equal on every rank holding rows
      (replicated). Any other optimizer: on whole matrices (``matrix_params``) all its state,
      of any shape, saved whole by the owner; on row shards its element-wise state placed
      like the rows (see :mod:`matrixfsdp.optim_checkpoint`). Frozen parameters have no
      state. State a fresh optimizer lacks is created first (``Muon.init_state``; for other
      optimizers a step with zero gradients and lr 0, as torch does), so it can be loaded into.

    Under HSDP the matrices stepped since the last forward are first broadcast to the
    other replicas (a collective then), so replicas propose identical pieces and DCP keeps
    one of each.

    Values view the live tensors: ``dcp.load(state, checkpoint_id=...)`` writes into the
    model and the optimizer in place, from a checkpoint saved at any world size; then call
    :func:`set_state_dict` (it restores the hyperparameters and checks every placement).
    No communication (except the HSDP broadcast above).
    """
    root = get_root(model)
    root.sync_replicas()  # HSDP: every replica holds the stepped matrices (no-op otherwise)
    shards: dict[int, RowShard] = {}
    state: dict[str, Any] = {}
    for e in _entries(model):
        if e.is_param:
            if id(e.tensor) not in shards:
                shards[id(e.tensor)] = RowShard.of(e.tensor, _placement(e.tensor, e.name), root.rank)
            state[e.name] = shards[id(e.tensor)]
        elif e.tensor.is_meta:  # a model built on meta: DCP loads into a real tensor
            state[e.name] = torch.empty(e.tensor.shape, dtype=e.tensor.dtype,
                                        device=root.units[0].local.device)
        else:
            state[e.name] = e.tensor.detach()
    out: dict[str, Any] = {"model": state}
    if optimizers is not None:
        out["optim"] = optim_state_dict(as_list(optimizers), root)
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, skipped where ``src`` already is ``dst`` (loaded in place)."""
    if src.numel() and dst.data_ptr() == src.data_ptr() and dst.shape == src.shape \
            and dst.dtype == src.dtype and dst.stride() == src.stride():
        return
    dst.copy_(src)


@torch.no_grad()
def set_state_dict(model: nn.Module, optimizers: Optimizers | None, state: dict[str, Any], *,
                   strict: bool = True) -> None:
    """Load ``state`` (``{"model": ..., "optim": ...}``) into the model and the optimizers
    (one or a list, as given to :func:`get_state_dict`).

    Values may be the :class:`~matrixfsdp.dcp.RowShard` s of :func:`get_state_dict` on this
    model (typically after ``dcp.load`` filled them; where they view the live tensors nothing
    is copied) or full tensors (as in ``torch.load`` of a file written by
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``): each rank keeps its
    rows. The optimizers' hyperparameters (lr, betas, ...) are restored from ``param_groups``,
    group by group in order (checked by parameter name where the names were saved); state is
    set where this rank steps the parameter (a whole matrix's, of any shape, on its owner,
    wherever it was saved) and dropped elsewhere. ``strict``: every name of
    ``model.state_dict()`` must be in ``state["model"]`` and nothing else. No communication.

    Raises ``ValueError`` naming the parameter on a missing or unexpected name, a shape, a
    placement made for another world size, or parameter groups that differ.
    """
    root = get_root(model)
    if "model" not in state:
        raise ValueError("matrixfsdp.set_state_dict: the state has no 'model' entry")
    _load_model(model, root, state["model"], strict)
    if optimizers is not None:
        if "optim" not in state:
            raise ValueError("matrixfsdp.set_state_dict: the state has no 'optim' entry")
        load_optim_state(as_list(optimizers), root, state["optim"], model)


def _load_model(model: nn.Module, root: Root, sd: dict[str, Any], strict: bool) -> None:
    entries = _entries(model)
    names = {e.name for e in entries}
    missing = [e.name for e in entries if e.name not in sd]
    unexpected = [k for k in sd if k not in names]
    if strict and (missing or unexpected):
        raise ValueError(f"matrixfsdp.set_state_dict: missing names {missing[:5]}, unexpected names "
                         f"{unexpected[:5]}" + (" (and more)" if len(missing) + len(unexpected) > 10 else ""))
    loaded: set[int] = set()
    for e in entries:
        if e.name not in sd:
            continue
        value = sd[e.name]
        if e.is_param:
            src = local_piece(value, _placement(e.tensor, e.name), root.rank, f"parameter '{e.name}'")
            _copy(e.tensor, src)
            loaded.add(id(e.tensor))
        elif e.tensor.is_meta:  # a model built on meta: the buffer gets the loaded tensor
            e.module._buffers[e.attr] = value.detach().to(
                device=root.units[0].local.device, dtype=e.tensor.dtype, copy=True)
        else:
            if tuple(value.shape) != tuple(e.tensor.shape):
                raise ValueError(f"matrixfsdp.set_state_dict: buffer '{e.name}' has shape "
                                 f"{tuple(value.shape)}, the model {tuple(e.tensor.shape)}")
            _copy(e.tensor, value)
    if all(id(p) in loaded for u in root.units for p in u.sharded):
        for u in root.units:  # a model built on meta is initialised now
            u.needs_init = False


# ---- complete-or-ignored checkpoint directories ---------------------------------------------
COMPLETE = "COMPLETE"  # marker file rank 0 writes into a checkpoint directory before renaming it
_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    """``root/step_00000042``: where :func:`save_checkpoint` puts step 42 by convention."""
    return Path(root) / f"step_{step:08d}"


@dataclass
class SavedCheckpoint:
    path: Path
    seconds: float  # wall time of the save on this rank, from the call to the commit
    bytes: int  # bytes written by all ranks (files in the directory)
    blocking_seconds: float | None = None  # of which the call held the caller (all of it if sync)


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _on_rank0(fn: Callable[[], Any], group, what: str) -> Any:
    """``fn()`` on rank 0 of ``group``, its result (or its error) handed to every rank: one
    rank's failure (an unwritable directory, a full disk) raises the same error on every
    rank instead of leaving the others in the next collective. Also a barrier."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    info: list[Any] = [None, None]
    if rank == 0:
        try:
            info[0] = fn()
        except Exception as e:  # noqa: BLE001 (told to every rank, then raised)
            if not dist.is_initialized():
                raise
            info[1] = f"{type(e).__name__}: {e}"
    if dist.is_initialized():
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(info, src=src, group=group)
    if info[1] is not None:
        raise RuntimeError(f"matrixfsdp.save_checkpoint: {what} failed on its rank 0: {info[1]}")
    return info[0]


def _commit(tmp: Path, path: Path, group, t0: float) -> int:
    """After every rank of ``group`` wrote into ``tmp``: rank 0 writes the marker, fsyncs and
    renames ``tmp`` to ``path``. Returns the bytes written, on every rank."""
    def commit() -> int:
        nbytes = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        with open(tmp / COMPLETE, "w") as f:
            json.dump({"world_size": world, "bytes": nbytes, "seconds": time.perf_counter() - t0,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
        return nbytes

    _barrier(group)  # every rank has written
    return int(_on_rank0(commit, group, f"the commit of {path}"))


# ---- asynchronous saves ----------------------------------------------------------------------
class AsyncCheckpoint:
    """What ``save_checkpoint(..., async_save=True)`` returns: a save whose state is staged
    (copied to CPU) and which writes and commits in the background.

    ``result()`` waits for it and returns its :class:`SavedCheckpoint` (or raises its error);
    once it returns on a rank, ``path`` is complete on every rank's file system view (the
    commit is rank 0's rename after every rank's write). ``done()`` does not wait.
    ``blocking_seconds`` is how long the call held the caller (waiting for the previous save,
    the directory set-up, staging).
    """

    def __init__(self, path: Path, future: Future, blocking_seconds: float):
        self.path = path
        self.blocking_seconds = blocking_seconds
        self._future = future
        self._observed = False

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SavedCheckpoint:
        try:
            return self._future.result(timeout)
        finally:
            self._observed = self._observed or self._future.done()  # its outcome is the caller's now

    wait = result

    def __repr__(self) -> str:
        return f"AsyncCheckpoint({str(self.path)!r}, {'done' if self.done() else 'in flight'})"


_in_flight: AsyncCheckpoint | None = None  # this process's latest asynchronous save
_save_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> its gloo twin


def wait_for_checkpoint() -> SavedCheckpoint | None:
    """Wait for this process's asynchronous save in flight, if any; return what it saved
    (None if none was in flight). Raises the save's error if the caller has not seen it yet
    through ``result()``. Every save calls it first, so saves never overlap."""
    global _in_flight
    pending, _in_flight = _in_flight, None
    if pending is None:
        return None
    try:
        return pending._future.result()
    except Exception as e:
        if pending._observed:  # the caller has had this error already
            return None
        raise RuntimeError(f"matrixfsdp.save_checkpoint: the asynchronous save of {pending.path} "
                           f"failed: {type(e).__name__}: {e}") from e


def _valid_group(group) -> bool:
    try:
        dist.get_backend(group)
        return True
    except (ValueError, RuntimeError):
        return False


def _group_timeout(group):
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(device).options._timeout
        except Exception:  # noqa: BLE001 (no such backend, or no options: torch's default)
            continue
    return None


def _save_group(process_group):
    """A gloo group of the same ranks as ``process_group`` (default: the world), created once
    (a collective of those ranks) and kept: the background thread of an asynchronous save
    runs its collectives there, never on a group that training uses at the same time (two
    threads issuing collectives on one group can pair them up differently on different ranks),
    and on CPU, as ``dcp.async_save`` requires (NCCL has no CPU collectives). For the world,
    every rank creates it, as any new group; for a smaller group only its ranks do (torch's
    ``use_local_synchronization``)."""
    parent = process_group if process_group is not None else dist.group.WORLD
    group = _save_groups.get(parent)
    if group is None or not _valid_group(parent) or not _valid_group(group):
        ranks = dist.get_process_group_ranks(parent)
        whole = len(ranks) == dist.get_world_size()
        group = dist.new_group(None if whole else ranks, timeout=_group_timeout(parent), backend="gloo",
                               use_local_synchronization=not whole)
        _save_groups[parent] = group
    return group


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike, *, process_group=None,
                    before_commit: Callable[[], None] | None = None,
                    async_save: bool = False) -> SavedCheckpoint | AsyncCheckpoint:
    """``dcp.save(state)`` into directory ``path`` so that ``path`` is complete or absent.

    Every rank writes into ``.<name>.partial`` next to ``path``; after a barrier (every rank
    done; DCP's metadata written by the coordinator), rank 0 adds the ``COMPLETE`` marker,
    renames the directory to ``path`` (replacing an older one of that name) and syncs. A crash
    at any point leaves ``path`` as it was and a ``.partial`` directory that
    :func:`latest_checkpoint` ignores and the next save of that name removes. A collective:
    every rank of ``process_group`` (default: the world) calls it. ``before_commit`` runs on
    every rank between the write and the commit (tests kill a rank there).

    ``async_save=True``: stage the state (a CPU copy of this rank's rows, see
    :func:`matrixfsdp.dcp.stage_state`), hand it to ``torch.distributed.checkpoint.async_save``
    and return an :class:`AsyncCheckpoint` at once; the write, the barrier and the commit run
    in a background thread, on a gloo group of the same ranks that this function creates on
    the first asynchronous save (so it works unchanged under NCCL). Training may change the
    parameters and the optimizer state as soon as the call returns: the checkpoint holds the
    values at the time of the call. A save (either kind) first waits for the asynchronous one
    in flight. Call ``.result()`` (or :func:`wait_for_checkpoint`) before the process group is
    destroyed or the process exits.
    """
    global _in_flight
    t0 = time.perf_counter()
    wait_for_checkpoint()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")

    def make_dir() -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this name that died before its commit
        tmp.mkdir(parents=True)
    _on_rank0(make_dir, process_group, f"creating {tmp}")
    if not async_save:
        dcp.save(state, checkpoint_id=str(tmp), process_group=process_group)
        if before_commit is not None:
            before_commit()
        nbytes = _commit(tmp, path, process_group, t0)
        seconds = time.perf_counter() - t0
        return SavedCheckpoint(path, seconds, nbytes, seconds)

    group = _save_group(process_group) if dist.is_initialized() else None
    # per_thread_copy_ahead=0: the staged tensors are on CPU already, and DCP's writer then
    # reads them directly instead of through an accelerator stream of the background thread.
    written = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(tmp), per_thread_copy_ahead=0),
                             process_group=group, async_stager=RowShardStager(),
                             no_dist=not dist.is_initialized())
    blocking = time.perf_counter() - t0

    def finish() -> SavedCheckpoint:
        written.result()
        if before_commit is not None:
            before_commit()
        nbytes = _commit(tmp, path, group, t0)
        return SavedCheckpoint(path, time.perf_counter() - t0, nbytes, blocking)

    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="matrixfsdp-checkpoint")
    _in_flight = AsyncCheckpoint(path, worker.submit(finish), blocking)
    worker.shutdown(wait=False)  # the thread ends with the commit
    return _in_flight


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint :func:`save_checkpoint` finished (marker and DCP
    metadata present)."""
    path = Path(path)
    return (path / COMPLETE).is_file() and (path / ".metadata").is_file()


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete ``root/step_N`` with the largest N (``root`` itself if it is a complete
    checkpoint), or None. Directories without the marker (a save that died) are ignored."""
    root = Path(root)
    if is_complete(root):
        return root
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), d) for d in root.iterdir()
             if (m := _STEP_DIR.fullmatch(d.name)) and is_complete(d)]
    return max(found)[1] if found else None
