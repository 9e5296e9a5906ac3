"""Plain files in and out: unsharded ``torch.save`` / safetensors / Hugging Face checkpoints.

* :func:`load_full_checkpoint`: start a sharded run from a checkpoint of the unsharded
  model; each rank reads only the rows it holds (safetensors: ``safe_open`` + ``get_slice``,
  one tensor at a time; ``torch.save`` files: ``torch.load(mmap=True)``, so only the pages of
  those rows are read). No communication.
* :func:`save_pretrained`: a normal Hugging Face checkpoint directory from a sharded model
  (full tensors gathered with ``full_state_dict``, written by rank 0 with the model's own
  ``save_pretrained``), which ``from_pretrained`` loads in a plain process.

DCP checkpoints convert to a plain file with torch's own
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (docs/checkpoint.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.module import get_root
from ..runtime.param import placement_of, sharded_param
from .entries import check_names, state_entries
from .state_dict import full_state_dict

ReadRows = Callable[[str, int, int], torch.Tensor]  # (name, start, stop) -> rows


class _Source:
    """Names, shapes and a row reader over one unsharded checkpoint."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: ReadRows,
                 whole: Callable[[str], torch.Tensor]):
        self.shapes, self.read, self.whole = shapes, read, whole


def _safetensors_source(files: dict[str, Path]) -> _Source:
    from safetensors import safe_open

    shapes = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if files.get(name) == path:
                    shapes[name] = tuple(f.get_slice(name).get_shape())

    # One tensor per open: the file is mapped only while its rows are copied, so the pages
    # read stay resident for one tensor at a time.
    def read(name: str, start: int, stop: int) -> torch.Tensor:
        with safe_open(files[name], framework="pt") as f:
            return f.get_slice(name)[start:stop]

    def whole(name: str) -> torch.Tensor:
        with safe_open(files[name], framework="pt") as f:
            return f.get_tensor(name)
    return _Source(shapes, read, whole)


def _torch_source(path: Path) -> _Source:
    sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"matrixfsdp.load_full_checkpoint: {path} is not a flat name -> tensor "
                         "state dict (for a dcp_to_torch_save file, pass torch.load(path, mmap=True)"
                         "['model'] to matrixfsdp.set_state_dict)")
    return _Source({k: tuple(v.shape) for k, v in sd.items()},
                   lambda name, start, stop: sd[name][start:stop], lambda name: sd[name])


def _open(path: Path) -> _Source:
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return _safetensors_source({k: path / v for k, v in weight_map.items()})
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).is_file():
                return _open(path / name)
        raise FileNotFoundError(f"matrixfsdp.load_full_checkpoint: {path} has no model.safetensors, "
                                "model.safetensors.index.json or pytorch_model.bin")
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            return _safetensors_source({k: path for k in f.keys()})
    return _torch_source(path)


@torch.no_grad()
def load_full_checkpoint(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> None:
    """Fill the shards of ``model`` from an unsharded checkpoint of it, reading only the rows
    this rank holds. Call it on every rank; no communication.

    ``path``: a ``.safetensors`` file; a Hugging Face directory (``model.safetensors``,
    ``model.safetensors.index.json`` or ``pytorch_model.bin``); or a ``torch.save`` file of
    ``model.state_dict()``. Tied parameters load from whichever of their names the file has
    (Hugging Face keeps one). Values are cast to the shards' dtype (a bf16 file into fp32
    masters). Persistent buffers in the file are loaded whole. With the model built on the
    meta device, this initialises it (no ``init_weights`` needed, unless it has
    non-persistent meta buffers such as rotary ``inv_freq``; call ``init_weights`` first then).

    Memory per rank: its shards plus, for safetensors, one tensor's rows in transit (the
    file is mapped one tensor at a time); ``torch.load(mmap=True)`` keeps the file mapped, so
    the pages of this rank's rows stay resident (clean file pages) until it returns.
    ``strict``: every parameter must be in the file and the file must hold nothing else.
    """
    root = get_root(model)
    source = _open(Path(path))
    names_of: dict[int, list[str]] = {}
    for e in state_entries(model):
        if e.is_param:
            names_of.setdefault(id(e.tensor), []).append(e.name)
    used: set[str] = set()
    missing = []
    for u in root.units:
        for p in u.sharded:
            pl = placement_of(p)
            name = next((n for n in [pl.spec.name, *names_of.get(id(p), [])] if n in source.shapes), None)
            if name is None:
                missing.append(pl.spec.name)
                continue
            used.update(n for n in names_of.get(id(p), [pl.spec.name]) if n in source.shapes)
            if source.shapes[name] != pl.spec.shape:
                raise ValueError(f"matrixfsdp.load_full_checkpoint: '{name}' has shape "
                                 f"{source.shapes[name]} in {path}, the model {pl.spec.shape}")
            if not p.numel():
                continue
            if not pl.spec.shape:
                p.copy_(source.whole(name))
                continue
            start, stop = pl.row_ranges[sharded_param(p).shard_rank]
            p.copy_(source.read(name, start, stop).view(p.shape))
    buffers = [e for e in state_entries(model) if not e.is_param]
    for e in buffers:
        if e.name in source.shapes:
            used.add(e.name)
            value = source.whole(e.name)
            if e.tensor.is_meta:
                e.module._buffers[e.attr] = value.to(device=root.units[0].local.device,
                                                     dtype=e.tensor.dtype)
            else:
                e.tensor.copy_(value)
    if strict:
        check_names(used | set(missing), source.shapes,  # tied: any one name counts
                     f"load_full_checkpoint: {path}")
    if not missing:
        for u in root.units:  # a model built on meta is initialised now
            u.needs_init = False


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs) -> None:
    """Write a Hugging Face checkpoint directory (config, safetensors) of a sharded
    ``transformers`` model, loadable with ``from_pretrained`` in a plain process.

    A collective (the full tensors are gathered with ``full_state_dict(cpu_offload=True)``:
    a unit at a time on the device, kept on rank 0 only); rank 0 writes with
    ``model.save_pretrained(save_directory, state_dict=full, **kwargs)``, so tied weights,
    sharding of large files and the config are handled by transformers.
    """
    root = get_root(model)
    full = full_state_dict(model, cpu_offload=True)
    if root.groups.world_rank == 0:  # one writer, also under HSDP (one per replica otherwise)
        model.save_pretrained(save_directory, state_dict=full, **kwargs)
    if dist.is_initialized():
        dist.barrier(group=root.groups.world)
