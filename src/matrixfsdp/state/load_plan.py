"""What each rank reads of a checkpoint, planned without every rank reading DCP's index.

``dcp.load`` has every rank read DCP's index (``.metadata``) and find, for each of its
tensors, the saved chunks that overlap its own. At P ranks the index holds O(P) chunks of
every row-sharded tensor: each rank reads and searches O(P), and the file system serves P
reads of one file. Here (:func:`~matrixfsdp.state.dcp_io.load`):

* each rank lists what it holds (:func:`requests`: per entry of its state dict, its chunks);
* **resuming as saved** (the same world size and placement): each rank finds every chunk it
  holds in the files it wrote itself, from the list of items each file ends with
  (:func:`~matrixfsdp.state.integrity.file_index`; :func:`own_reads`), exactly (tensor size,
  offsets, sizes). The ranks agree on that with one all-reduce, and rank 0 alone reads the
  index, for its checks and for what every rank loads alike;
* **otherwise** (another world size, another placement, a checkpoint without those lists):
  rank 0 reads the index and broadcasts it, and each rank plans its own reads from it with
  DCP's own ``create_read_items_for_chunk_list`` (:func:`plan_reads`), as ``dcp.load`` would,
  without the file system serving the index to every rank.

Values that DCP treats as replicated (plain tensors, bytes) and 0-d tensors are the same on
every rank that holds them: rank 0 alone reads them (:func:`fetch_shared`) and every rank
gets them in one broadcast (:func:`apply_shared`). A save puts them in rank 0's file
(``dedup_save_to_lowest_rank``), so resuming as saved each rank opens only its own files.
"""

from __future__ import annotations

import hashlib
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

from .integrity import CheckpointError, Index, error_line, file_index

# One entry of a rank's state dict: (fqn, size (None: bytes), its chunks as (offsets,
# sizes), shared: a value every rank holding it holds alike).
Request = tuple[str, "tuple[int, ...] | None", "list[tuple[tuple[int, ...], tuple[int, ...]]]", bool]


@dataclass(frozen=True)
class Stored:
    """Where an item's bytes lie, as DCP's file reader takes it (``relative_path``,
    ``offset``, ``length``, ``transform_descriptors``)."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


@dataclass
class RankPlan:
    """One rank's reads: ``items`` from the files (``storage``: where each lies), the
    ``files`` it reads with what the save recorded of each (checked first), and its shared
    entries ``(fqn, item, where)`` (rank 0 fetches its own for the broadcast)."""

    items: list[ReadItem] = field(default_factory=list)
    storage: dict[MetadataIndex, Any] = field(default_factory=dict)
    files: dict[str, tuple] = field(default_factory=dict)
    shared: list[tuple[str, ReadItem, Any]] = field(default_factory=list)


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


def shared_key(reqs: list[Request]) -> int:
    """A 62-bit digest of the shared entries a rank asks for (their names, sizes, and
    whether it holds them: a 0-d ``RowShard`` only its holders do)."""
    text = repr(sorted((fqn, size, bool(chunks) or size is None)
                       for fqn, size, chunks, shared in reqs if shared)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 2


def _tensor_item(fqn: str, offsets: tuple, i: int, sizes: tuple) -> ReadItem:
    zero = torch.Size([0] * len(offsets))
    return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, torch.Size(offsets), i),
                    dest_offsets=zero, storage_index=MetadataIndex(fqn, torch.Size(offsets)),
                    storage_offsets=zero, lengths=torch.Size(sizes))


def own_reads(path: Path, rank: int, reqs: list[Request]) -> RankPlan | None:
    """Every chunk this rank holds (shared entries aside), found exactly in the files it
    wrote (``__<rank>_<n>.distcp``, from the items each ends with); None where one is not
    there (another world size or placement, a file without its list). Opens only those."""
    found: dict[tuple, tuple] = {}
    wanted = any(chunks for _, _, chunks, shared in reqs if not shared)
    for n in range(1 << 16 if wanted else 0):
        name = f"__{rank}_{n}.distcp"
        if not (path / name).is_file():
            break
        for fqn, size, offsets, sizes, offset, length in file_index(path / name) or []:
            if size is not None:
                found[(fqn, tuple(size), tuple(offsets))] = (tuple(sizes), name, offset, length)
    plan = RankPlan()
    for fqn, size, chunks, shared in reqs:
        if shared:
            continue
        for i, (offsets, sizes) in enumerate(chunks):
            if 0 in sizes:
                continue  # an empty piece: nothing to read
            hit = found.get((fqn, size, offsets))
            if hit is None or hit[0] != sizes:
                return None
            item = _tensor_item(fqn, offsets, i, sizes)
            plan.items.append(item)
            plan.storage[item.storage_index] = Stored(hit[1], hit[2], hit[3])
            plan.files[hit[1]] = ()
    return plan


def _bytes_item(fqn: str) -> ReadItem:
    zero = torch.Size([0])
    return ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn), dest_offsets=zero,
                    storage_index=MetadataIndex(fqn), storage_offsets=zero, lengths=zero)


def _check(fqn: str, size, md) -> None:
    """DCP's own refusals of an entry that does not fit the saved one, with its words."""
    if md is None:
        raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
    if (size is None) != isinstance(md, BytesStorageMetadata):
        raise ValueError(f"Invalid checkpoint metadata for {fqn}, expected "
                         f"{'BytesStorageMetadata' if size is None else 'TensorStorageMetadata'} "
                         f"but found {type(md).__name__}")
    if size is not None and tuple(md.size) != tuple(size):
        raise ValueError(f"Size mismatch between saved {md.size} and current: "
                         f"{torch.Size(size)} for {fqn}")


