"""Newton-Schulz, ``torch.optim.Muon``'s orthogonalisation, as the owners run it: on a whole
matrix (or a batch of them) on one GPU, or on the slices of matrices a tensor-parallel group
owns, each rank updating its own slice (:func:`newton_schulz_split_`)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def zeropower_via_newtonschulz(g: torch.Tensor, coefficients: tuple[float, float, float],
                               steps: int, eps: float,
                               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximately orthogonalise the ``m x n`` matrix ``g`` (``torch.optim.Muon``'s NS),
    or each matrix of a ``(k, m, n)`` stack (batched, each matrix on its own).

    Runs in ``dtype`` on the wide orientation: Frobenius-normalise, then ``steps`` quintic
    iterations ``X <- aX + (bA + cA^2) X`` with ``A = X X^T``. Returns a tensor of ``g``'s
    shape in ``dtype``; ``g`` is not modified.
    """
    return newton_schulz_(g.to(dtype, copy=True), coefficients, steps, eps)


def newton_schulz_(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                    eps: float) -> torch.Tensor:
    """NS on ``x``, which the caller hands over (it is normalised in place)."""
    a, b, c = coefficients
    wide = x.size(-2) <= x.size(-1)
    if not wide:
        x = x.mT
    if x.dim() == 2:
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    else:  # (k, m, n) experts: one batched NS, each expert with its own norm
        x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = torch.bmm(x, x.mT)
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x if wide else x.mT


def newton_schulz_split_(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                         eps: float, shape: tuple[int, int], dim: int,
                         all_reduce: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """NS of matrices of ``shape`` that a group of ranks holds in slices along ``dim``: ``x``
    is this rank's slice ``(r, c)``, or a batch ``(k, r, c)`` of slices of ``k`` such
    matrices, each orthogonalised on its own; ``all_reduce(t)`` sums ``t`` over the group in
    place. Returns this rank's slice of each result. The caller hands ``x`` over.

    The iteration is torch's, ``X <- aX + (bA + cA^2) X`` with ``A = X X^T`` on the wide
    orientation, written in the Gram of the sliced dim's complement: sliced along the wide
    matrix's columns, ``A = sum_i X_i X_i^T`` (its rows x rows); along its rows, the same
    step as ``X <- aX + X (bH + cH^2)`` with ``H = sum_i X_i^T X_i``. Either Gram is one
    all-reduce per iteration (summed in float32), and each rank updates its slice with it;
    the Frobenius norm is a sum of squares over the slices (one more). With float32 NS the
    result equals NS on the whole matrix within float32 rounding; in bf16 each slice's Gram
    is rounded before the sum, the spread bf16 NS has between summation orders."""
    a, b, c = coefficients
    m, n = shape
    if m > n:  # torch's orientation: the wide one; slicing rows of X slices columns of X^T
        x, dim = x.mT, 1 - dim
    batched = x.dim() == 3
    squares = x.float().square().sum(dim=(-2, -1))
    all_reduce(squares)
    norm = squares.sqrt().to(x.dtype).clamp(min=eps)  # torch's norm, in the NS dtype
    x.div_(norm[:, None, None] if batched else norm)
    mm = torch.bmm if batched else torch.mm
    add = torch.baddbmm if batched else torch.addmm
    for _ in range(steps):
        gram = mm(x, x.mT) if dim == 1 else mm(x.mT, x)
        if gram.dtype != torch.float32:  # the slices' Grams summed in float32
            total = gram.float()
            all_reduce(total)
            gram = total.to(x.dtype)
        else:
            all_reduce(gram)
        poly = add(gram, gram, gram, beta=b, alpha=c)
        x = add(x, poly, x, beta=a) if dim == 1 else add(x, x, poly, beta=a)
    return x if m <= n else x.mT
