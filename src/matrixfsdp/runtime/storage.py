"""A unit's storage and the data movement around it: copy-in, unshard, reshard, reduce.

FSDP2's ``FSDPParamGroup`` storage half, over the layout :mod:`matrixfsdp.planning.layout`
computes (the same the planner counts). Per unit and rank:

* ``local``: this rank's segment, 1-D, in the parameters' dtype. The sharded parameters
  (what ``model.parameters()`` and the optimizer see) are views into it: row chunks of the
  even parameters, whole matrices on their owner.
* ``gathered`` / ``copied``: the unsharded buffers, in the compute dtype (the policy's
  ``param_dtype``). A gather writes every shard rank's chunk into ``gathered`` (one uneven
  all-gather where the process group has it, else an even all-gather of the even parts and
  a broadcast per piece); each 2-D matrix is a view of it, in its owner's chunk. The even
  parameters (padded blocks) and expert stacks live in ``copied``, filled from ``gathered``
  by a few batched copies. Resharding frees both storages (``resize_(0)``) and keeps the
  tensor objects, so tensors autograd saved in forward are refilled in place by the
  backward gather.

A gradient reduce lays the unsharded gradients out as every rank's chunk (with one flag per
parameter: whether this rank had a gradient for it) and reduces each chunk to its rank in
one uneven reduce-scatter (else one reduce-scatter of the even parts and flags, one reduce
per piece); this rank's chunk, averaged, is the storage of its shards' ``.grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from ..planning.layout import UnitLayout, calls, is_whole
from ..planning.types import Placement
from .collectives import Comm, Pending
from .mixed_precision import Precision
from .tp import TPGroups, slice_shape, tp_slice


def local_rows(full: torch.Tensor, placement: Placement, rank: int) -> torch.Tensor:
    """Rank's piece of the full tensor ``full`` (a view, shaped ``placement.local_shape``):
    the rows of dim 0 it holds (a 0-d tensor counts as one row)."""
    start, stop = placement.row_ranges[rank]
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


def _rows_padded(g: torch.Tensor | None, P: int, chunk: int, like: torch.Tensor) -> torch.Tensor:
    """Gradient ``g`` of an even parameter as ``(P, chunk)``: its rows, zero-padded to P
    chunks (zeros where the pass gave it no gradient)."""
    if g is None:
        return like.new_zeros(()).expand(P, chunk)
    flat = g.reshape(-1)
    if flat.numel() != P * chunk:
        flat = torch.nn.functional.pad(flat, (0, P * chunk - flat.numel()))
    return flat.view(P, chunk)


def _zeros(like: torch.Tensor, n: int) -> torch.Tensor:
    return like.new_zeros(()).expand(n)


def _split_sizes(lay: UnitLayout) -> list[int]:
    """Sizes that cut a buffer laid out as :attr:`UnitLayout.starts` into (chunk, gap)
    pairs: ``buf.split(sizes)[::2]`` is every rank's chunk."""
    out = []
    for r in range(lay.S):
        n = lay.chunk_size(r)
        out += [n, lay.starts[r + 1] - lay.starts[r] - n]
    return out


