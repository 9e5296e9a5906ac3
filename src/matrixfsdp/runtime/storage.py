"""A unit's storage and the data movement around it: copy-in, unshard, reshard, reduce.

FSDP2's ``FSDPParamGroup`` storage half. Per unit and rank:

* ``local``: this rank's segment (:mod:`matrixfsdp.runtime.layout`), 1-D, in the parameters'
  dtype. The sharded parameters (what ``model.parameters()`` and the optimizer see) are
  views into it: row chunks of the even parameters, whole matrices on their owner.
* ``whole`` / ``even``: the unsharded buffers, in the compute dtype (the policy's
  ``param_dtype``). Whole parameters are views into ``whole`` (each piece broadcast
  straight into its place); even parameters are views into padded blocks of ``even``,
  filled from the all-gather's output by one batched copy. Resharding frees both storages
  (``resize_(0)``) and keeps the tensor objects, so tensors autograd saved in forward are
  refilled in place by the backward gather.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .collectives import Comm, Pending
from .layout import Piece, UnitLayout, local_rows
from .mixed_precision import Precision
from .tp import TPGroups, slice_shape, tp_slice


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
    return t.set_(storage_owner.untyped_storage(), offset, shape, stride)


def _rows_padded(g: torch.Tensor | None, P: int, chunk: int, like: torch.Tensor) -> torch.Tensor:
    """Gradient ``g`` of an even parameter as ``(P, chunk)``: its rows, zero-padded to P
    chunks (zeros where the pass gave it no gradient)."""
    if g is None:
        return like.new_zeros(()).expand(P, chunk)
    flat = g.reshape(-1)
    if flat.numel() != P * chunk:
        flat = torch.nn.functional.pad(flat, (0, P * chunk - flat.numel()))
    return flat.view(P, chunk)


class UnitStorage:
    """One unit's sharded segment and unsharded buffers on one rank (see module doc)."""

    def __init__(self, layout: UnitLayout, rank: int, dtype: torch.dtype, precision: Precision,
                 device: torch.device, tp: TPGroups | None = None):
        self.layout, self.rank, self.precision, self.tp = layout, rank, precision, tp
        lay = layout
        # zeros: short chunks' padding is sent and reduced as zeros
        self.local = torch.zeros(lay.seg_sizes[rank], dtype=dtype, device=device)
        self.whole = torch.empty(lay.whole_numel, dtype=precision.param, device=device)
        self.even = torch.empty(lay.P * lay.even_numel, dtype=precision.param, device=device)
        self.free()

    # ---- views ----------------------------------------------------------------------------
    def shard_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s piece on this rank (an empty placeholder where it holds none)."""
        pl = self.layout.placements[i]
        shape = pl.local_shape(self.rank)
        start = self.layout.shard_offset(i, self.rank)
        return self.local[start:start + math.prod(shape)].view(shape)

    def unsharded_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s full tensor in the unsharded buffers (valid while unsharded)."""
        lay, spec = self.layout, self.layout.placements[i].spec
        if i in lay.whole_offset:  # a tp-split matrix: this tp rank's slice
            return _alias(self.whole, lay.whole_offset[i], slice_shape(spec))
        return _alias(self.even, lay.P * lay.even_offset[i], spec.shape)

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
        for buf in (self.whole, self.even):
            nbytes = buf.numel() * buf.element_size()
            if buf.untyped_storage().size() != nbytes:
                buf.untyped_storage().resize_(nbytes)

    def free(self) -> None:
        for buf in (self.whole, self.even):
            buf.untyped_storage().resize_(0)

    @torch.no_grad()
    def start_unshard(self, comm: Comm) -> Pending:
        """Start gathering the unit into ``whole`` / ``even`` (allocated here)."""
        self.allocate()
        lay = self.layout
        blocks = [self.even[lay.P * lay.even_offset[i]:lay.P * (lay.even_offset[i] + lay.chunk[i])]
                  for i in lay.even]
        return self._gather(comm, self.precision.param,
                            lambda pc: self.whole[pc.offset:pc.offset + pc.numel], blocks)

    @torch.no_grad()
    def full_tensors(self, comm: Comm, tp_params: list | None = None) -> list[torch.Tensor]:
        """Every parameter's full tensor, fresh, in the parameters' dtype (a collective).
        TP (``tp_params``, per parameter its TPParam or None): the whole logical tensor,
        each tp rank's piece all-gathered over the tp group, as DTensor's ``full_tensor``."""
        lay = self.layout
        full = [torch.empty(slice_shape(pl.spec) if i in lay.whole_offset else pl.spec.shape,
                            dtype=self.local.dtype, device=self.local.device)
                for i, pl in enumerate(lay.placements)]
        padded = {i: self.local.new_empty(lay.P * lay.chunk[i]) for i in lay.even}
        self._gather(comm, self.local.dtype, lambda pc: full[pc.index].view(-1)[
            pc.row_start * lay.placements[pc.index].spec.row_numel:][:pc.numel] if not pc.split
            else full[pc.index].view(-1), [padded[i] for i in lay.even]).wait()
        for i in lay.even:
            full[i].view(-1).copy_(padded[i][:full[i].numel()])
        for i, info in enumerate(tp_params or []):
            if info is not None and info.shard_dim is not None:
                full[i] = DTensor.from_local(full[i], info.mesh, info.placements,
                                             run_check=False).full_tensor()
        return full

    def _gather(self, comm: Comm, dtype: torch.dtype, piece_dst, even_blocks: list[torch.Tensor]
                ) -> Pending:
        """One all-gather of the even parts (copied out into ``even_blocks``, each a padded
        ``P x chunk`` parameter), one broadcast per whole piece into ``piece_dst(piece)``."""
        lay, parts = self.layout, []
        gathered = None
        if lay.even_numel:
            gathered = self.local.new_empty(lay.P * lay.even_numel, dtype=dtype)
            parts.append(comm.all_gather(gathered, self.local[:lay.even_numel].to(dtype)))
        self._split_in(dtype, piece_dst)
        for pc in lay.pieces:
            dst = piece_dst(pc)
            if pc.rank == self.rank and not pc.split:
                dst.copy_(self.local[pc.seg_offset:pc.seg_offset + pc.numel])
            parts.append(comm.broadcast(dst, pc.rank))

        def copy_out() -> None:
            if gathered is not None:
                torch.split_with_sizes_copy(
                    gathered.view(lay.P, lay.even_numel), [lay.chunk[i] for i in lay.even], dim=1,
                    out=[b.view(lay.P, lay.chunk[i]) for b, i in zip(even_blocks, lay.even)])
        return Pending.all(parts, copy_out)

    # ---- tensor parallelism: the hop between a matrix's holder and its tp row ---------------
    def _split_plan(self, lay: UnitLayout) -> tuple[list[Piece], list[int], list[tuple[int, int]]]:
        """The slices this shard rank moves over its tp group, each slice's tp holder, and
        every tp rank's (sent, received) elements when the holders send them out."""
        pieces = lay.split_pieces[self.rank]
        owner = [lay.placements[pc.index].tp_owner for pc in pieces]
        T = self.tp.size
        held = [sum(pc.numel for pc, o in zip(pieces, owner) if o == t) for t in range(T)]
        total = sum(held)
        return pieces, owner, [((T - 1) * held[t], total - held[t]) for t in range(T)]

    def _split_in(self, dtype: torch.dtype, piece_dst) -> None:
        """Before the shard group's broadcasts: this shard rank's slices of its tp-split
        matrices, from the tp rank holding each whole, into ``piece_dst`` (one all-to-all
        over the tp group, waited for: the broadcasts send what it brings)."""
        lay = self.layout
        if self.tp is None or not lay.split_pieces[self.rank]:
            return
        pieces, owner, loads = self._split_plan(lay)
        T = self.tp.size
        mine = [pc for pc in pieces if pc.index in lay.split_seg]
        full = {pc.index: self.shard_view(pc.index) for pc in mine}
        inp = torch.cat([tp_slice(full[pc.index], lay.placements[pc.index].spec, s).reshape(-1)
                         for s in range(T) for pc in mine]).to(dtype) if mine else \
            self.local.new_empty(0, dtype=dtype)
        out_sizes = [sum(pc.numel for pc, o in zip(pieces, owner) if o == s) for s in range(T)]
        out = self.local.new_empty(sum(out_sizes), dtype=dtype)
        self.tp.gather.all_to_all(out, inp, out_sizes, [sum(pc.numel for pc in mine)] * T,
                                  loads).wait()
        at = 0
        for s in range(T):
            for pc, o in zip(pieces, owner):
                if o == s:
                    piece_dst(pc).copy_(out[at:at + pc.numel])
                    at += pc.numel

    def start_split_reduce(self, out: torch.Tensor, whole: torch.Tensor, lay: UnitLayout) -> Pending:
        """After the shard group's reduce (``whole``: this rank's gradient buffer, final for
        the pieces it holds): each averaged slice of a tp-split matrix goes to the tp rank
        holding the matrix whole, which assembles the whole gradient in ``out`` (the
        segment, layout ``lay``)."""
        pieces, owner, loads = self._split_plan(lay)
        T = self.tp.size
        mine = [pc for pc in pieces if pc.index in lay.split_seg]
        inp = torch.cat([whole[pc.offset:pc.offset + pc.numel]
                         for s in range(T) for pc, o in zip(pieces, owner) if o == s])
        recv = out.new_empty(T * sum(pc.numel for pc in mine))
        in_sizes = [sum(pc.numel for pc, o in zip(pieces, owner) if o == s) for s in range(T)]

        def assemble() -> None:
            at = 0
            for s in range(T):
                for pc in mine:
                    spec, seg = lay.placements[pc.index].spec, lay.split_seg[pc.index]
                    grad = out[seg:seg + spec.numel].view(spec.shape)
                    tp_slice(grad, spec, s).copy_(recv[at:at + pc.numel].view(slice_shape(spec)))
                    at += pc.numel
        return self.tp.grads.all_to_all(recv, inp, [recv.numel() // T] * T, in_sizes,
                                        [(r, s) for s, r in loads]).then(assemble)

    # ---- gradient reduce --------------------------------------------------------------------
    @torch.no_grad()
    def start_reduce(self, comm: Comm, grads: list[torch.Tensor | None], trainable: tuple[bool, ...],
                     divisor: float | None = None
                     ) -> tuple[Pending, torch.Tensor, UnitLayout, list[int], Any] | None:
        """Start averaging the unsharded gradients ``grads`` (None: no gradient this pass)
        to where each parameter lives, summed and divided by ``divisor`` (default: the shard
        group's size, the mean; FSDP2's ``set_gradient_divide_factor``). Frozen parameters
        do not travel: the reduce has the layout of the ``trainable`` ones. Returns the
        collectives in flight, the output segment (this rank's pieces, in that layout, final
        once waited for), that layout, its parameters' indices here, and (TP) a function that
        starts the gradients' hop to the tp ranks holding split matrices whole once the
        collectives are done (None without TP); None if nothing is trainable."""
        lay, index = self.layout.subset(trainable)
        if not lay.gathered_numel:
            return None
        P, E = lay.P, lay.even_numel
        dtype = self.precision.reduce
        buf = self.local.new_empty(lay.gathered_numel, dtype=dtype)
        like = buf[:0]
        if lay.even:
            torch.cat([_rows_padded(grads[index[j]], P, lay.chunk[j], like) for j in lay.even],
                      dim=1, out=buf[:P * E].view(P, E))
        whole = buf[P * E:]
        if lay.whole_offset:
            parts, at = [], 0
            for j, offset in lay.whole_offset.items():  # gaps: the alignment of each matrix
                n, g = lay.placements[j].spec.slice_numel, grads[index[j]]
                parts += [like.new_zeros(offset - at)] if offset > at else []
                parts.append(like.new_zeros(n) if g is None else g.reshape(-1))
                at = offset + n
            torch.cat(parts, out=whole)
        out = buf.new_empty(lay.seg_sizes[self.rank])
        parts = [comm.reduce_scatter(out[:E], buf[:P * E], divisor)] if E else []
        parts += [comm.reduce(whole[pc.offset:pc.offset + pc.numel], pc.rank, divisor)
                  for pc in lay.pieces]

        def collect() -> None:  # the pieces this rank holds, into its segment
            for pc in lay.held[self.rank]:
                out[pc.seg_offset:pc.seg_offset + pc.numel].copy_(
                    whole[pc.offset:pc.offset + pc.numel])
        hop = None
        if self.tp is not None and lay.split_pieces[self.rank]:
            def hop() -> Pending:
                return self.start_split_reduce(out, whole, lay)
        return Pending.all(parts, collect), out, lay, index, hop

