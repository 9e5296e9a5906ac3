"""A unit's storage and the data movement around it: copy-in, unshard, reshard, reduce.

FSDP2's ``FSDPParamGroup`` storage half, over the layout :mod:`matrixfsdp.layout.units`
computes (the same the planner counts). Per unit and rank:

* ``local``: this rank's segment, 1-D, in the parameters' dtype. The sharded parameters
  (what ``model.parameters()`` and the optimizer see) are views into it: row chunks of the
  even parameters, whole matrices on their owner.
* ``gathered`` / ``copied``: the unsharded buffers, in the compute dtype (the policy's
  ``param_dtype``). A gather is the ops :func:`~matrixfsdp.layout.units.calls` lists,
  one launch where the group coalesces: an even all-gather of the even parts and one
  broadcast of each holder's region into ``gathered`` (or, chunks of one size, one
  all-gather of them); each 2-D matrix is a view of ``gathered``. The even parameters
  (padded blocks) and expert stacks live in ``copied``, filled by a few batched copies;
  ``gathered`` is freed then unless matrices live in it. Resharding frees both storages
  (``resize_(0)``) and keeps the tensor objects, so tensors autograd saved in forward are
  refilled in place by the backward gather.

A gradient reduce lays the unsharded gradients out as every rank's even rows plus one flag
per parameter (whether this rank had a gradient for it), reduce-scattered, and each
holder's region of pieces, reduced to it (chunks of one size: one reduce-scatter of them);
this rank's chunk, averaged, is the storage of its shards' ``.grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from .._compat import CHUNK_CAT
from ..layout.types import Placement
from ..layout.units import UnitLayout, calls, is_whole
from .collectives import Comm, Pending
from .mixed_precision import Precision
from .tp import TPGroups, slice_shape, tp_slice


@dataclass(frozen=True)
class ShardReduce:
    """A unit's gradients reduced over its shard group, in flight: ``pending`` (its
    collectives), ``out`` (this rank's segment of the gradients, laid out as ``layout``;
    final once ``pending`` is waited for), ``index`` (the layout's parameters' indices in the
    unit: the trainable ones) and, under TP, ``hop`` (starts, once ``pending`` is done, the
    slices of split matrices' gradients to the tp ranks holding them whole; else None)."""

    pending: Pending
    out: torch.Tensor
    layout: UnitLayout
    index: list[int]
    hop: Callable[[], Pending] | None


def local_rows(full: torch.Tensor, placement: Placement, rank: int) -> torch.Tensor:
    """Rank's piece of the full tensor ``full`` (a view, shaped ``placement.local_shape``):
    the rows of dim 0 it holds (a 0-d tensor counts as one row), and of a tp rank's column
    slice (``placement.cols``) those columns."""
    start, stop = placement.row_ranges[rank]
    if placement.cols is not None:
        a, b = placement.cols
        return full[start:stop, a:b]
    return full.reshape(placement.spec.rows, placement.spec.row_numel)[start:stop].view(
        placement.local_shape(rank))


def _alias(storage_owner: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor on ``storage_owner``'s storage with a version counter of its own.

    The gather writes into ``storage_owner`` in place between forward and backward; a
    plain view would share its version counter and autograd would reject the saved
    tensors, while the data it reads is exactly the data it saved.
    """
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    t = torch.empty(0, dtype=storage_owner.dtype, device=storage_owner.device)
    return t.set_(storage_owner.untyped_storage(), storage_owner.storage_offset() + offset,
                  shape, stride)


def copy_in_rows(rows: torch.Tensor, grads: list[torch.Tensor | None],
                 chunks: list[int]) -> None:
    """Write gradients into ``rows`` (``S`` x the columns they fill, from column 0): each
    gradient's rows cut into ``S`` chunks of ``chunk`` elements, the last ones zero-padded in
    place, zeros where the pass gave it none; FSDP2's copy-in (``torch._chunk_cat``: one
    kernel, no padded copy of an uneven gradient). A gradient in another dtype than
    ``rows`` is cast first, as FSDP2 casts it to its reduce dtype."""
    S = rows.shape[0]
    parts = []
    for g, chunk in zip(grads, chunks):
        if not chunk:
            continue
        if g is None:
            parts.append(rows.new_zeros(()).expand(S, chunk))
        else:
            parts.append(g if g.dtype == rows.dtype else g.to(rows.dtype))
    if parts:
        CHUNK_CAT(parts, dim=0, num_chunks=S, out=rows[:, :sum(chunks)])


def _zeros(like: torch.Tensor, n: int) -> torch.Tensor:
    return like.new_zeros(()).expand(n)


class UnitStorage:
    """One unit's sharded segment and unsharded buffers on one rank (see module doc)."""

    def __init__(self, layout: UnitLayout, rank: int, dtype: torch.dtype, precision: Precision,
                 device: torch.device, tp: TPGroups | None = None):
        self.layout, self.rank, self.precision, self.tp = layout, rank, precision, tp
        self.tp_rank = tp.rank if tp is not None else 0
        self.segment = layout.segment(rank, self.tp_rank)
        # zeros: short chunks' padding is sent and reduced as zeros
        self.local = torch.zeros(self.segment.size, dtype=dtype, device=device)
        self.gathered = torch.empty(layout.gathered_numel, dtype=precision.param, device=device)
        self.copied = torch.empty(layout.copied_numel, dtype=precision.param, device=device)
        # Each parameter's unsharded tensor, made now that the buffers are allocated: made on
        # a freed storage, ``Tensor.set_`` would allocate it again to the view's extent, and
        # every unit would hold its unsharded size from set-up to its first reshard.
        self._unsharded = [self._full_view(i, self.gathered, self.copied)
                           for i in range(len(layout.placements))]
        self.free()

    # ---- views ----------------------------------------------------------------------------
    def shard_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s piece on this rank (an empty placeholder where it holds none)."""
        shape = self.layout.placements[i].local_shape(self.rank)
        start = self.layout.shard_offset(i, self.rank, self.tp_rank)
        return self.local[start:start + math.prod(shape)].view(shape)

    def unsharded_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s full tensor in the unsharded buffers (valid while unsharded)."""
        return self._unsharded[i]

    def _full_view(self, i: int, gathered: torch.Tensor, copied: torch.Tensor) -> torch.Tensor:
        lay, pl = self.layout, self.layout.placements[i]
        if is_whole(pl) and pl.owner is not None:  # a 2-D matrix: in its owner's chunk
            return _alias(gathered, lay.whole_offset(i), slice_shape(pl.spec))
        return _alias(copied, lay.copied[i], pl.spec.shape)

    @torch.no_grad()
    def copy_in(self, params: list[torch.Tensor]) -> None:
        """Fill this rank's segment from the full (unsharded) parameters. TP: a tp-split
        matrix is assembled whole (a collective of the tp group, on every tp rank alike),
        any other DTensor is its local tensor."""
        for i, p in enumerate(params):
            t = p.detach()
            if isinstance(t, DTensor):
                t = t.full_tensor() if self.layout.placements[i].spec.tp > 1 else t.to_local()
            self.shard_view(i).copy_(local_rows(t, self.layout.placements[i], self.rank))

    # ---- unshard / reshard ------------------------------------------------------------------
    def allocate(self) -> None:
        for buf in (self.gathered, self.copied):
            nbytes = buf.numel() * buf.element_size()
            if buf.untyped_storage().size() != nbytes:
                buf.untyped_storage().resize_(nbytes)

    def free(self) -> None:
        for buf in (self.gathered, self.copied):
            buf.untyped_storage().resize_(0)

    @torch.no_grad()
    def start_unshard(self, comm: Comm) -> Pending:
        """Start gathering the unit into ``gathered`` / ``copied`` (allocated here)."""
        self.allocate()
        return self._gather(comm, self.gathered, self.copied)

    @torch.no_grad()
    def full_tensors(self, comm: Comm, tp_params: list | None = None) -> list[torch.Tensor]:
        """Every parameter's full tensor, fresh, in the parameters' dtype (a collective).
        TP (``tp_params``, per parameter its TPParam or None): the whole logical tensor,
        each tp rank's piece all-gathered over the tp group, as DTensor's ``full_tensor``."""
        lay = self.layout
        gathered = self.local.new_empty(lay.gathered_numel)
        copied = self.local.new_empty(lay.copied_numel)
        self._gather(comm, gathered, copied).wait()
        full = [self._full_view(i, gathered, copied) for i in range(len(lay.placements))]
        for i, info in enumerate(tp_params or []):
            if info is not None and info.shard_dim is not None:
                full[i] = DTensor.from_local(full[i], info.mesh, info.placements,
                                             run_check=False).full_tensor()
        return full

    def _gather(self, comm: Comm, gathered: torch.Tensor, copied: torch.Tensor) -> Pending:
        """The ops :func:`~matrixfsdp.layout.units.calls` lists (this rank's part written
        first, in ``gathered``'s dtype), one launch where the group coalesces; then the even
        parameters and expert stacks copied out into ``copied``."""
        lay, me, H = self.layout, self.rank, self.layout.head
        if lay.even:  # whole chunks of one size: this rank's is its place in ``gathered``
            mine = gathered[lay.base(me):lay.base(me) + lay.chunk_size(me)]
            self._fill_chunk(mine[:H], gathered,
                             lay.base(me) if me in lay.holder_sizes else None)
            rows, everyone = None, gathered
        else:  # the even parts in a transient S x head buffer, the regions into ``gathered``
            rows = gathered.new_empty(lay.S, H)
            mine = rows[me]
            self._fill_chunk(mine, gathered, lay.base(me) if me in lay.holder_sizes else None)
            everyone = rows.view(-1)
        ops = [(lambda c=c: comm.broadcast(self._region(gathered, lay, c.root), c.root))
               if c.root is not None else (lambda: comm.all_gather(everyone, mine))
               for c in calls(lay, reduce=False)]
        pending = comm.batch("gather", ops)
        return pending.then(lambda: self._copy_out(gathered, copied, rows))

    @staticmethod
    def _region(buf: torch.Tensor, lay: UnitLayout, h: int) -> torch.Tensor:
        """Holder ``h``'s region in a buffer laid out as the gathered one."""
        first, n = lay.region(h)
        at = lay.base(h) + first
        return buf[at:at + n]

    def _fill_chunk(self, head: torch.Tensor, pieces: torch.Tensor, base: int | None) -> None:
        """This rank's part of a gather, from its segment (cast to the buffers' dtype): its
        even part into ``head``, its pieces at ``base + offset`` of ``pieces`` (None: it
        holds none); the slices of tp-split matrices from the tp ranks holding them whole."""
        lay, seg, me = self.layout, self.segment, self.rank
        head.copy_(self.local[:lay.head])
        if base is None:
            return
        if lay.chunk_is_segment(me):
            first = lay.pieces_at(me)[0].offset
            pieces[base + first:base + lay.chunk_size(me)].copy_(self.local[first:])
            return
        for pc in lay.pieces_at(me):
            if not pc.split:
                at = seg.offsets[pc.index]
                pieces[base + pc.offset:][:pc.numel].copy_(self.local[at:at + pc.numel])
        self._split_in(pieces, base)

    def _copy_out(self, gathered: torch.Tensor, copied: torch.Tensor,
                  rows: torch.Tensor | None) -> None:
        """The even parameters' padded blocks and the expert stacks' rows into ``copied``;
        then ``gathered`` is freed unless 2-D matrices live in it."""
        lay, S = self.layout, self.layout.S
        if lay.even_numel:
            c = lay.chunk_size(0)
            src = rows if rows is not None else gathered[:S * c].view(S, c)
            torch.split_with_sizes_copy(
                src[:, :lay.even_numel], [lay.chunk[i] for i in lay.rows], dim=1,
                out=[copied[lay.copied[i]:lay.copied[i] + S * lay.chunk[i]].view(S, lay.chunk[i])
                     for i in lay.rows])
        for pc in lay.pieces:
            pl = lay.placements[pc.index]
            if pl.owner is None:  # rows of an expert stack
                at = lay.copied[pc.index] + pc.row_start * pl.spec.row_numel
                src = lay.base(pc.rank) + pc.offset
                copied[at:at + pc.numel].copy_(gathered[src:src + pc.numel])
        if not lay.keeps_gathered and gathered is self.gathered:
            gathered.untyped_storage().resize_(0)

    # ---- tensor parallelism: the hop between a matrix's holder and its tp row ---------------
    def _split_plan(self) -> tuple[list, list[int], list[tuple[int, int]]]:
        """The slices this shard rank moves over its tp group (its tp-split pieces), each
        slice's tp holder, and every tp rank's (sent, received) elements when the holders
        send them out."""
        pieces = [pc for pc in self.layout.pieces_at(self.rank) if pc.split]
        T = self.tp.size
        held = [sum(pc.numel for pc in pieces if pc.tp_owner == t) for t in range(T)]
        total = sum(held)
        return pieces, held, [((T - 1) * held[t], total - held[t]) for t in range(T)]

    def _split_in(self, buf: torch.Tensor, base: int) -> None:
        """This shard rank's slices of its tp-split matrices, from the tp rank holding each
        whole, into its chunk (at ``base + offset`` of ``buf``; one all-to-all over the tp
        group, waited for: the shard group's gather sends what it brings)."""
        lay, seg = self.layout, self.segment
        pieces, held, loads = self._split_plan()
        T, t = self.tp.size, self.tp_rank
        mine = buf
        dtype = mine.dtype
        own = [pc for pc in pieces if pc.tp_owner == t]
        full = {pc.index: self.local[seg.offsets[pc.index]:][:lay.placements[pc.index].spec.numel]
                .view(lay.placements[pc.index].spec.shape) for pc in own}
        inp = torch.cat([tp_slice(full[pc.index], lay.placements[pc.index].spec, s).reshape(-1)
                         for s in range(T) for pc in own]).to(dtype) if own else \
            mine.new_empty(0)
        out = mine.new_empty(sum(held))
        self.tp.gather.all_to_all(out, inp, held, [held[t]] * T, loads).wait()
        at = 0
        for s in range(T):
            for pc in pieces:
                if pc.tp_owner == s:
                    buf[base + pc.offset:][:pc.numel].copy_(out[at:at + pc.numel])
                    at += pc.numel

    def start_split_reduce(self, out: torch.Tensor, recv: torch.Tensor, lay: UnitLayout
                           ) -> Pending:
        """After the shard group's reduce (``recv``: this rank's chunk of layout ``lay``,
        averaged): each slice of a tp-split matrix goes to the tp rank holding the matrix
        whole, which assembles the whole gradient in ``out`` (its segment of ``lay``)."""
        pieces = [pc for pc in lay.pieces_at(self.rank) if pc.split]
        T, t = self.tp.size, self.tp_rank
        held = [sum(pc.numel for pc in pieces if pc.tp_owner == s) for s in range(T)]
        total = sum(held)
        loads = [((T - 1) * held[s], total - held[s]) for s in range(T)]
        own = [pc for pc in pieces if pc.tp_owner == t]
        inp = torch.cat([recv[pc.offset:pc.offset + pc.numel]
                         for s in range(T) for pc in pieces if pc.tp_owner == s])
        got = out.new_empty(T * held[t])
        seg = lay.segment(self.rank, t)

        def assemble() -> None:
            at = 0
            for s in range(T):
                for pc in own:
                    spec = lay.placements[pc.index].spec
                    grad = out[seg.offsets[pc.index]:][:spec.numel].view(spec.shape)
                    tp_slice(grad, spec, s).copy_(got[at:at + pc.numel].view(slice_shape(spec)))
                    at += pc.numel
        return self.tp.grads.all_to_all(got, inp, [held[t]] * T, held,
                                        [(r, s) for s, r in loads]).then(assemble)

    # ---- gradient reduce --------------------------------------------------------------------
    @torch.no_grad()
    def start_reduce(self, comm: Comm, grads: list[torch.Tensor | None], trainable: tuple[bool, ...],
                     divisor: float | None = None) -> ShardReduce:
        """Start averaging the unsharded gradients ``grads`` (None: no gradient this pass)
        to where each parameter lives, summed and divided by ``divisor`` (default: the shard
        group's size, the mean; FSDP2's ``set_gradient_divide_factor``). Frozen parameters
        do not travel: the reduce has the layout of the ``trainable`` ones
        (:meth:`~matrixfsdp.layout.units.UnitLayout.reduce_layout`), whose flags count the
        ranks that had a gradient for each (see :class:`ShardReduce`)."""
        lay, index = self.layout.reduce_layout(trainable)
        S, H, me = lay.S, lay.head, self.rank
        like = self.local.new_empty(0, dtype=self.precision.reduce)
        had = [grads[i] is not None for i in index]
        rows = like.new_empty(S, H)
        flags = rows[:, H - len(had):]  # the last columns: each rank's flags
        flags.fill_(1)
        for j, h in enumerate(had):
            if not h:
                flags[:, j] = 0  # a fill on the device: no host data copied to it
        copy_in_rows(rows, [grads[index[j]] for j in lay.rows], [lay.chunk[j] for j in lay.rows])
        send = self._send_buffer(lay, rows, [grads[i] for i in index], like)
        recv = like.new_empty(lay.chunk_size(me))
        mine = me in lay.holder_sizes  # this rank holds pieces: they come back to it

        pending = comm.batch("reduce", [
            (lambda c=c: comm.reduce(self._region(send, lay, c.root), c.root, divisor))
            if c.root is not None else
            (lambda: comm.reduce_scatter(recv if lay.even else recv[:H],
                                         send if lay.even else rows.view(-1), divisor))
            for c in calls(lay, reduce=True)])
        if S == 1:  # no collective: this rank's chunk is all there is
            recv[:H].copy_(rows[0])
            if mine:
                recv[lay.region(me)[0]:].copy_(self._region(send, lay, me))
            if divisor not in (None, 1):
                recv.div_(divisor)
        out = recv if lay.chunk_is_segment(me) else like.new_empty(lay.segment(me, self.tp_rank).size)

        def collect() -> None:  # this rank's region, reduced in place in ``send``, into its chunk
            if mine and S > 1 and not lay.even:
                recv[lay.region(me)[0]:].copy_(self._region(send, lay, me))
            if out is not recv:  # TP: the chunk's head and unsplit pieces into the segment
                seg = lay.segment(me, self.tp_rank)
                out[:H].copy_(recv[:H])
                for pc in lay.pieces_at(me):
                    if not pc.split:
                        out[seg.offsets[pc.index]:][:pc.numel].copy_(recv[pc.offset:][:pc.numel])
        hop = None
        if out is not recv:
            def hop() -> Pending:
                return self.start_split_reduce(out, recv, lay)
        return ShardReduce(pending.then(collect), out, lay, index, hop)

    def _send_buffer(self, lay: UnitLayout, rows: torch.Tensor,
                     grads: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
        """The gradients laid out as the gathered buffer: with :attr:`UnitLayout.even` every
        chunk (its row of ``rows``, even rows and flags, then its pieces), else the holders'
        regions alone; zeros in the alignment gaps. One ``torch.cat`` (``rows`` itself where
        the unit has no pieces)."""
        if not lay.pieces:
            return rows.view(-1)
        parts: list[torch.Tensor] = []
        pos = 0

        def put(at: int, t: torch.Tensor) -> None:
            nonlocal pos
            if at > pos:
                parts.append(_zeros(like, at - pos))
            parts.append(t)
            pos = at + t.numel()

        r = 0
        for h in lay.holders:
            base = lay.base(h)
            if lay.even:
                if h > r:
                    put(lay.base(r), rows[r:h].reshape(-1))
                put(base, rows[h])
            for pc in lay.pieces_at(h):
                g = grads[pc.index]
                if g is None:
                    put(base + pc.offset, _zeros(like, pc.numel))
                    continue
                rn = lay.placements[pc.index].spec.row_numel
                flat = g.reshape(-1)
                put(base + pc.offset, flat if pc.split or flat.numel() == pc.numel else
                    flat[pc.row_start * rn:pc.row_stop * rn])
            r = h + 1
        if lay.even and r < lay.S:
            put(lay.base(r), rows[r:].reshape(-1))
        if lay.gathered_numel > pos:
            parts.append(_zeros(like, lay.gathered_numel - pos))
        send = like.new_empty(lay.gathered_numel)
        torch.cat(parts, out=send)
        return send