def _head_runs(lay: UnitLayout) -> list[tuple[int, int]]:
    """The chunks' heads (even parts) in a buffer laid out as :attr:`UnitLayout.starts`, as
    (offset, ranks) runs: consecutive ranks without pieces lie back to back."""
    runs: list[tuple[int, int]] = []
    r = 0
    for h in lay.holders + [lay.S]:
        if h > r:
            runs.append((lay.starts[r], h - r))
        if h < lay.S:
            runs.append((lay.starts[h], 1))
        r = h + 1
    return runs


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
        self._split = _split_sizes(layout) if layout.S > 1 and not layout.even else None
        self._gathered_chunks: list[torch.Tensor] | None = None
        self.free()

    # ---- views ----------------------------------------------------------------------------
    def shard_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s piece on this rank (an empty placeholder where it holds none)."""
        shape = self.layout.placements[i].local_shape(self.rank)
        start = self.layout.shard_offset(i, self.rank, self.tp_rank)
        return self.local[start:start + math.prod(shape)].view(shape)

    def unsharded_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s full tensor in the unsharded buffers (valid while unsharded)."""
        return self._full_view(i, self.gathered, self.copied)

    def _full_view(self, i: int, gathered: torch.Tensor, copied: torch.Tensor) -> torch.Tensor:
        lay, pl = self.layout, self.layout.placements[i]
        if is_whole(pl) and pl.owner is not None:  # a 2-D matrix: in its owner's chunk
            return _alias(gathered, lay.whole_offset(i), slice_shape(pl.spec))
        return _alias(copied, lay.copied[i], pl.spec.shape)

    def _chunks(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Every shard rank's chunk of ``buf`` (laid out as :attr:`UnitLayout.starts`)."""
        if buf is self.gathered:
            if self._gathered_chunks is None:  # views stay valid across resize_ of the storage
                self._gathered_chunks = list(buf.split(self._split)[::2])
            return self._gathered_chunks
        return list(buf.split(self._split)[::2])

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
        """Every shard rank's chunk into ``gathered`` (this rank's written here first, in
        ``gathered``'s dtype), then the even parameters and expert stacks copied out into
        ``copied``: the calls :func:`~matrixfsdp.planning.layout.calls` lists."""
        lay, me = self.layout, self.rank
        mine = gathered[lay.starts[me]:lay.starts[me] + lay.chunk_size(me)]
        self._fill_chunk(mine)
        parts, rows = [], None
        for call in calls(lay, reduce=False, grouped=comm.grouped):
            if call.kind == "all_gather_v":
                parts.append(comm.all_gather_v(self._chunks(gathered), mine))
            elif call.kind == "all_gather" and lay.even:  # whole chunks of one size
                parts.append(comm.all_gather(gathered, mine))
            elif call.kind == "all_gather":  # the even parts; the pieces broadcast next
                rows = gathered.new_empty(lay.S, lay.head)
                parts.append(comm.all_gather(rows.view(-1), mine[:lay.head]))
            else:
                pc = call.piece
                at = lay.starts[pc.rank] + pc.offset
                parts.append(comm.broadcast(gathered[at:at + pc.numel], pc.rank))
        return Pending.all(parts, lambda: self._copy_out(gathered, copied, rows))

    def _fill_chunk(self, mine: torch.Tensor) -> None:
        """This rank's chunk of a gather, from its segment (cast to ``mine``'s dtype); the
        slices of tp-split matrices from the tp ranks holding them whole."""
        lay, seg, me = self.layout, self.segment, self.rank
        if lay.chunk_is_segment(me):
            mine.copy_(self.local)
            return
        mine[:lay.head].copy_(self.local[:lay.head])
        for pc in lay.pieces_at(me):
            if not pc.split:
                at = seg.offsets[pc.index]
                mine[pc.offset:pc.offset + pc.numel].copy_(self.local[at:at + pc.numel])
        self._split_in(mine)

    def _even_parts(self, gathered: torch.Tensor) -> torch.Tensor:
        """The gathered even parts as ``(S, E)`` (a strided view where chunks are of one size)."""
        lay = self.layout
        if lay.even:
            c = lay.chunk_size(0)
            return gathered[:lay.S * c].view(lay.S, c)[:, :lay.even_numel]
        E = lay.even_numel  # a gather's chunks have no flags: runs of heads are (n, E) blocks
        return torch.cat([gathered[at:at + n * E].view(n, E) for at, n in _head_runs(lay)])

    def _copy_out(self, gathered: torch.Tensor, copied: torch.Tensor,
                  rows: torch.Tensor | None) -> None:
        """The even parameters' padded blocks and the expert stacks' rows into ``copied``."""
        lay, S = self.layout, self.layout.S
        if lay.even_numel:
            src = rows if rows is not None else self._even_parts(gathered)
            torch.split_with_sizes_copy(
                src, [lay.chunk[i] for i in lay.rows], dim=1,
                out=[copied[lay.copied[i]:lay.copied[i] + S * lay.chunk[i]].view(S, lay.chunk[i])
                     for i in lay.rows])
        for pc in lay.pieces:
            pl = lay.placements[pc.index]
            if pl.owner is None:  # rows of an expert stack
                at = lay.copied[pc.index] + pc.row_start * pl.spec.row_numel
                src = lay.starts[pc.rank] + pc.offset
                copied[at:at + pc.numel].copy_(gathered[src:src + pc.numel])

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

    def _split_in(self, mine: torch.Tensor) -> None:
        """This shard rank's slices of its tp-split matrices, from the tp rank holding each
        whole, into its chunk ``mine`` (one all-to-all over the tp group, waited for: the
        shard group's gather sends what it brings)."""
        lay, seg = self.layout, self.segment
        pieces, held, loads = self._split_plan()
        T, t = self.tp.size, self.tp_rank
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
                    mine[pc.offset:pc.offset + pc.numel].copy_(out[at:at + pc.numel])
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
                     divisor: float | None = None
                     ) -> tuple[Pending, torch.Tensor, UnitLayout, list[int], Callable | None]:
        """Start averaging the unsharded gradients ``grads`` (None: no gradient this pass)
        to where each parameter lives, summed and divided by ``divisor`` (default: the shard
        group's size, the mean; FSDP2's ``set_gradient_divide_factor``). Frozen parameters
        do not travel: the reduce has the layout of the ``trainable`` ones
        (:meth:`~matrixfsdp.planning.layout.UnitLayout.reduce_layout`), whose flags count the
        ranks that had a gradient for each. Returns the collectives in flight, the output
        segment (final once they are waited for), its layout, its parameters' indices here,
        and (TP) a function that starts the gradients' hop to the tp ranks holding split
        matrices whole once the collectives are done (None without TP)."""
        lay, index = self.layout.reduce_layout(trainable)
        S, H, me = lay.S, lay.head, self.rank
        like = self.local.new_empty(0, dtype=self.precision.reduce)
        had = [grads[i] is not None for i in index]
        rows = like.new_empty(S, H)
        flags = like.new_ones(len(had)) if all(had) else \
            torch.tensor(had, dtype=like.dtype, device=like.device)
        torch.cat([_rows_padded(grads[index[j]], S, lay.chunk[j], like) for j in lay.rows]
                  + [flags.expand(S, len(had))], dim=1, out=rows)
        send = self._send_buffer(lay, rows, [grads[i] for i in index], like) if lay.pieces \
            else rows.view(-1)
        recv = like.new_empty(lay.chunk_size(me))
        parts = []
        plan = calls(lay, reduce=True, grouped=comm.grouped)
        for call in plan:
            if call.kind == "reduce_scatter_v":
                parts.append(comm.reduce_scatter_v(recv, list(send.split(_split_sizes(lay))[::2]),
                                                   divisor))
            elif call.kind == "reduce_scatter":  # the whole chunks, or the even parts alone
                parts.append(comm.reduce_scatter(recv if lay.even else recv[:H],
                                                 send if lay.even else rows.view(-1), divisor))
            else:
                pc = call.piece
                at = lay.starts[pc.rank] + pc.offset
                parts.append(comm.reduce(send[at:at + pc.numel], pc.rank, divisor))
        if S == 1:  # no collective: this rank's chunk is the whole buffer
            recv.copy_(send[:recv.numel()])
            if divisor not in (None, 1):
                recv.div_(divisor)
        own = lay.pieces_at(me) if any(c.kind == "reduce" for c in plan) else []
        out = recv if lay.chunk_is_segment(me) else like.new_empty(lay.segment(me, self.tp_rank).size)

        def collect() -> None:  # the pieces reduced in place in ``send``, into this rank's chunk
            base = lay.starts[me]
            for pc in own:
                recv[pc.offset:pc.offset + pc.numel].copy_(send[base + pc.offset:][:pc.numel])
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
        return Pending.all(parts, collect), out, lay, index, hop

    def _send_buffer(self, lay: UnitLayout, rows: torch.Tensor,
                     grads: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
        """Every rank's chunk of the gradients, laid out as :attr:`UnitLayout.starts`: the
        heads (``rows``: even rows and flags), each piece's gradient at its place, zeros in
        the alignment gaps. One ``torch.cat``."""
        parts: list[torch.Tensor] = []
        pos, r = 0, 0
        for h in lay.holders:
            if h > r:
                parts.append(rows[r:h].reshape(-1))
                pos += (h - r) * lay.head
            base = lay.starts[h]
            if base > pos:
                parts.append(_zeros(like, base - pos))
            parts.append(rows[h])
            pos = base + lay.head
            for pc in lay.pieces_at(h):
                if base + pc.offset > pos:
                    parts.append(_zeros(like, base + pc.offset - pos))
                g = grads[pc.index]
                if g is None:
                    parts.append(_zeros(like, pc.numel))
                else:
                    rn = lay.placements[pc.index].spec.row_numel
                    flat = g.reshape(-1)
                    parts.append(flat if pc.split or flat.numel() == pc.numel else
                                 flat[pc.row_start * rn:pc.row_stop * rn])
                pos = base + pc.offset + pc.numel
            r = h + 1
        if r < lay.S:
            parts.append(rows[r:].reshape(-1))
            pos += (lay.S - r) * lay.head
        if lay.gathered_numel > pos:
            parts.append(_zeros(like, lay.gathered_numel - pos))
        send = like.new_empty(lay.gathered_numel)
        torch.cat(parts, out=send)
        return send
