"""What each rank reads of a checkpoint, decided by one rank that reads the index.

``dcp.load`` has every rank read DCP's index (``.metadata``) and find, for each of its
tensors, the saved chunks that overlap its own. At P ranks the index holds O(P) chunks of
every row-sharded tensor, so each rank reads and searches O(P), and the file system serves
P reads of one file. Here (:func:`~matrixfsdp.state.dcp_io.load`) each rank sends the
coordinator what it holds instead (:func:`requests`: per entry of its state dict, its own
chunks, no index), the coordinator resolves every rank's requests against the index in one
pass per tensor, with DCP's own ``create_read_items_for_chunk_list`` (:func:`resolve`), and
each rank gets back its :class:`RankPlan`: its read items, where each lies (file, offset,
length), and the files it reads with what the save recorded of them (checksum, size, the
end of the data the index places there), which it checks before reading.

Values that DCP treats as replicated (plain tensors, bytes) and 0-d tensors are the same on
every rank that asks for them: the coordinator alone reads each (``RankPlan.fetch``) and
every rank gets them in one broadcast (:func:`fetch_shared`, :func:`apply_shared`). A save
puts them in rank 0's file (``dedup_save_to_lowest_rank``), so at the same world size every
rank opens only the files it wrote itself.
"""

from __future__ import annotations

import dataclasses
import io
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from .integrity import CheckpointError, Index, error_line

# One entry of a rank's state dict: (fqn, size (None: bytes), its chunks as (offsets,
# sizes), shared: a value every rank holding it holds alike).
Request = tuple[str, "tuple[int, ...] | None", "list[tuple[tuple[int, ...], tuple[int, ...]]]", bool]


@dataclass
class RankPlan:
    """One rank's part of a load, as the coordinator planned it."""

    items: list[ReadItem] = field(default_factory=list)  # read by this rank from the files
    storage: dict[MetadataIndex, Any] = field(default_factory=dict)  # where each lies (DCP's)
    files: dict[str, tuple] = field(default_factory=dict)  # name -> Index.record: checked first
    shared: list[tuple[int, ReadItem]] = field(default_factory=list)  # (slot, item) applied here
    fetch: list[MetadataIndex] = field(default_factory=list)  # coordinator: the broadcast's slots
    shared_from: list[str] = field(default_factory=list)  # each slot's file, on every rank


def requests(state_dict: dict[str, Any]) -> list[Request]:
    """This rank's requests: each entry of ``state_dict`` (flattened as DCP's planner holds it)
    with the chunks this rank holds of it (a tensor without ``__create_chunk_list__`` is held
    whole, as DCP takes it). A ``DTensor`` on a mesh without this rank holds nothing."""
    out: list[Request] = []
    for fqn, obj in state_dict.items():
        if not isinstance(obj, torch.Tensor):
            out.append((fqn, None, [], True))
            continue
        if hasattr(obj, "__create_chunk_list__"):
            mesh = getattr(obj, "device_mesh", None) if isinstance(obj, DTensor) else None
            chunks = [] if mesh is not None and mesh.get_coordinate() is None \
                else obj.__create_chunk_list__()
        elif type(obj).__name__ == "ShardedTensor":
            raise NotImplementedError(f"matrixfsdp: '{fqn}' is a ShardedTensor; load it with dcp.load")
        else:
            chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * obj.dim()), sizes=obj.size())]
        shared = not hasattr(obj, "__create_chunk_list__") or obj.dim() == 0
        out.append((fqn, tuple(obj.size()),
                    [(tuple(c.offsets), tuple(c.sizes)) for c in chunks], shared))
    return out


def _bytes_item(fqn: str) -> ReadItem:
    zero = torch.Size([0])
    return ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn), dest_offsets=zero,
                    storage_index=MetadataIndex(fqn), storage_offsets=zero, lengths=zero)


def _check(fqn: str, size, md) -> None:
    """DCP's own refusals of an entry that does not fit the saved one, with its words."""
    if (size is None) != isinstance(md, BytesStorageMetadata):
        raise ValueError(f"Invalid checkpoint metadata for {fqn}, expected "
                         f"{'BytesStorageMetadata' if size is None else 'TensorStorageMetadata'} "
                         f"but found {type(md).__name__}")
    if size is not None and tuple(md.size) != tuple(size):
        raise ValueError(f"Size mismatch between saved {md.size} and current: "
                         f"{torch.Size(size)} for {fqn}")


