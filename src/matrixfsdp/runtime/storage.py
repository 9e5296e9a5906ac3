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

import torch

from .collectives import Comm, Pending
from .layout import UnitLayout, local_rows
from .mixed_precision import Precision


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
                 device: torch.device):
        self.layout, self.rank, self.precision = layout, rank, precision
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
        if i in lay.whole_offset:
            return _alias(self.whole, lay.whole_offset[i], spec.shape)
        return _alias(self.even, lay.P * lay.even_offset[i], spec.shape)

    @torch.no_grad()
    def copy_in(self, params: list[torch.Tensor]) -> None:
        """Fill this rank's segment from the full (unsharded) parameters."""
        for i, p in enumerate(params):
            self.shard_view(i).copy_(local_rows(p.detach(), self.layout.placements[i], self.rank))

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
    def full_tensors(self, comm: Comm) -> list[torch.Tensor]:
        """Every parameter's full tensor, fresh, in the parameters' dtype (a collective)."""
        lay = self.layout
        full = [torch.empty(pl.spec.shape, dtype=self.local.dtype, device=self.local.device)
                for pl in lay.placements]
        padded = {i: self.local.new_empty(lay.P * lay.chunk[i]) for i in lay.even}
        self._gather(comm, self.local.dtype, lambda pc: full[pc.index].view(-1)[
            pc.row_start * lay.placements[pc.index].spec.row_numel:][:pc.numel],
            [padded[i] for i in lay.even]).wait()
        for i in lay.even:
            full[i].view(-1).copy_(padded[i][:full[i].numel()])
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
        for pc in lay.pieces:
            dst = piece_dst(pc)
            if pc.rank == self.rank:
                dst.copy_(self.local[pc.seg_offset:pc.seg_offset + pc.numel])
            parts.append(comm.broadcast(dst, pc.rank))

        def copy_out() -> None:
            if gathered is not None:
                torch.split_with_sizes_copy(
                    gathered.view(lay.P, lay.even_numel), [lay.chunk[i] for i in lay.even], dim=1,
                    out=[b.view(lay.P, lay.chunk[i]) for b, i in zip(even_blocks, lay.even)])
        return Pending.all(parts, copy_out)

    # ---- gradient reduce --------------------------------------------------------------------
    @torch.no_grad()
    def start_reduce(self, comm: Comm, grads: list[torch.Tensor | None], trainable: tuple[bool, ...]
                     ) -> tuple[Pending, torch.Tensor, UnitLayout, list[int]] | None:
        """Start averaging the unsharded gradients ``grads`` (None: no gradient this pass)
        to where each parameter lives. Frozen parameters do not travel: the reduce has the
        layout of the ``trainable`` ones. Returns the collectives in flight, the output
        segment (this rank's pieces, in that layout, final once waited for), that layout
        and its parameters' indices here; None if nothing is trainable."""
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
                n, g = lay.placements[j].spec.numel, grads[index[j]]
                parts += [like.new_zeros(offset - at)] if offset > at else []
                parts.append(like.new_zeros(n) if g is None else g.reshape(-1))
                at = offset + n
            torch.cat(parts, out=whole)
        out = buf.new_empty(lay.seg_sizes[self.rank])
        parts = [comm.reduce_scatter(out[:E], buf[:P * E])] if E else []
        parts += [comm.reduce(whole[pc.offset:pc.offset + pc.numel], pc.rank) for pc in lay.pieces]

        def collect() -> None:  # the pieces this rank holds, into its segment
            for pc in lay.held[self.rank]:
                out[pc.seg_offset:pc.seg_offset + pc.numel].copy_(
                    whole[pc.offset:pc.offset + pc.numel])
        return Pending.all(parts, collect), out, lay, index

