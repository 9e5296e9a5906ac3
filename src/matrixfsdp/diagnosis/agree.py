"""Ranks agree on their set-up by a fixed-size digest: O(1) bytes per rank when they do,
and only when they do not, what names the culprit (rank, item, values).

At 16384 ranks, gathering every rank's description of the model (three items per
parameter, 236 KB pickled for a 405B-shaped Llama) costs each rank P times that: ~140 s
and ~16 GB of host memory. Here each rank hashes its items into a few int64 lanes and
one ``all_reduce(MAX)`` over ``[lanes, ~lanes]`` gives every rank the largest and (as
``~max(~x) == min(x)``) the smallest lane of any rank: equal means agreed. That is the
success path: one collective of a few dozen bytes, no Python work proportional to P.

On a mismatch (the failure path) :func:`check_same_setup` finds the first differing item
as a gather of every rank's items would: rank 0's list is broadcast, each rank finds its
first item that differs from it, one all-reduce picks the first, and only that item's
values travel (a digest per rank, then one broadcast per distinct value). Those steps
grow with P where the message must (it names every rank's value).

The items ``"matrix optimizer ..."`` (:data:`OPTIONAL`: an optimizer on ``matrix_params``,
which a rank owning no matrix may lack) are compared only among the ranks that have them:
their digest has its own lanes, which a rank without them leaves out of the reduction.

Tensors travel on the group's device (:func:`object_device`:
CUDA under NCCL), so the same calls run on every backend.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .._compat import all_gather_single

OPTIONAL = "matrix optimizer "  # items a rank may lack (a rank that owns no matrix)
MISSING = "(missing)"  # an item's value on a rank that lacks it, as messages show it
_LOW = -(2 ** 63)  # a lane a rank leaves out of a reduction (below every digest's ~)
_NONE = 2 ** 62  # "no such rank / item" in a minimum
_RANK_SHIFT = 31  # a rank's own extra item k is at len(reference) + (rank << 31) + k


def object_device(group: dist.ProcessGroup | None) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_gather_object(obj: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj``, in rank order (a set-up or failure-path collective: two small
    all-gathers), as ``dist.all_gather_object`` but on the group's own device and without
    numpy (torch's needs it; only checkpoints do here, through DCP)."""
    device = object_device(group)
    data = torch.tensor(list(pickle.dumps(obj)), dtype=torch.uint8, device=device)
    world = dist.get_world_size(group)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    every = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(every, padded, group=group)
    return [pickle.loads(bytes(t[:int(s)].tolist())) for t, s in zip(every, sizes)]