def resolve(everyone: list[list[Request]], meta: Metadata, index: Index) -> list[RankPlan]:
    """The coordinator's plan for each rank from every rank's :func:`requests` (in rank
    order): one sweep per tensor over all ranks' chunks and the saved ones (O(chunks log
    chunks), not O(ranks x saved chunks)). Raises, as DCP does, for an entry the checkpoint
    lacks (``RuntimeError: Missing key in checkpoint state_dict: ...``) or holds otherwise."""
    saved = meta.state_dict_metadata
    plans = [RankPlan() for _ in everyone]
    wanted: dict[str, list[tuple[int, int, ChunkStorageMetadata, bool]]] = defaultdict(list)
    slots: dict[MetadataIndex, int] = {}

    def place(rank: int, item: ReadItem, shared: bool) -> None:
        info = meta.storage_data[item.storage_index]
        if shared and not getattr(info, "transform_descriptors", None):
            slot = slots.setdefault(item.storage_index, len(slots))
            plans[rank].shared.append((slot, item))
            return
        plan = plans[rank]
        plan.items.append(item)
        plan.storage[item.storage_index] = info
        plan.files.setdefault(info.relative_path, index.record(info.relative_path))

    for rank, reqs in enumerate(everyone):
        for fqn, size, chunks, shared in reqs:
            if fqn not in saved:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            _check(fqn, size, saved[fqn])
            if size is None:
                place(rank, _bytes_item(fqn), True)
            for i, (offsets, sizes) in enumerate(chunks):
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                wanted[fqn].append((rank, i, chunk, shared))
    for fqn, held in wanted.items():
        found = create_read_items_for_chunk_list(fqn, saved[fqn], [c for _, _, c, _ in held])
        for item in found:
            rank, i, _, shared = held[item.dest_index.index]
            if 0 in item.lengths:
                continue  # an empty piece: nothing to read (its name and shape were checked)
            place(rank, dataclasses.replace(item, dest_index=MetadataIndex(
                fqn, item.dest_index.offset, i)), shared)
    fetch = list(slots)
    for idx in fetch:
        info = meta.storage_data[idx]
        plans[0].storage[idx] = info
        plans[0].files.setdefault(info.relative_path, index.record(info.relative_path))
    plans[0].fetch = fetch
    shared_from = [meta.storage_data[idx].relative_path for idx in fetch]
    for plan in plans:
        plan.shared_from = shared_from
    return plans


def fetch_shared(path: Path, plan: RankPlan) -> list[bytes]:
    """The coordinator's read of the values every rank loads alike (``plan.fetch``, in slot
    order): each one's bytes as the save wrote them, each file opened once. A file that
    cannot be read is named (:class:`~matrixfsdp.state.integrity.CheckpointError`)."""
    out: list[bytes] = [b""] * len(plan.fetch)
    per_file: dict[str, list[int]] = defaultdict(list)
    for slot, idx in enumerate(plan.fetch):
        per_file[plan.storage[idx].relative_path].append(slot)
    for name, slots in per_file.items():
        try:
            with open(path / name, "rb") as f:
                for slot in slots:
                    info = plan.storage[plan.fetch[slot]]
                    f.seek(info.offset)
                    out[slot] = f.read(info.length)
                    if len(out[slot]) != info.length:
                        raise EOFError(f"{info.length} bytes at {info.offset}, found {len(out[slot])}")
        except Exception as e:  # noqa: BLE001 (named, then agreed on by every rank)
            raise CheckpointError(read_failure(path, name, e)) from e
    return out


def read_failure(path: Path, name: str, exc: BaseException) -> str:
    """The message of a file whose bytes could not be read or used."""
    # torch.load's refusal of bytes that are no tensor data advises loading them with
    # weights_only=False: never repeated for a damaged file
    why = (f"{type(exc).__name__}: its bytes are not tensor data torch.load can read"
           if type(exc).__name__ == "UnpicklingError" or "weights_only" in str(exc) else error_line(exc))
    return (f"checkpoint {path}: {name} is damaged: reading it failed ({why}); it was truncated, "
            "overwritten or swapped with another file after the save")


def apply_shared(planner, shared: list[tuple[int, ReadItem]], payload: list[bytes],
                 where: list[str], path: Path) -> None:
    """Load this rank's shared items from the broadcast bytes, as DCP's file reader would
    from the file: bytes through the planner's ``load_bytes``, a tensor through
    ``torch.load``, narrowed to the item's piece and copied into the state dict.
    ``where``: each slot's file, for the message of bytes that do not load."""
    for slot, item in shared:
        try:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(payload[slot]))
                continue
            t = torch.load(io.BytesIO(payload[slot]), map_location="cpu", weights_only=True)
            for dim, (start, n) in enumerate(zip(item.storage_offsets, item.lengths)):
                t = t.narrow(dim, start, n)
            target = planner.resolve_tensor(item).detach()
            if target.size() != t.size():
                raise ValueError(f"{item.storage_index.fqn}: {tuple(t.size())} saved where "
                                 f"{tuple(target.size())} is loaded")
            target.copy_(t)
            planner.commit_tensor(item, target)
        except Exception as e:  # noqa: BLE001 (named, then agreed on by every rank)
            raise CheckpointError(read_failure(path, where[slot], e)) from e