def plan_reads(reqs: list[Request], meta: Metadata, index: Index, only_shared: bool = False) -> RankPlan:
    """This rank's reads from DCP's index, as ``dcp.load`` plans them (one sweep per tensor
    over this rank's chunks and the saved ones); shared entries go to ``RankPlan.shared``.
    Raises, as DCP does, for an entry the checkpoint lacks (``RuntimeError: Missing key in
    checkpoint state_dict: ...``) or holds otherwise (``ValueError``)."""
    saved, plan = meta.state_dict_metadata, RankPlan()
    for fqn, size, chunks, shared in reqs:
        if only_shared and not shared:
            continue
        _check(fqn, size, saved.get(fqn))
        if size is None:
            items = [_bytes_item(fqn)]
        else:
            items = create_read_items_for_chunk_list(fqn, saved[fqn], [
                ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks])
        for item in items:
            if size is not None and 0 in item.lengths:
                continue  # an empty piece: nothing to read (its name and size were checked)
            info = meta.storage_data[item.storage_index]
            if shared and not getattr(info, "transform_descriptors", None):
                plan.shared.append((fqn, item, info))
                continue
            plan.items.append(item)
            plan.storage[item.storage_index] = info
            plan.files[info.relative_path] = index.record(info.relative_path)
    return plan


def fetch_shared(path: Path, plan: RankPlan) -> dict[str, tuple[ReadItem, bytes, str]]:
    """Rank 0's read of the values every rank loads alike (its ``plan.shared``): each one's
    item, bytes as the save wrote them and file, each file opened once. A file that cannot
    be read is named (:class:`~matrixfsdp.state.integrity.CheckpointError`)."""
    out: dict[str, tuple[ReadItem, bytes, str]] = {}
    per_file: dict[str, list] = defaultdict(list)
    for entry in plan.shared:
        per_file[entry[2].relative_path].append(entry)
    for name, entries in per_file.items():
        try:
            with open(path / name, "rb") as f:
                for fqn, item, info in entries:
                    f.seek(info.offset)
                    data = f.read(info.length)
                    if len(data) != info.length:
                        raise EOFError(f"{info.length} bytes at {info.offset}, found {len(data)}")
                    out[fqn] = (item, data, name)
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


def apply_shared(planner, fqns: list[str], payload: dict[str, tuple[ReadItem, bytes, str]],
                 path: Path) -> None:
    """Load the shared entries ``fqns`` from rank 0's broadcast, as DCP's file reader would
    from the file: bytes through the planner's ``load_bytes``, a tensor through
    ``torch.load``, narrowed to the item's piece and copied into the state dict."""
    for fqn in fqns:
        item, data, name = payload[fqn]
        try:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(data))
                continue
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            for dim, (start, n) in enumerate(zip(item.storage_offsets, item.lengths)):
                t = t.narrow(dim, start, n)
            target = planner.resolve_tensor(item).detach()
            if target.size() != t.size():
                raise ValueError(f"{fqn}: {tuple(t.size())} saved where {tuple(target.size())} is loaded")
            target.copy_(t)
            planner.commit_tensor(item, target)
        except Exception as e:  # noqa: BLE001 (named, then agreed on by every rank)
            raise CheckpointError(read_failure(path, name, e)) from e


def own_files(index: Index, world: int) -> list[dict[str, tuple]]:
    """Per rank of ``world``, the files it wrote (``__<rank>_<n>.distcp``) with their
    records (:meth:`~matrixfsdp.state.integrity.Index.record`): rank 0's loop over the index."""
    out: list[dict[str, tuple]] = [{} for _ in range(world)]
    for name in set(index.digests or {}) | set(index.ends):
        if name.startswith("__") and name.endswith(".distcp"):
            rank = name[2:].split("_", 1)[0]
            if rank.isdigit() and int(rank) < world:
                out[int(rank)][name] = index.record(name)
    return out