def broadcast_object(obj: object, src: int, group: dist.ProcessGroup | None = None) -> object:
    """Global rank ``src``'s ``obj`` on every rank of ``group`` (two small broadcasts),
    numpy-free like :func:`all_gather_object`."""
    device = object_device(group)
    mine = dist.get_rank() == src
    data = torch.tensor(list(pickle.dumps(obj)) if mine else [], dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if not mine:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    return obj if mine else pickle.loads(bytes(data.tolist()))


def lanes(parts: Iterable[str]) -> list[int]:
    """Two signed int64 lanes of a 128-bit hash of ``parts`` (in order; stable across
    processes, unlike Python's ``hash``)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    d = h.digest()
    return [int.from_bytes(d[:8], "little", signed=True), int.from_bytes(d[8:], "little", signed=True)]


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _global(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def min_max(values: list[int | None], group: Any, any_of: list[int] = ()) -> tuple[list, list, list[int]]:
    """Over the ranks of ``group``: each value's smallest and largest (None where no rank
    gave one: a rank passes None for a value it lacks), and the largest of each of
    ``any_of`` (flags: 1 where any rank set it). One ``all_reduce(MAX)`` of
    ``8 x (2 len(values) + len(any_of))`` bytes; at world size 1, this rank's own."""
    n = len(values)
    sent = [v if v is not None else _LOW for v in values] + \
        [~v if v is not None else _LOW for v in values] + list(any_of)
    if _world(group) > 1:
        t = torch.tensor(sent, dtype=torch.int64, device=object_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        sent = t.tolist()
    high, low = sent[:n], sent[n:2 * n]
    absent = [h == _LOW and lo == _LOW for h, lo in zip(high, low)]
    return ([None if a else ~lo for a, lo in zip(absent, low)],
            [None if a else h for a, h in zip(absent, high)], sent[2 * n:])


def any_rank(flags: list[int], group: Any) -> list[int]:
    """The largest of each of ``flags`` (small ints) over the ranks of ``group``: 1 where
    any rank set one. One all-reduce of ``8 x len(flags)`` bytes."""
    return min_max([], group, flags)[2]


def every_rank(values: list[int], group: Any, device: torch.device | None = None) -> list[list[int]]:
    """Every rank's ``values`` (a few int64, the same count on every rank), in group-rank
    order: a failure-path collective (each rank receives ``8 x len(values) x P`` bytes)."""
    world = _world(group)
    if world == 1:
        return [list(values)]
    device = device if device is not None else object_device(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(world * len(values), dtype=torch.int64, device=device)
    all_gather_single(out, mine, group=group)
    return out.view(world, len(values)).tolist()


def every_value(value: Any, group: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in group-rank order, moving each distinct value
    once: a digest per rank (:func:`every_rank`), then one broadcast per distinct value
    from its lowest rank. A failure-path collective: P digests, and as many broadcasts as
    there are distinct values."""
    rows = [tuple(r) for r in every_rank(lanes([type(value).__qualname__, repr(value)]), group)]
    first: dict[tuple, int] = {}
    for r, row in enumerate(rows):
        first.setdefault(row, r)
    if len(rows) == 1:
        return [value]
    me = dist.get_rank(group)
    shown = {row: broadcast_object(value if r == me else None, _global(group, r), group)
             for row, r in first.items()}  # every rank takes part in each, in rank order
    return [shown[row] for row in rows]


def _shown(value: Any) -> str:
    return str(value).replace("torch.", "")


def check_same_setup(items: list[tuple[str, Any]], group: Any, what: str,
                     any_of: list[int] = ()) -> list[int]:
    """Raise ``ValueError`` on every rank of ``group`` naming the first of ``items``
    (``(description, value)``, in the same order on every rank) whose value differs
    between ranks, with each rank's value; ``what`` says what was set up ("the model",
    "the Muon optimizer"). Items whose description starts with :data:`OPTIONAL` are
    compared among the ranks that have them. Values must compare with ``==`` (no
    tensors); their ``repr`` goes into the digest, so values equal under ``==`` with
    another repr (``1`` and ``1.0``) take the failure path and pass there.

    Cost: one ``all_reduce`` of ``8 x (8 + len(any_of))`` bytes when the ranks agree; the
    failure path (:func:`_first_difference`) is a few more collectives, P digests and one
    broadcast per distinct value of the item it names. ``any_of``: small int flags reduced
    with ``MAX`` in the same all-reduce (1 where any rank set one), returned."""
    if _world(group) == 1:
        return list(any_of)
    required = [repr(item) for item in items if not item[0].startswith(OPTIONAL)]
    optional = [repr(item) for item in items if item[0].startswith(OPTIONAL)]
    mine = lanes(required) + (lanes(optional) if optional else [None, None])
    low, high, seen = min_max(mine, group, list(any_of))
    if low != high:
        _first_difference(items, group, what)  # raises, unless equal under == after all
    return seen


def _first_difference(items: list[tuple[str, Any]], group: Any, what: str) -> None:
    """The failure path of :func:`check_same_setup`: raise naming the first item (in the
    order of rank 0's items, then other ranks' extra items in rank order, as a gather of
    every rank's list would see them) whose value differs among the ranks that must agree
    on it. Rank 0's list is broadcast; each rank finds its own first difference; one
    all-reduce picks the first; only that item's values travel. An extra item of another
    rank may turn out equal among its holders (an optional one): it is settled and the
    search goes on."""
    me = dist.get_rank(group)
    reference = broadcast_object(items if me == 0 else None, _global(group, 0), group)
    index: dict[str, int] = {}
    for i, (key, _) in enumerate(reference):
        index.setdefault(key, i)
    mine = dict(items)
    settled: set[str] = set()
    while True:
        position = _NONE
        for i, (key, value) in enumerate(reference):
            if key in settled or index[key] != i:
                continue
            if (key in mine and mine[key] != value) or (key not in mine and not key.startswith(OPTIONAL)):
                position = i
                break
        else:
            position = next((len(reference) + (me << _RANK_SHIFT) + k for k, (key, _) in enumerate(items)
                             if key not in index and key not in settled), _NONE)
        first = min_max([position], group)[0][0]
        if first == _NONE:
            return  # equal under == (the digests saw another repr)
        if first < len(reference):
            key = reference[first][0]
        else:
            rank, k = divmod(first - len(reference), 1 << _RANK_SHIFT)
            key = broadcast_object(items[k][0] if rank == me else None, _global(group, rank), group)
        values = every_value(mine.get(key, MISSING), group)
        have = [v for v in values if not (key.startswith(OPTIONAL) and v == MISSING)]
        if any(v != have[0] for v in have):
            by_value: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(_shown(v), []).append(r)
            seen = "; ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} "
                             f"{', '.join(map(str, rs))}" for v, rs in by_value.items())
            raise ValueError(f"matrixfsdp: ranks set up {what} differently: {key}: {seen}. Every "
                             "rank must build the same model and optimizer"
                             + ("" if key in mine else " (this rank lacks it)"))
        settled.add(key)
