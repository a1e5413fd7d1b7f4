"""Vocabulary-parallel embedding and loss without host reads.

DTensor's `_MaskPartial` placement (torch 2.11-2.13) serves the vocabulary-sharded embedding
(tensor parallelism's `tok_embeddings`) and loss parallelism's cross-entropy: each rank masks the
ids outside its slice of the vocabulary, and later zeroes the masked rows before the reduction.
Both writes use a boolean-mask index (`t[mask] = 0`), which first counts the mask's true entries
on the host: on a GPU, five stalls of the stream in every tensor-parallel step (found by the
host-read audit, docs/performance.md "Host reads"). `masked_fill_` writes the same values, bit for
bit, without reading anything. No public API reaches these two methods, so they are replaced here,
once, when tensor parallelism is applied."""

from __future__ import annotations

import torch

from torchtitan.runtime.torch_compat import CPU, PrivateName

_PLACEMENTS = "torch.distributed.tensor.placement_types"
PRIVATE_NAMES = (
    PrivateName(f"{_PLACEMENTS}._MaskPartial._mask_tensor", ("tensor", "local_offset_on_dim", "local_shard_size"),
                checked=CPU),
    PrivateName("torch.distributed.tensor._ops._mask_buffer.MaskBuffer.apply_mask", ("self", "tensor"), checked=CPU),
    PrivateName("torch.distributed.tensor._ops._mask_buffer.MaskBuffer.data", instance=True, checked=CPU),
)


def _mask_tensor(tensor: torch.Tensor, local_offset_on_dim, local_shard_size) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids outside this rank's slice (the mask), and the ids shifted into the slice with the
    masked ones set to 0, as torch's own; masked_fill_ instead of a boolean-mask index."""
    mask = (tensor < local_offset_on_dim) | (tensor >= local_offset_on_dim + local_shard_size)
    masked = tensor.clone() - local_offset_on_dim
    masked.masked_fill_(mask, 0)
    return mask, masked


def _apply_mask(self, tensor: torch.Tensor) -> None:
    """Zeroes what the masked ids produced: the same element for a gather's output, the whole row
    for an embedding's (one more dimension than the ids)."""
    if self.refcount == 0 or self.data is None:
        raise RuntimeError("MaskBuffer has not been materialized")  # torch's own check, kept
    mask = self.data if tensor.ndim == self.data.ndim else self.data.unsqueeze(-1)
    tensor.masked_fill_(mask, 0.0)


# torch's own two methods, kept when they are replaced (the tests compare with them).
TORCH_ORIGINALS: dict[str, object] = {}


def mask_without_host_reads() -> None:
    """Replaces the two boolean-mask writes of `_MaskPartial` (idempotent)."""
    from torch.distributed.tensor import placement_types
    from torch.distributed.tensor._ops import _mask_buffer

    # torch wraps the original so that it also runs per rank under its LocalTensor simulation.
    wrap = getattr(placement_types, "maybe_run_for_local_tensor", lambda fn: fn)
    if getattr(placement_types._MaskPartial._mask_tensor, "__wrapped_by_torchtitan__", False):
        return
    TORCH_ORIGINALS.update(mask_tensor=placement_types._MaskPartial._mask_tensor,
                           apply_mask=_mask_buffer.MaskBuffer.apply_mask)
    replacement = wrap(_mask_tensor)
    replacement.__wrapped_by_torchtitan__ = True
    placement_types._MaskPartial._mask_tensor = staticmethod(replacement)
    _mask_buffer.MaskBuffer.apply_mask = _apply_mask
