"""Tolerances derived from the dtype and the operation, never from one machine's rounding.

CI runs on Intel CPUs with AMX and on AMD CPUs with only AVX2, whose kernels block and order their
sums differently (and by the batch size: a matmul over 4 rows may tile otherwise than over 1). Two
computations that are equal in exact arithmetic then differ by rounding, and by how much follows
from the dtype and the length of the sums, not from what one machine happened to print.

Reordering a sum of n terms in a floating-point type of machine epsilon eps moves it by at most
about (n - 1) eps times the sum of the terms' magnitudes (the deterministic bound; random rounding
typically gives sqrt(n) eps). A chain of reductions (a matmul, then another) adds its lengths.
"""

from __future__ import annotations

import torch


def reordered_sums(dtype: torch.dtype, terms: int, magnitude: float = 1.0) -> dict[str, float]:
    """`rtol` and `atol` for torch.testing.assert_close between two evaluations that differ only in
    the order of sums totalling `terms` terms, whose terms are at most about `magnitude` in size."""
    bound = max(terms, 1) * torch.finfo(dtype).eps
    return {"rtol": bound, "atol": bound * magnitude}
