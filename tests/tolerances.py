"""Tolerances derived from the dtype and the operation, never from one machine's rounding.

CI runs on Intel CPUs with AMX and on AMD CPUs with only AVX2, whose kernels block and order their
sums differently (and by the batch size: a matmul over 4 rows may tile otherwise than over 1). Two
computations that are equal in exact arithmetic then differ by rounding, and by how much follows
from the dtype and the length of the sums, not from what one machine happened to print.

Reordering a sum of n terms in a floating-point type of machine epsilon eps moves it by at most
about (n - 1) eps times the sum of the terms' magnitudes (the deterministic bound; random rounding
typically gives sqrt(n) eps). A chain of reductions (a matmul, then another) adds its lengths.
Likewise a formula evaluated by two sequences of n correctly rounded operations (another
implementation of an update, a fused multiply-add or not) differs by at most about n eps relative.

What stays bitwise: two evaluations by the same ops on the same shapes in the same order (a
recomputation, a resumed run, the same kernel on the same data). Another shape is another
evaluation: a BLAS library picks its kernel, and with it the order of each dot product's sum, by
the matrix's size (measured on an AMD EPYC: a matmul of 1 to 3 rows sums otherwise than one of 48).
"""

from __future__ import annotations

import torch


def reordered_sums(dtype: torch.dtype, terms: int, magnitude: float = 1.0) -> dict[str, float]:
    """`rtol` and `atol` for torch.testing.assert_close between two evaluations that differ only in
    the order of sums totalling `terms` terms, whose terms are at most about `magnitude` in size."""
    bound = max(terms, 1) * torch.finfo(dtype).eps
    return {"rtol": bound, "atol": bound * magnitude}


def assert_reordered(actual, expected: torch.Tensor, terms: int, **kwargs) -> None:
    """torch.testing.assert_close within `reordered_sums` of fp32 (or `dtype=`), the terms taken at
    the scale of `expected`'s largest value; other keywords (msg) go to assert_close."""
    dtype = kwargs.pop("dtype", torch.float32)
    torch.testing.assert_close(actual, expected, **reordered_sums(dtype, terms, float(expected.abs().max())), **kwargs)


def largest_difference(dtype: torch.dtype, terms: int, scale: float) -> float:
    """The largest |a - b| that `reordered_sums` accepts between values at most `scale` in size, for
    tests that compare one maximum difference (computed in another process, say)."""
    tolerance = reordered_sums(dtype, terms, scale)
    return tolerance["atol"] + tolerance["rtol"] * scale


def rounded_ops(dtype: torch.dtype, ops: int, magnitude: float = 1.0) -> dict[str, float]:
    """`rtol` and `atol` between two evaluations of one elementwise formula by sequences of at most
    `ops` rounded operations each, on values at most about `magnitude` in size."""
    return reordered_sums(dtype, ops, magnitude)


def then_rounded_to(dtype: torch.dtype, tolerance: dict[str, float], magnitude: float = 1.0) -> dict[str, float]:
    """`tolerance` between two results that are then each rounded to `dtype` (bf16 outputs computed
    in fp32): the roundings may fall on either side, one unit in the last place of `dtype` apart."""
    eps = torch.finfo(dtype).eps
    return {"rtol": tolerance["rtol"] + eps, "atol": tolerance["atol"] + eps * magnitude}


def transformer_sums(n_layers: int, dim: int, hidden: int, seq: int, head_dim: int) -> int:
    """The length of the sums along a decoder's forward, for `reordered_sums` when two evaluations of
    a model's logits differ in all of them (another batch shape, another attention kernel): per block
    the norms and projections over `dim` (five), the scores over `head_dim`, the softmax and the
    weighted sum over at most `seq` keys, the feed-forward's output over `hidden` (for an MoE block,
    pass the experts' hidden size plus the router's sums); then the final norm and output projection.
    A backward runs the chain again and sums a weight's gradient over the tokens: 2 x this + tokens."""
    return n_layers * (5 * dim + head_dim + 2 * seq + hidden) + 2 * dim
